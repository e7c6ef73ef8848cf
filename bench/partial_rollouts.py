"""Partial rollouts on a heavy-tailed workload (issue 53 item 5), from `train.py` runs as a user types them.

The workload is `+experiment=long_tail`: the embedded task whose warm start thinks before 10 % of its answers, so
about 10 % of the responses run ~27 tokens where the median is 3 (rollout.max_response_tokens=32). Each variant is
the same run (same seed) with and without partial rollouts (cut every 8 tokens, two batches in flight), colocated and
with one rollout worker at k = 1; the variants run interleaved (A B A B ...) under the same conditions, `uptime`
recorded before and after each, so a loaded machine shows in the results:

    python train.py +experiment=long_tail trainer.total_rollout_steps=8 ...                       # A
    python train.py +experiment=long_tail rollout.partial.step_tokens=8 rollout.partial.max_age_steps=3 \
        rollout.partial.groups_in_flight=64 ...                                                  # B
    (and both with rollout.mode=disaggregated, k = 1)

    .venv/bin/python bench/partial_rollouts.py                     # the timing runs (8 rollout steps each), then the table
    .venv/bin/python bench/partial_rollouts.py --repeats 2         # A B A B twice
    .venv/bin/python bench/partial_rollouts.py --learning          # + 30-step colocated runs: held-out accuracy
    .venv/bin/python bench/partial_rollouts.py --summary-only      # the table of the runs already made

Per run, over its rollout steps after the first (the first holds vLLM's and the first chunks' start): seconds per
rollout step (`timing/rollout_step_s`: what the trainer spent, generation waited for included), seconds generating
per step (colocated: `timing/generate_s`; k = 1: the worker's own, `rollout/worker_generate_s`, and what the trainer
waited, `timing/generate_s`), and trained response tokens per generating second (`rollout/generated_tokens`, the
tokens each step trains; with partial rollouts a step also generates chunks that train later, so this counts each
token once, when it trains). Writes bench/results/partial_rollouts_<date>.{md,log}.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

from common import machine

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ["+experiment=long_tail"]
PARTIAL = ["rollout.partial.step_tokens=8", "rollout.partial.max_age_steps=3", "rollout.partial.groups_in_flight=64"]
WORKERS = ["rollout.mode=disaggregated", "rollout.max_staleness=1"]
VARIANTS = {  # name: train.py arguments beyond the workload's; in the order they run (A B A B)
    "colocated": [],
    "colocated_partial": PARTIAL,
    "k1": WORKERS,
    "k1_partial": WORKERS + PARTIAL,
}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def tail(pad_tokens: int) -> None:
    """The workload with a tail of `pad_tokens` thinking spaces: a response budget of the next power of two above it,
    cut every eighth of that (max_age_steps 7: a long answer is continued over up to 8 steps), two batches in flight."""
    budget = 1 << pad_tokens.bit_length()
    WORKLOAD[:] = [
        "+experiment=long_tail",
        f"model.warm_start.long_pad_tokens={pad_tokens}",
        f"rollout.max_response_tokens={budget}",
        f"model.tiny.max_position_embeddings={2 * budget}",  # the tiny model's 128 positions hold no long answer
        f"rollout.max_model_len={2 * budget}",
    ]
    PARTIAL[:] = [
        f"rollout.partial.step_tokens={budget // 8}",
        "rollout.partial.max_age_steps=7",
        "rollout.partial.groups_in_flight=64",
    ]
    for name, extra in VARIANTS.items():  # the lists they hold are these, renewed
        VARIANTS[name] = (WORKERS if name.startswith("k1") else []) + (PARTIAL if name.endswith("partial") else [])


def train(arguments: list[str], output: Path, log) -> dict:
    """Run train.py into `output` unless done before; (wall seconds, uptime before and after)."""
    done = output / "bench.json"
    if done.exists():
        print(f"{output}: done before, not run again", file=log, flush=True)
        return json.loads(done.read_text())
    command = [sys.executable, "train.py", *arguments, f"output_dir={output}"]
    before, started = uptime(), time.perf_counter()
    print(f"$ {' '.join(command[1:])}\n  before: {before}", file=log, flush=True)
    with open(output.with_suffix(".log"), "w") as out:
        subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, check=True)
    record = {"wall_s": time.perf_counter() - started, "before": before, "after": uptime()}
    print(f"  after:  {record['after']} ({record['wall_s']:.0f} s)", file=log, flush=True)
    done.write_text(json.dumps(record))
    return record


def figures(output: Path) -> dict:
    """A run's per-step means over its steps after the first, and its held-out accuracies."""
    with open(output / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    steps = [r for r in rows if r.get("timing/rollout_step_s") and int(r["rollout_step"]) > 0]

    def total(key: str) -> float:
        return sum(float(r[key]) for r in steps if r.get(key))

    generating = total("rollout/worker_generate_s") or total("timing/generate_s")
    evals = {int(r["rollout_step"]): float(r["eval/reward"]) for r in rows if r.get("eval/reward")}
    lengths = [float(r["rollout/response_length_max"]) for r in steps if r.get("rollout/response_length_max")]
    return {
        "steps": len(steps),
        "step_s": total("timing/rollout_step_s") / len(steps),
        "generate_s": generating / len(steps),
        "waited_s": total("timing/generate_s") / len(steps),
        "tokens_per_s": total("rollout/generated_tokens") / generating,
        "response_length_mean": total("rollout/response_length_mean") / len(steps),
        "response_length_max": max(lengths, default=0.0),
        "carried_samples": total("rollout/carried_samples") / len(steps),
        "cut_groups": total("rollout/partial_cut_groups"),
        "eval_first": evals[min(evals)] if evals else None,
        "eval_last": evals[max(evals)] if evals else None,
    }


def table(runs: Path, names: list[str]) -> str:
    lines = [
        "| run | steps | s / rollout step | generate s / step | waited s / step | trained tokens / generate s | "
        "response length mean / max | carried samples | cut groups | held-out first -> last |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        if not (runs / name / "metrics.csv").exists():
            continue
        f = figures(runs / name)
        held = f"{f['eval_first']:.3f} -> {f['eval_last']:.3f}" if f["eval_last"] is not None else "-"
        lines.append(
            f"| {name} | {f['steps']} | {f['step_s']:.2f} | {f['generate_s']:.2f} | {f['waited_s']:.2f} | "
            f"{f['tokens_per_s']:.0f} | {f['response_length_mean']:.2f} / {f['response_length_max']:.0f} | "
            f"{f['carried_samples']:.0f} | {f['cut_groups']:.0f} | {held} |"
        )
    return "\n".join(lines)


def ratios(runs: Path, repeats: int) -> str:
    """Partial over whole responses, per mode and repeat: generated tokens/s and seconds per rollout step."""
    out = []
    for mode in ("colocated", "k1"):
        for r in range(repeats):
            a, b = runs / f"{mode}_r{r}", runs / f"{mode}_partial_r{r}"
            if (a / "metrics.csv").exists() and (b / "metrics.csv").exists():
                fa, fb = figures(a), figures(b)
                out.append(
                    f"- {mode} (repeat {r}): tokens/s x{fb['tokens_per_s'] / fa['tokens_per_s']:.2f}, generate s/step "
                    f"x{fb['generate_s'] / fa['generate_s']:.2f}, s/rollout step x{fb['step_s'] / fa['step_s']:.2f}"
                )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="runs/partial_rollouts", help="where the runs go (reused when done)")
    parser.add_argument("--steps", type=int, default=8, help="rollout steps of each timing run")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of A B A B")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--learning", action="store_true", help="also 30-step colocated runs with and without")
    parser.add_argument(
        "--tail-tokens",
        type=int,
        default=None,
        help="a longer tail: the long answers think this many spaces (model.warm_start.long_pad_tokens), the response "
        "budget and the cut scaled with it (default: the experiment's 24 spaces, cut every 8 tokens)",
    )
    parser.add_argument("--summary-only", action="store_true")
    parser.add_argument("--out", default=f"partial_rollouts_{datetime.date.today()}")
    args = parser.parse_args()
    if args.tail_tokens:
        tail(args.tail_tokens)
    runs = (ROOT / args.runs).resolve()
    runs.mkdir(parents=True, exist_ok=True)
    results = ROOT / "bench" / "results"
    names, load = [], []
    with open(results / f"{args.out}.log", "a") as log:
        for r in range(args.repeats):
            for name, extra in VARIANTS.items():
                steps = [f"trainer.total_rollout_steps={args.steps}", f"trainer.eval_every={args.steps}"]
                arguments = [*WORKLOAD, *extra, *steps, "trainer.checkpoint_every=0", f"seed={args.seed}"]
                names.append(f"{name}_r{r}")
                if not args.summary_only:
                    record = train(arguments, runs / names[-1], log)
                    load.append(
                        f"- {names[-1]}: {record['wall_s']:.0f} s; before `{record['before']}`; after `{record['after']}`"
                    )
        if args.learning:
            for name, extra in (("learning", []), ("learning_partial", PARTIAL)):
                names.append(name)
                if not args.summary_only:
                    record = train([*WORKLOAD, *extra, f"seed={args.seed}"], runs / name, log)
                    load.append(
                        f"- {name}: {record['wall_s']:.0f} s; before `{record['before']}`; after `{record['after']}`"
                    )
        text = (
            f"# Partial rollouts on the heavy-tailed workload ({datetime.date.today()})\n\n"
            f"`.venv/bin/python bench/partial_rollouts.py --steps {args.steps} --repeats {args.repeats}"
            f"{' --learning' if args.learning else ''}{f' --tail-tokens {args.tail_tokens}' if args.tail_tokens else ''}` "
            f"(workload `{' '.join(WORKLOAD)}`; partial: "
            f"`{' '.join(PARTIAL)}`; k = 1: `{' '.join(WORKERS)}`; seed {args.seed}). Means over each run's rollout "
            f"steps after the first. Machine: {machine()}.\n\n"
            + table(runs, names)
            + "\n\nPartial over whole responses:\n"
            + ratios(runs, args.repeats)
            + "\n\nLoad (`uptime` before and after each run, in the order they ran):\n"
            + "\n".join(load)
            + "\n"
        )
        print(text, file=log, flush=True)
    print(text)
    (results / f"{args.out}.md").write_text(text)


if __name__ == "__main__":
    main()
