"""On-policy distillation against RL on the embedded task (issue 52 item 4), from `train.py` runs as a user types them.

The teacher is `make train`'s run (PPO with a critic from the reward, seed 0: 0.92 held-out). Its actor then teaches
a fresh warm-started student (the same warm start `make train` starts from, 0.10 held-out) for the same 30 rollout
steps, with the same seed, as RL from the reward alone does; every run evaluates every 2 rollout steps:

    python train.py output_dir=<runs>/rl                                             # the teacher
    python train.py trainer.eval_every=2 seed=S output_dir=<runs>/rl_sS                  # RL from the reward alone
    python train.py ppo=distill model.teacher.path=<runs>/rl/actor trainer.eval_every=2 seed=S ...   # distillation
    python train.py ppo=distill model.teacher.path=<runs>/rl/actor ppo.distill.reward_coef=1.0 ...  # + the reward

    .venv/bin/python bench/distill_demo.py --runs runs/distill_demo --seed 0   # runs what is missing, then the table
    .venv/bin/python bench/distill_demo.py --runs runs/distill_demo --summary-only

Writes bench/results/distill_demo_<date>.{md,json,png}: held-out greedy accuracy per evaluation of each run, the first
rollout step at which each student is within 0.05 of the teacher, and the end accuracies.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STUDENTS = {  # name: train.py arguments (the teacher path is added)
    "rl": [],
    "distill": ["ppo=distill"],
    "distill_reward": ["ppo=distill", "ppo.distill.reward_coef=1.0"],
}


def run_dir(runs: Path, name: str, seed: int) -> Path:
    return runs / (name if name == "teacher" else f"{name}_s{seed}")


def train(arguments: list[str], output: Path) -> None:
    if (output / "summary.json").exists():
        print(f"{output}: done before, not run again")
        return
    command = [sys.executable, "train.py", *arguments, f"output_dir={output}"]
    print("$", " ".join(command[1:]), flush=True)
    with open(output.with_suffix(".log"), "w") as log:
        subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)


def evaluations(output: Path) -> dict[int, float]:
    with open(output / "metrics.csv") as f:
        return {int(r["rollout_step"]): float(r["eval/reward"]) for r in csv.DictReader(f) if r.get("eval/reward")}


def first_within(curve: dict[int, float], target: float, margin: float = 0.05) -> int | None:
    return next((step for step, accuracy in sorted(curve.items()) if accuracy >= target - margin), None)


def summarise(runs: Path, seeds: list[int]) -> dict:
    teacher = evaluations(run_dir(runs, "teacher", 0))
    teacher_accuracy = teacher[max(teacher)]
    result = {"teacher_final": teacher_accuracy, "seeds": {}}
    for seed in seeds:
        curves = {name: evaluations(run_dir(runs, name, seed)) for name in STUDENTS}
        result["seeds"][seed] = {
            name: {
                "curve": curve,
                "first_step_within_0.05_of_teacher": first_within(curve, teacher_accuracy),
                "final": curve[max(curve)],
            }
            for name, curve in curves.items()
        }
    return result


def markdown(result: dict) -> str:
    lines = [f"teacher (make train's actor, seed 0): held-out greedy accuracy {result['teacher_final']:.3f}", ""]
    for seed, runs in result["seeds"].items():
        names = list(runs)
        lines += [f"seed {seed}", "", "| rollout step | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for step in sorted(runs[names[0]]["curve"]):
            lines.append(
                f"| {step} | " + " | ".join(f"{runs[n]['curve'].get(step, float('nan')):.3f}" for n in names) + " |"
            )
        lines.append(
            "| first step within 0.05 of the teacher | "
            + " | ".join(str(runs[n]["first_step_within_0.05_of_teacher"]) for n in names)
            + " |"
        )
        lines += ["", ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = list(result["seeds"])
    fig, axes = plt.subplots(1, len(seeds), figsize=(6 * len(seeds), 4), squeeze=False)
    for ax, seed in zip(axes[0], seeds):
        for name, run in result["seeds"][seed].items():
            steps = sorted(run["curve"])
            ax.plot(steps, [run["curve"][s] for s in steps], marker="o", label=name)
        ax.axhline(result["teacher_final"], color="grey", linestyle="--", label="teacher")
        ax.set(title=f"seed {seed}", xlabel="rollout step", ylabel="held-out greedy accuracy", ylim=(0, 1))
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "distill_demo")
    parser.add_argument("--seed", type=int, nargs="+", default=[0])
    parser.add_argument("--summary-only", action="store_true", help="read the runs, run nothing")
    parser.add_argument("--out", default=f"distill_demo_{datetime.date.today()}")
    args = parser.parse_args(argv)
    runs = args.runs.resolve()
    if not args.summary_only:
        runs.mkdir(parents=True, exist_ok=True)
        train([], run_dir(runs, "teacher", 0))
        for seed in args.seed:
            for name, extra in STUDENTS.items():
                teacher = [f"model.teacher.path={run_dir(runs, 'teacher', 0) / 'actor'}"] if extra else []
                train([*extra, *teacher, "trainer.eval_every=2", f"seed={seed}"], run_dir(runs, name, seed))
    result = summarise(runs, args.seed)
    out = ROOT / "bench" / "results" / args.out
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(markdown(result))
    plot(result, out.with_suffix(".png"))
    print(markdown(result))
    print(f"written: {out}.{{md,json,png}}")


if __name__ == "__main__":
    main()
