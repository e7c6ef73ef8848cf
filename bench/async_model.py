"""Seconds per rollout step, synchronous against k-step-off (rollout.mode=disaggregated), from measured phase times
and a device split; validated against runs this machine can make, then used to predict a GPU node.

The model (docs/async.md):
- a phase's time scales with the devices it runs on as (devices measured / devices)^alpha, alpha its measured
  scaling exponent (1: perfectly data-parallel, what GPUs running data-parallel ranks come close to; 0: no gain from
  more devices), except generation's tail: the last, longest responses decode one token at a time however many
  devices there are, so `tail_s` of a rollout batch's generation (a latency, devices mostly idle) does not shrink;
  each alpha is fitted from two colocated runs, on all devices and on the share one side would get;
- colocated, all N devices take turns: generate(N) + reward + experience and train(N) + weight sync;
- disaggregated, g devices generate and N - g train. With k = 0 nothing overlaps: generate(g) + reward + train(N - g)
  + push. With k >= 1 the workers generate step s + 1 while the trainer scores, trains and pushes step s, so a step
  takes the longer of the two sides: max(generate(g), reward + train(N - g) + push).

Usage:
  python bench/async_model.py --measure --steps 12     # four real runs of the default task on this machine (colocated
                                                       # on all cores and on half of them, which fit each phase's
                                                       # alpha; disaggregated k = 0 and k = 1), model vs measured
  python bench/async_model.py --runs SYNC HALF K0 K1    # the same from existing run directories
  python bench/async_model.py --predict                 # the qwen7b node: 8 GPUs, every split, several phase shares
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import shlex
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Phases:
    """Mean seconds per rollout step of each phase, measured with `devices` devices on every phase (colocated)."""

    generate_s: float
    reward_s: float
    train_s: float  # experience forwards + PPO updates
    weight_sync_s: float
    devices: float
    tail_s: float = 0.0  # of generate_s: the latency of the longest responses, the same on any number of devices
    generate_alpha: float = 1.0  # scaling exponents (fit_alpha); 1: time inversely proportional to the devices
    train_alpha: float = 1.0

    def generate(self, devices: float) -> float:
        return self.tail_s + (self.generate_s - self.tail_s) * (self.devices / devices) ** self.generate_alpha

    def train(self, devices: float) -> float:
        return self.train_s * (self.devices / devices) ** self.train_alpha


def fit_alpha(seconds_all: float, devices_all: float, seconds_share: float, devices_share: float) -> float:
    """The exponent alpha with seconds_share = seconds_all x (devices_all / devices_share)^alpha: how a phase's time
    grew when it ran on fewer devices (1: inversely with the devices; 0: not at all)."""
    return math.log(seconds_share / seconds_all) / math.log(devices_all / devices_share)


def colocated_seconds(p: Phases, devices: float) -> float:
    return p.generate(devices) + p.reward_s + p.train(devices) + p.weight_sync_s


def disaggregated_seconds(p: Phases, generate_devices: float, train_devices: float, k: int, push_s: float) -> float:
    trainer = p.reward_s + p.train(train_devices) + push_s
    if k == 0:
        return p.generate(generate_devices) + trainer
    return max(p.generate(generate_devices), trainer)


def mean_phases(run: Path, skip: int = 1) -> dict[str, float]:
    """Means over a run's rollout steps (the first `skip` left out: one-time costs) of its timing columns."""
    rows = [r for r in csv.DictReader(open(run / "metrics.csv")) if float(r["rollout_step"]) > skip]
    keys = [k for k in rows[0] if k.startswith("timing/") or k == "rollout/worker_generate_s"]
    return {k: statistics.mean(float(r[k]) for r in rows if r[k] not in ("", None)) for k in keys}


def train_py(out: Path, steps: int, *overrides: str, threads: int | None = None) -> Path:
    """`train.py` run to completion in its own process; `threads`: its CPU threads (OMP_NUM_THREADS, which
    lit_ppo/run/threads.py keeps), for a colocated run on the share of the cores one side of a split would get."""
    command = [
        sys.executable,
        "train.py",
        f"trainer.total_rollout_steps={steps}",
        "trainer.eval_every=0",
        "trainer.checkpoint_every=0",
        f"output_dir={out}",
        f"hydra.run.dir={out / 'hydra'}",
        *overrides,
    ]
    print("$", shlex.join(command), flush=True)
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)} if threads else {})}
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, env=env)
    return out


def validate(sync: Path, half: Path, k0: Path, k1: Path, devices: float) -> None:
    """The model fed two colocated runs' phases (all `devices`, and half of them: each phase's alpha), against the
    disaggregated runs (half the devices each side). The push and the batch hand-off (the trainer's wait for a batch
    beyond the worker's generation, at k = 0) are measured in those runs, not modelled: another transport."""
    s, h = mean_phases(sync), mean_phases(half)

    def train_s(m):
        return m["timing/experience_s"] + m["timing/train_s"]

    p = Phases(
        generate_s=s["timing/generate_s"],
        reward_s=s["timing/reward_s"],
        train_s=train_s(s),
        weight_sync_s=s["timing/weight_sync_s"],
        devices=devices,
        generate_alpha=fit_alpha(s["timing/generate_s"], devices, h["timing/generate_s"], devices / 2),
        train_alpha=fit_alpha(train_s(s), devices, train_s(h), devices / 2),
    )
    print(f"colocated phases (s/step, {devices:g} cores): {p}")
    print(
        f"  on {devices / 2:g} cores: generate {h['timing/generate_s']:.3f}, train {train_s(h):.3f} "
        f"-> alpha generate {p.generate_alpha:.2f}, train {p.train_alpha:.2f} (1: time inversely with the cores)"
    )
    inverse = dataclasses.replace(p, generate_alpha=1.0, train_alpha=1.0)
    print(f"{'run':<24}{'model s/step':>14}{'measured s/step':>17}{'model/measured':>16}{'alpha = 1 model':>17}")
    print(f"{'colocated':<24}{colocated_seconds(p, devices):>14.3f}{s['timing/rollout_step_s']:>17.3f}")
    k0_phases = mean_phases(k0)
    handoff = max(0.0, k0_phases["timing/generate_s"] - k0_phases.get("rollout/worker_generate_s", 0.0))
    for name, run, k in (("disaggregated k=0", k0, 0), ("disaggregated k=1", k1, 1)):
        m = mean_phases(run)
        push = m["timing/weight_sync_s"]
        extra = handoff if k == 0 else 0.0  # at k >= 1 the hand-off overlaps training
        model = disaggregated_seconds(p, devices / 2, devices / 2, k, push) + extra
        naive = disaggregated_seconds(inverse, devices / 2, devices / 2, k, push) + extra
        measured = m["timing/rollout_step_s"]
        print(f"{name:<24}{model:>14.3f}{measured:>17.3f}{model / measured:>16.2f}{naive:>17.3f}")
        print(
            f"  its phases: waited for batch {m['timing/generate_s']:.3f}, worker generated "
            f"{m.get('rollout/worker_generate_s', float('nan')):.3f}, train {train_s(m):.3f}, "
            f"push {push:.3f}, reward {m['timing/reward_s']:.3f}" + (f", hand-off {handoff:.3f}" if k == 0 else "")
        )


def predict_node(devices: int = 8) -> None:
    """qwen7b (conf/experiment/qwen7b.yaml) on one node of `devices` GPUs: no phase times of it are measured here, so
    the prediction is given for the share of a colocated step spent generating (long 4,096-token responses: peers
    report most of the step) and for the share of that generation which is the tail (the last, longest responses),
    with the colocated step normalised to 1 and pushes of 2 % of it (15 GB of bf16 weights)."""
    print(f"qwen7b on {devices} GPUs, k = 1: seconds per rollout step relative to colocated (= 1.00); push = 0.02")
    print(
        f"{'gen share':>10}{'tail share':>11}"
        + "".join(f"{f'{g}gen/{devices - g}train':>14}" for g in range(1, devices))
    )
    for share in (0.5, 0.7, 0.9):
        for tail in (0.0, 0.3, 0.6):
            p = Phases(share, 0.01, 1 - share - 0.03, 0.02, devices, tail_s=tail * share)
            base = colocated_seconds(p, devices)
            cells = [disaggregated_seconds(p, g, devices - g, 1, 0.02) / base for g in range(1, devices)]
            print(f"{share:>10.2f}{tail:>11.2f}" + "".join(f"{c:>14.2f}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure", action="store_true")
    parser.add_argument("--runs", nargs=4, type=Path, metavar=("SYNC", "HALF", "K0", "K1"))
    parser.add_argument("--predict", action="store_true")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "async_model")
    parser.add_argument("--devices", type=float, default=os.cpu_count())
    args = parser.parse_args()
    print("command:", shlex.join([sys.executable, *sys.argv]))
    if args.measure:
        common = ["strategy.precision=32-true"]
        sync = train_py(args.out / "colocated", args.steps, *common)
        half = train_py(args.out / "colocated_half", args.steps, *common, threads=max(1, int(args.devices) // 2))
        disaggregated = [*common, "rollout.mode=disaggregated", "ppo.rollout_correction.mode=tis"]
        k0 = train_py(args.out / "k0", args.steps, *disaggregated, "rollout.max_staleness=0")
        k1 = train_py(args.out / "k1", args.steps, *disaggregated, "rollout.max_staleness=1")
        args.runs = [sync, half, k0, k1]
    if args.runs:
        validate(*args.runs, devices=args.devices)
    if args.predict or not (args.runs or args.measure):
        predict_node()


if __name__ == "__main__":
    main()
