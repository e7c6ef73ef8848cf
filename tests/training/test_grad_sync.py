"""Gradients are synchronised once per optimizer step, not once per micro-batch: DDP skips the all-reduce of the
micro-batches before the last (`no_sync`), FSDP2 their reduce-scatter (`set_requires_gradient_sync(False)`).

Two CPU processes train one rollout step with gradient accumulation 4 (16 samples per rank per optimizer step,
micro-batches of 4) and a critic; tests/training/grad_sync/sitecustomize.py counts the synchronisations in each rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.helpers.cli_runs import STRATEGIES

# 16 prompts x 4 samples = 64 per rollout step, 32 per optimizer step (2 steps), 16 per rank: 4 micro-batches of 4.
SETTINGS = [
    "ppo=ppo",
    "ppo.rollout_batch_size=16",
    "ppo.n_samples_per_prompt=4",
    "ppo.train_batch_size=32",
    "ppo.micro_train_batch_size=4",
    "ppo.ppo_epochs=1",
    "trainer.total_rollout_steps=1",
    "trainer.eval_every=0",
    "trainer.checkpoint_every=0",
    "model.warm_start.steps=20",
    "data.n_train=64",
    "data.n_eval=8",
    "model.tiny.num_layers=2",
    "rollout.max_response_tokens=8",
]


# Two 2-process runs with a vLLM engine per rank: minutes on 2 cores (make test-slow). make test covers it in pieces:
# tests/test_distributed.py::test_gradient_sync_syncs_once_per_optimizer_step_with_the_gradients_of_a_sync_per_micro_batch
# (gradient_sync on 2 gloo ranks, DDP and FSDP2: one sync per optimizer step, the gradients of a sync per micro-batch)
# and tests/training/test_layout.py::test_each_mini_batch_marks_exactly_its_last_micro_batch_last (the `last` flag
# train_on_experience passes to it); this test shows the two joined in train.py, with Lightning's strategies.
@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_one_gradient_sync_per_optimizer_step(strategy, tmp_path):
    counts = tmp_path / "counts"
    counts.mkdir()
    out = tmp_path / "run"
    env = dict(
        os.environ,
        LIT_PPO_COUNT_GRAD_SYNC=str(counts),
        PYTHONPATH=os.pathsep.join(
            filter(None, [str(Path(__file__).resolve().parent / "grad_sync"), str(ROOT), os.environ.get("PYTHONPATH")])
        ),
    )
    cmd = [
        sys.executable,
        "train.py",
        *STRATEGIES[strategy],
        *SETTINGS,
        f"output_dir={out}",
        f"cache_dir={tmp_path / 'cache'}",
        f"hydra.run.dir={out / 'hydra'}",
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["layout"]["grad_accumulation_steps"] == 4 and plan["counts"]["optimizer_steps_per_rollout_step"] == 2
    steps = plan["counts"]["total_optimizer_steps"]
    for rank in (0, 1):
        lines = (counts / f"rank{rank}.txt").read_text().split()
        if strategy == "ddp":
            # One DDP wraps actor and critic; each of their backward passes on a mini-batch's last micro-batch syncs.
            assert lines.count("ddp_allreduce_pass") == 2 * steps, lines
        else:
            # FSDP2 units: 2 decoder layers + the root, for the actor and for the critic.
            assert lines.count("reduce_scatter") == 2 * 3 * steps, lines
