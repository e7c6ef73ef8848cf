"""`make train`'s warm start beside a competing CPU job and on idle cores, with OpenMP's threads spinning (libgomp's
default), always waiting passively (lit_ppo/run/threads.py until 2026-11-25) and as lit-ppo sets them now (passive only
where the cores are oversubscribed at start).

Each measurement is a real `python train.py` (the command `make train` runs) with a fresh temporary
LIT_PPO_CACHE_DIR / cache_dir, so the warm start is not read from a cache, stopped after one rollout step; the figure is
the run's own `warm_start_seconds` (summary.json). The competitor is `--competitors` processes each spinning in a
busy loop, started before and stopped after each run. The settings:

- spin: `GOMP_SPINCOUNT=300000`, libgomp's own default spin count (lit-ppo leaves the wait policy alone when it is
  set), one thread per allowed core;
- passive: `OMP_WAIT_POLICY=PASSIVE` always (what lit_ppo/run/threads.py set until 2026-11-25);
- lit-ppo: the product's default (passive where, at start, the runnable processes and the run's threads exceed the
  cores; libgomp's spin otherwise).

    .venv/bin/python bench/contention.py                            # 300 warm-start steps, idle and busy
    .venv/bin/python bench/contention.py --warm-start-steps 1500    # make train's full warm start
    .venv/bin/python bench/contention.py --smoke                    # checks that it runs (busy only, 20 steps)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, add_common_args, print_header

SETTINGS = {
    "spin (libgomp's default)": {"GOMP_SPINCOUNT": "300000"},
    "passive (always)": {"OMP_WAIT_POLICY": "PASSIVE"},
    "lit-ppo (by the load at start)": {},
}
THREAD_KEYS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def spin() -> None:
    while True:
        pass


def warm_start_seconds(steps: int, seed: int, env_overrides: dict[str, str], log_path: Path) -> tuple[float, str]:
    """One `train.py` run with a fresh cache; its warm start's seconds as the run measured them, and the wait policy
    its run.log reports."""
    with tempfile.TemporaryDirectory(prefix="lit_ppo_contention_") as tmp:
        env = {k: v for k, v in os.environ.items() if k not in THREAD_KEYS}
        env.update(env_overrides, LIT_PPO_CACHE_DIR=tmp)
        command = [
            sys.executable,
            "train.py",
            f"seed={seed}",
            f"cache_dir={tmp}",
            f"output_dir={tmp}/run",
            f"hydra.run.dir={tmp}/hydra",
            f"model.warm_start.steps={steps}",
            "trainer.total_rollout_steps=1",
            "trainer.eval_every=0",
            "data.n_eval=8",
        ]
        with open(log_path, "w") as log:
            subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
        lines = Path(tmp, "run", "logs", "run.log").read_text().splitlines()
        policy = next((line.split("OMP_WAIT_POLICY=", 1)[1][:-1] for line in lines if "CPU threads:" in line), "?")
        return json.loads(Path(tmp, "run", "summary.json").read_text())["warm_start_seconds"], policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, repeats=1)
    parser.add_argument("--warm-start-steps", type=int, default=300, help="model.warm_start.steps (make train: 1500)")
    parser.add_argument("--competitors", type=int, default=2, help="busy-loop processes beside the run")
    parser.add_argument("--busy-only", action="store_true", help="skip the measurements without a competitor")
    args = parser.parse_args()
    steps = 20 if args.smoke else args.warm_start_steps
    loads = ["busy"] if args.smoke or args.busy_only else ["idle", "busy"]
    print_header(
        "Warm start beside a competing CPU job: before and after lit_ppo/run/threads.py",
        args,
        run=f"python train.py model.warm_start.steps={steps} trainer.total_rollout_steps=1 (fresh cache)",
        load=f"{args.competitors} busy-loop processes (busy) or none (idle)",
    )
    logs = Path(tempfile.mkdtemp(prefix="lit_ppo_contention_logs_"))
    results = []
    for load in loads:
        for name, overrides in SETTINGS.items():
            for repeat in range(args.repeats):
                competitors = []
                if load == "busy":
                    competitors = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.competitors)]
                    for process in competitors:
                        process.start()
                started = time.perf_counter()
                try:
                    log = logs / f"{load}_{len(results)}.log"
                    seconds, policy = warm_start_seconds(steps, args.seed, overrides, log)
                finally:
                    for process in competitors:
                        process.kill()
                        process.join()
                wall = time.perf_counter() - started
                results.append((load, name, seconds))
                print(
                    f"{load:<5} {name:<31} warm start {seconds:8.1f} s ({1000 * seconds / steps:7.1f} ms/step); "
                    f"whole run {wall:.0f} s; OMP_WAIT_POLICY={policy}; log {log}",
                    flush=True,
                )
    print("-" * 100)
    for load in loads:
        means = {}
        for name in SETTINGS:
            seconds = [s for lo, n, s in results if lo == load and n == name]
            means[name] = sum(seconds) / len(seconds)
        fastest = min(means.values())
        print(
            f"{load:<5} warm start (mean s): "
            + ", ".join(f"{n} {m:.1f} ({m / fastest:.2f}x)" for n, m in means.items())
        )


if __name__ == "__main__":
    main()
