"""A pipeline k steps deep (issue 36 item 4): the same run at rollout.mode=disaggregated with rollout.max_staleness
k = 0 (the reference), 1 and 2, where some rollout steps are slower than others, against the asynchronous model's
prediction (bench/async_model.py) for the same per-step seconds.

The variable step is a reward the user could have: `reward.fn` points to `slow_every_third_step` below, which scores
like lit_ppo.rewards.integer_match and sleeps `slow_s` seconds on every third rollout step (steps 2, 5, 8, ...: its
n-th call in the trainer's process is rollout step n, one generation round per step). The reward is scored in the
trainer, so the variable side is the trainer's; the pipeline argument is the same for either side: a step's slowness
is absorbed when the other side can run ahead, which at k = 1 it can by one step only.

Printed per k: seconds per rollout step (the trainer's timing/rollout_step_s, mean over the steps after the first
k + 1 (one-time costs and the pipeline's filling; biased by the period: k = 1 keeps 4 slow steps of 10, k = 2 3 of 9),
and over one window common to every k: whole periods of three steps after the first max(k) + 1, the fair figure), timing/generate_s
per step (the trainer's real wait for its batch), and the async model's prediction: `disaggregated_seconds` on each
step's own phases, averaged (each step the longer of the two sides), and on the mean phases (what a deep enough
pipeline approaches: the longer side on average).

Usage:
  python bench/pipeline_depth.py --steps 12 --slow-s 2.0     # three runs of train.py, then the table
  python bench/pipeline_depth.py --steps 12 --slow-s 2.0 --slow-side tool   # the slow side in the workers instead
  python bench/pipeline_depth.py --runs K0 K1 K2              # the table from existing run directories
"""

from __future__ import annotations

import argparse
import csv
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.async_model import Phases, disaggregated_seconds, train_py  # noqa: E402

PERIOD_STEPS = 3  # every third rollout step is slow
_calls = 0  # rollout steps scored so far in this process


def slow_every_third_step(
    prompts, responses, references, extras, *, slow_s: float = 2.0, step_samples: int = 128, **_
) -> list[float]:
    """lit_ppo.rewards.integer_match's scores, after sleeping `slow_s` s on rollout steps 2, 5, 8, ... (0-based; a
    slow verifier or sandbox on some steps). A call of `step_samples` responses (ppo.rollout_batch_size x
    n_samples_per_prompt) is the next rollout step's (one call per step: no dynamic sampling); the evaluations at the
    start and the end score the 200 held-out prompts and are not counted."""
    from lit_ppo.rewards import integer_match

    global _calls
    if len(responses) == step_samples:
        rollout_step, _calls = _calls, _calls + 1
        if rollout_step % PERIOD_STEPS == PERIOD_STEPS - 1:
            time.sleep(slow_s)
    return integer_match(prompts, responses, references, extras)


class SlowToolEnvironment:
    """lit_ppo.environments.CalculatorEnvironment whose tool is slow on every third rollout step (a sandbox or an API
    that stalls at times): every third block of `step_episodes` episodes (ppo.rollout_batch_size x
    n_samples_per_prompt: a rollout step's, one worker) sleeps `slow_s` seconds at its first episode's start. Built in
    the rollout worker (`+experiment=tool_arithmetic` with rollout workers), so the slow side is the workers'
    generation, which a deeper pipeline can run ahead of. The worker also runs the evaluation's episodes (the first
    evaluation's 200 greedy + 800 sampled come first), which shifts which steps are slow: 0, 3, 6, 9 in the runs of
    bench/results/pipeline_depth_tool_2026-11-27.log; the period stays three steps."""

    resets = 0  # episodes started in this process

    def __init__(self, slow_s: float = 2.0, step_episodes: int = 128, **calculator):
        from lit_ppo.environments import CalculatorEnvironment

        self.calculator = CalculatorEnvironment(**calculator)
        self.slow_s, self.step_episodes = slow_s, step_episodes
        self.stop = self.calculator.stop

    def reset(self, record: dict):
        step, first = divmod(SlowToolEnvironment.resets, self.step_episodes)
        SlowToolEnvironment.resets += 1
        if first == 0 and step % PERIOD_STEPS == PERIOD_STEPS - 1:
            time.sleep(self.slow_s)
        return self.calculator.reset(record)

    def step(self, action: str):
        return self.calculator.step(action)

    def __getattr__(self, name):  # call_text and the rest of the calculator's
        return getattr(self.calculator, name)


def per_step(run: Path) -> list[dict[str, float]]:
    """The run's timing row of each rollout step, in order (metrics.csv holds other rows too)."""
    rows = {}
    for r in csv.DictReader(open(run / "metrics.csv")):
        if r.get("timing/rollout_step_s") not in ("", None):
            rows[int(float(r["rollout_step"]))] = {k: float(v) for k, v in r.items() if v not in ("", None)}
    return [rows[s] for s in sorted(rows)]


def model_seconds(step: dict[str, float], k: int) -> float:
    """The async model's seconds for one step's phases: the workers generate on their devices, the trainer scores,
    trains and pushes on its own (one device each side: the phases are those measured in this very run)."""
    p = Phases(
        generate_s=step["rollout/worker_generate_s"],
        reward_s=step["timing/reward_s"],
        train_s=step["timing/experience_s"] + step["timing/train_s"],
        weight_sync_s=0.0,
        devices=1,
    )
    return disaggregated_seconds(p, 1, 1, k, push_s=step["timing/weight_sync_s"])


def report(runs: dict[int, Path]) -> None:
    first = max(runs) + 1
    common = range(first + (-first) % PERIOD_STEPS, min(len(per_step(r)) for r in runs.values()))
    common = range(common.start, common.start + len(common) // PERIOD_STEPS * PERIOD_STEPS)
    print(f"common window: rollout steps {common.start}..{common.stop - 1} (whole periods of {PERIOD_STEPS})")
    print(
        f"{'k':>2}{'s/step after k':>16}{'s/step common':>15}{'model per step':>16}{'model on means':>16}"
        f"{'waited/step':>13}{'worker gen/step':>17}{'trainer/step':>14}"
    )
    for k, run in sorted(runs.items()):
        steps = per_step(run)
        after_k, window = steps[k + 1 :] if k else steps[1:], [steps[s] for s in common]

        def mean(key, rows=window):
            return statistics.mean(r[key] for r in rows)

        means = {key: mean(key) for key in window[0]}
        trainer = means["timing/reward_s"] + means["timing/experience_s"] + means["timing/train_s"]
        print(
            f"{k:>2}{mean('timing/rollout_step_s', after_k):>16.3f}{means['timing/rollout_step_s']:>15.3f}"
            f"{statistics.mean(model_seconds(r, k) for r in window):>16.3f}{model_seconds(means, k):>16.3f}"
            f"{means['timing/generate_s']:>13.3f}{means['rollout/worker_generate_s']:>17.3f}"
            f"{trainer + means['timing/weight_sync_s']:>14.3f}"
        )
    for k, run in sorted(runs.items()):
        print(f"k={k} per step (s): rollout_step_s / generate_s (waited) / worker generate_s / reward_s")
        for s, r in enumerate(per_step(run)):
            print(
                f"  step {s:>2}: {r['timing/rollout_step_s']:7.3f} {r['timing/generate_s']:7.3f} "
                f"{r.get('rollout/worker_generate_s', float('nan')):7.3f} {r['timing/reward_s']:7.3f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", type=Path, metavar="RUN", help="run directories of k = 0, 1, 2, ...")
    parser.add_argument("--ks", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--slow-s", type=float, default=2.0)
    parser.add_argument(
        "--slow-side",
        choices=("reward", "tool"),
        default="reward",
        help="reward: the trainer's reward is slow on every third step (default task); tool: the calculator in the "
        "rollout worker is (+experiment=tool_arithmetic), so the workers' generation varies",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "pipeline_depth")
    parser.add_argument("overrides", nargs="*", help="more train.py overrides, the same for every k")
    args = parser.parse_args()
    print("command:", shlex.join([sys.executable, *sys.argv]), flush=True)
    if args.runs:
        runs = dict(zip(args.ks, args.runs))
    else:
        if args.slow_side == "reward":
            slow = ["reward.fn._target_=bench.pipeline_depth.slow_every_third_step", f"+reward.fn.slow_s={args.slow_s}"]
        else:
            slow = [
                "+experiment=tool_arithmetic",
                "rollout.episodes.environment._target_=bench.pipeline_depth.SlowToolEnvironment",
                f"+rollout.episodes.environment.slow_s={args.slow_s}",
                "+rollout.episodes.environment.step_episodes=128",  # grpo's 32 prompts x 4
            ]
        common = [
            "strategy.precision=32-true",
            "rollout.mode=disaggregated",
            "ppo.rollout_correction.mode=tis",
            *slow,
            *args.overrides,
        ]
        runs = {k: train_py(args.out / f"k{k}", args.steps, *common, f"rollout.max_staleness={k}") for k in args.ks}
    report(runs)


if __name__ == "__main__":
    main()
