"""On-policy distillation against RL on the embedded task (issue 52 item 4), from `train.py` runs as a user types them.

The teacher is `make train`'s run (PPO with a critic from the reward, seed 0: 0.92 held-out). Its actor then teaches
a fresh warm-started student (the warm start of the student's seed, 0.10 held-out) for the same 30 rollout steps,
with the same seed, as RL from the reward alone does. Every run evaluates after every rollout step on 500 held-out
prompts (data.n_eval=500; the training prompts are the same 2,000 as with 200), and the teacher is evaluated on the
same 500 by `mode=eval`:

    python train.py output_dir=<runs>/teacher                                          # the teacher (make train)
    python train.py mode=eval model.path=<runs>/teacher/actor data.n_eval=500 output_dir=<runs>/teacher_eval
    python train.py trainer.eval_every=1 data.n_eval=500 seed=S output_dir=<runs>/rl_sS  # RL from the reward alone
    python train.py ppo=distill model.teacher.path=<runs>/teacher/actor trainer.eval_every=1 data.n_eval=500 seed=S ...
    python train.py ppo=distill model.teacher.path=... ppo.distill.reward_coef=1.0 ...  # + the reward

    .venv/bin/python bench/distill_demo.py --runs runs/distill_demo --seed 0 1 2 3 4 5 6 7  # runs what is missing
    .venv/bin/python bench/distill_demo.py --runs runs/distill_demo --seed 0 1 2 3 4 5 6 7 --summary-only

`--teacher DIR` uses an existing `make train` run as the teacher instead of training one. Writes
bench/results/distill_demo_<date>.{md,json,png}: held-out greedy accuracy after each rollout step of each run, the
first rollout step at which each student is within 0.05 of the teacher, the end accuracy and the mean of the last 10
evaluations (steps 21-30: one evaluation of 500 prompts moves by about 0.015 from sampling alone), and over seeds.
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


N_EVAL = 500
EVAL_EVERY = 1
LAST = 10  # the end: the mean of the last LAST evaluations


def run_dir(runs: Path, name: str, seed: int) -> Path:
    return runs / (name if name in ("teacher", "teacher_eval") else f"{name}_s{seed}")


def train(arguments: list[str], output: Path, done_file: str = "summary.json") -> None:
    if (output / done_file).exists():
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


def teacher_accuracy(runs: Path) -> float:
    record = json.loads((run_dir(runs, "teacher_eval", 0) / "eval.json").read_text())
    return record["metrics"]["eval/reward"]


def end_mean(curve: dict[int, float]) -> float:
    steps = sorted(curve)[-LAST:]
    return sum(curve[s] for s in steps) / len(steps)


def summarise(runs: Path, seeds: list[int]) -> dict:
    result = {"teacher_final": teacher_accuracy(runs), "n_eval": N_EVAL, "last": LAST, "seeds": {}}
    for seed in seeds:
        curves = {name: evaluations(run_dir(runs, name, seed)) for name in STUDENTS}
        result["seeds"][seed] = {
            name: {
                "curve": curve,
                "first_step_within_0.05_of_teacher": first_within(curve, result["teacher_final"]),
                "final": curve[max(curve)],
                f"mean_last_{LAST}": end_mean(curve),
            }
            for name, curve in curves.items()
        }
    result["over_seeds"] = over_seeds(result["seeds"])
    return result


def over_seeds(per_seed: dict) -> dict:
    """Per student: the mean first step within 0.05 (None counted as never: excluded, and counted), the mean end, and
    per seed whether distillation got there in fewer steps than RL."""
    names = list(next(iter(per_seed.values())))
    out = {}
    for name in names:
        firsts = [runs[name]["first_step_within_0.05_of_teacher"] for runs in per_seed.values()]
        reached = [f for f in firsts if f is not None]
        out[name] = {
            "mean_first_step_within_0.05": sum(reached) / len(reached) if reached else None,
            "never_within": len(firsts) - len(reached),
            "mean_final": sum(runs[name]["final"] for runs in per_seed.values()) / len(per_seed),
            f"mean_last_{LAST}": sum(runs[name][f"mean_last_{LAST}"] for runs in per_seed.values()) / len(per_seed),
        }
        if name != "rl":
            pairs = [
                (runs[name]["first_step_within_0.05_of_teacher"], runs["rl"]["first_step_within_0.05_of_teacher"])
                for runs in per_seed.values()
            ]
            out[name]["seeds_fewer_equal_more_steps_than_rl"] = [
                sum(1 for a, b in pairs if (a or 10**6) < (b or 10**6)),
                sum(1 for a, b in pairs if (a or 10**6) == (b or 10**6)),
                sum(1 for a, b in pairs if (a or 10**6) > (b or 10**6)),
            ]
    return out


def markdown(result: dict) -> str:
    lines = [
        f"teacher (make train's actor, seed 0): held-out greedy accuracy {result['teacher_final']:.3f} "
        f"on {result['n_eval']} prompts (mode=eval)",
        "",
        "| over seeds | " + " | ".join(result["over_seeds"]) + " |",
        "|---" * (len(result["over_seeds"]) + 1) + "|",
    ]
    for key in next(iter(result["over_seeds"].values())):
        lines.append(
            f"| {key} | "
            + " | ".join(
                str(v.get(key, "")) if not isinstance(v.get(key), float) else f"{v[key]:.3f}"
                for v in result["over_seeds"].values()
            )
            + " |"
        )
    lines += ["", ""]
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
        lines.append(
            f"| mean of the last {result['last']} | "
            + " | ".join(f"{runs[n][f'mean_last_{LAST}']:.3f}" for n in names)
            + " |"
        )
        lines += ["", ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = list(result["seeds"])
    columns = min(4, len(seeds))
    rows = -(-len(seeds) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.6 * rows), squeeze=False)
    for ax, seed in zip(axes.flat, seeds):
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
    parser.add_argument("--teacher", type=Path, help="an existing `make train` run directory to use as the teacher")
    parser.add_argument(
        "--common", nargs="*", default=[], help="train.py overrides for every student (RL and distillation alike)"
    )
    parser.add_argument("--out", default=f"distill_demo_{datetime.date.today()}")
    args = parser.parse_args(argv)
    runs = args.runs.resolve()
    if not args.summary_only:
        runs.mkdir(parents=True, exist_ok=True)
        teacher_dir = run_dir(runs, "teacher", 0)
        if args.teacher and not teacher_dir.exists():
            teacher_dir.symlink_to(args.teacher.resolve())
        train([], teacher_dir)
        evaluation = [f"model.path={teacher_dir / 'actor'}", f"data.n_eval={N_EVAL}"]
        train(["mode=eval", *evaluation], run_dir(runs, "teacher_eval", 0), done_file="eval.json")
        for seed in args.seed:
            for name, extra in STUDENTS.items():
                teacher = [f"model.teacher.path={teacher_dir / 'actor'}"] if extra else []
                every = [f"trainer.eval_every={EVAL_EVERY}", f"data.n_eval={N_EVAL}", f"seed={seed}"]
                train([*extra, *teacher, *every, *args.common], run_dir(runs, name, seed))
    result = summarise(runs, args.seed)
    out = ROOT / "bench" / "results" / args.out
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(markdown(result))
    plot(result, out.with_suffix(".png"))
    print(markdown(result))
    print(f"written: {out}.{{md,json,png}}")


if __name__ == "__main__":
    main()
