"""`python train.py` in a process of its own, as a user or a scheduler starts it (one rank or several), and what such a
run leaves for a test to read: its dumped experience, its metrics, its final actor and any of its processes still
running (`live_processes_in_group`). Used by the 2-process runs
(tests/end_to_end/test_ddp.py, test_ddp_tools.py), LoRA's (tests/training/test_lora.py), the HF engine's
(tests/rollout/test_hf_engine.py) and the gradient synchronisation counts (tests/training/test_grad_sync.py); `train_py`, a
short one whose output a test reads (the plan, the pre-flight's and the entry's one-line errors)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from lit_ppo.training.experience import DUMP_ADVANTAGES_ENV
from tests.helpers import ROOT, rollout_step_rows

RUN_TIMEOUT_S = 420
DDP = ["strategy=ddp", "strategy.devices=2", "strategy.accelerator=cpu"]
STRATEGIES = {"ddp": DDP, "fsdp": ["strategy=fsdp", "strategy.devices=2", "strategy.accelerator=cpu"]}
SETTINGS = [
    "trainer.total_rollout_steps=2",
    "model.warm_start.steps=20",
    "data.n_train=64",
    "data.n_eval=8",
    "trainer.eval_every=0",
    "trainer.checkpoint_every=1",
    "reward.overlong_penalty=1.0",
    "ppo.ppo_epochs=2",
    "strategy.precision=32-true",
]  # exact comparisons: float32 whatever `auto` picks on this machine


def train_py(cwd: Path, *overrides: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    """`python train.py <overrides>` started in `cwd` (Hydra's run directory under it), its output captured."""
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *overrides, f"hydra.run.dir={cwd / 'hydra'}"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def run_environment(out: Path, pythonpath: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment `train_cli`'s runs start in: this checkout importable, every rank's experience dumped."""
    paths = [str(ROOT), *pythonpath, os.environ.get("PYTHONPATH")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, paths)), **{DUMP_ADVANTAGES_ENV: str(out / "dump")})


def train_arguments(out: Path, cache: Path, *overrides: str) -> list[str]:
    """train.py's arguments of `train_cli`'s runs: SETTINGS, writing into `out`, the model caches in `cache`."""
    return [
        "train.py",
        *SETTINGS,
        f"output_dir={out}",
        f"cache_dir={cache}",
        f"hydra.run.dir={out / 'hydra'}",
        *overrides,
    ]


def train_cli(out: Path, cache: Path, *overrides: str, returncode: int = 0, pythonpath: tuple[str, ...] = ()) -> Path:
    """`python train.py` in its own process group (so a hung rank can be killed with its parent)."""
    out.mkdir(parents=True, exist_ok=True)
    env = run_environment(out, pythonpath)
    cmd = [sys.executable, *train_arguments(out, cache, *overrides)]
    started = time.monotonic()
    with open(out / "train.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # rank 1 is in rank 0's process group
            proc.wait()
    tail = (out / "train.log").read_text()[-5000:]
    assert proc.returncode == returncode, (
        f"{' '.join(cmd)} exited with {proc.returncode} after {time.monotonic() - started:.0f}s:\n{tail}"
    )
    out.joinpath("pgid").write_text(str(proc.pid))
    return out


def assert_no_rank_left(run: Path, within_s: float = 10.0) -> None:
    """Every process of `train_cli`'s stopped run `run` (its process group: the ranks) ends within `within_s`."""
    pgid = int((run / "pgid").read_text())
    deadline = time.monotonic() + within_s
    while live_processes_in_group(pgid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not live_processes_in_group(pgid), "a rank outlived the stopped run"


def live_processes_in_group(pgid: int) -> list[int]:
    """Processes of a process group that are still running (zombies waiting to be reaped do not count)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (command)": state, ppid, pgrp, ...
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(int(stat.parent.name))
    return live


def experience(run: Path, rollout_step: int, world: int) -> dict:
    """The ranks' dumped experience of one rollout step, concatenated in the global order of the samples' prompts
    (packed runs split the ranks' prompt groups again by real tokens after generation) and padded to one width;
    `rank_positions`: each rank's samples' prompt positions, in its order."""
    shards = [
        torch.load(run / "dump" / f"rollout_step={rollout_step:06d}.rank{r}.pt", weights_only=False)
        for r in range(world)
    ]
    assert [s["rank"] for s in shards] == list(range(world)) and all(s["world_size"] == world for s in shards)
    width = max(s["mask"].shape[1] for s in shards)
    joined = {k: sum((s[k] for s in shards), []) for k in ("prompt_positions", "dataset_indices", "response_ids")}
    joined["rewards"] = torch.cat([s["rewards"] for s in shards])
    for k in [
        k for k in ("mask", "advantages", "returns", "values") if shards[0].get(k) is not None
    ]:  # no critic: no values
        joined[k] = torch.cat([torch.nn.functional.pad(s[k], (0, width - s[k].shape[1])) for s in shards])
    order = sorted(range(len(joined["prompt_positions"])), key=lambda i: joined["prompt_positions"][i])  # stable
    joined = {k: [v[i] for i in order] if isinstance(v, list) else v[order] for k, v in joined.items()}
    joined["shard_sizes"] = [len(s["rewards"]) for s in shards]
    joined["rank_positions"] = [s["prompt_positions"] for s in shards]
    return joined


def metrics(run: Path) -> list[dict]:
    return rollout_step_rows(run / "metrics.csv")


def final_actor(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run / "actor" / "model.safetensors")


def assert_same_weights(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], rel: float = 5e-6) -> float:
    """Every entry of `ours` within `rel` of the largest weight (about 1, a norm's scale) of `theirs`: float32 rounding
    of the same updates summed in another order (another split over micro-batches and ranks), which Adam carries on.
    Returns the largest difference over the largest weight. Measured on these settings: one process against itself with
    micro-batches of 16 instead of 32 samples 1.5e-6, 2 ranks against 1 6.6e-7 (DDP) and 1.4e-6 (FSDP); before the
    global mini-batches, when each rank shuffled its own samples, 2.6e-3."""
    assert ours.keys() == theirs.keys()  # FSDP's gathered tensors keep the tied embedding tied
    largest = max(float(w.abs().max()) for w in theirs.values())
    worst, name = max((float((ours[k] - theirs[k]).abs().max()), k) for k in theirs)
    assert worst <= rel * largest, f"{name}: {worst:.2e} apart, over {rel:.0e} of the largest weight {largest:.2f}"
    return worst / largest
