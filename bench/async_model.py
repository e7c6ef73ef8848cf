"""Seconds per rollout step, synchronous against k-step-off (rollout.mode=disaggregated), from measured phase times
and a device split; validated against runs this machine can make, then used to predict a GPU node.

The model (docs/async.md):
- a phase's time scales inversely with the devices it runs on (data-parallel generation and training), except
  generation's tail: the last, longest responses decode one token at a time however many devices there are, so
  `tail_s` of a rollout batch's generation (a latency, devices mostly idle) does not shrink; the rest does;
- colocated, all N devices take turns: generate(N) + reward + experience and train(N) + weight sync;
- disaggregated, g devices generate and N - g train. With k = 0 nothing overlaps: generate(g) + reward + train(N - g)
  + push. With k >= 1 the workers generate step s + 1 while the trainer scores, trains and pushes step s, so a step
  takes the longer of the two sides: max(generate(g), reward + train(N - g) + push).

Usage:
  python bench/async_model.py --measure --steps 12     # three real runs of the default task on this machine
                                                       # (colocated; disaggregated k = 0 and k = 1), model vs measured
  python bench/async_model.py --runs SYNC K0 K1         # the same from existing run directories
  python bench/async_model.py --predict                 # the qwen7b node: 8 GPUs, every split, several phase shares
"""

from __future__ import annotations

import argparse
import csv
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

    def generate(self, devices: float) -> float:
        return self.tail_s + (self.generate_s - self.tail_s) * self.devices / devices

    def train(self, devices: float) -> float:
        return self.train_s * self.devices / devices


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


def train_py(out: Path, steps: int, *overrides: str) -> Path:
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
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return out


def validate(sync: Path, k0: Path, k1: Path, devices: float) -> None:
    """The model fed the colocated run's phases, against the disaggregated runs (one device each side)."""
    s = mean_phases(sync)
    p = Phases(
        generate_s=s["timing/generate_s"],
        reward_s=s["timing/reward_s"],
        train_s=s["timing/experience_s"] + s["timing/train_s"],
        weight_sync_s=s["timing/weight_sync_s"],
        devices=devices,
    )
    print(f"colocated phases (s/step, {devices:g} cores): {p}")
    print(f"{'run':<28}{'model s/step':>14}{'measured s/step':>17}")
    print(f"{'colocated':<28}{colocated_seconds(p, devices):>14.3f}{s['timing/rollout_step_s']:>17.3f}")
    for name, run, k in (("disaggregated k=0", k0, 0), ("disaggregated k=1", k1, 1)):
        m = mean_phases(run)
        push = m["timing/weight_sync_s"]  # the push is measured, not modelled: another transport than colocated
        model = disaggregated_seconds(p, devices / 2, devices / 2, k, push)
        print(f"{name:<28}{model:>14.3f}{m['timing/rollout_step_s']:>17.3f}")
        print(
            f"  its phases: waited for batch {m['timing/generate_s']:.3f}, worker generated "
            f"{m.get('rollout/worker_generate_s', float('nan')):.3f}, train {m['timing/experience_s'] + m['timing/train_s']:.3f}, "
            f"push {push:.3f}, reward {m['timing/reward_s']:.3f}"
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
    parser.add_argument("--runs", nargs=3, type=Path, metavar=("SYNC", "K0", "K1"))
    parser.add_argument("--predict", action="store_true")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "async_model")
    parser.add_argument("--devices", type=float, default=os.cpu_count())
    args = parser.parse_args()
    print("command:", shlex.join([sys.executable, *sys.argv]))
    if args.measure:
        common = ["strategy.precision=32-true"]
        sync = train_py(args.out / "colocated", args.steps, *common)
        disaggregated = [*common, "rollout.mode=disaggregated", "ppo.rollout_correction.mode=tis"]
        k0 = train_py(args.out / "k0", args.steps, *disaggregated, "rollout.max_staleness=0")
        k1 = train_py(args.out / "k1", args.steps, *disaggregated, "rollout.max_staleness=1")
        args.runs = [sync, k0, k1]
    if args.runs:
        validate(*args.runs, devices=args.devices)
    if args.predict or not (args.runs or args.measure):
        predict_node()


if __name__ == "__main__":
    main()
