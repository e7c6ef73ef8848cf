"""Bounded waits (lit_ppo/waits.py): a collective that another rank never joins, a process group that a rank never
joins and an engine start that runs long each stop the run in one line naming what was waited for and the setting to
raise. The 2-process run whose rank 1 hangs is `tests/end_to_end/test_ddp.py::test_a_rank_that_hangs_stops_the_run_naming_the_phase`
(slow)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from lit_ppo import waits
from lit_ppo.errors import ConfigError, WaitTimeoutError
from lit_ppo.rollout.datamodule import RolloutDataModule
from lit_ppo.run.train import lightning_strategy
from tests.helpers import ROOT, build_run, compose_run_config, free_port

COLLECTIVE_TIMEOUT_S = 3.0


RANK_SCRIPT = """
import os, sys, time
import torch
import torch.distributed as dist
from lit_ppo import waits


class Strategy:  # the keyword DDPStrategy and ModelParallelStrategy take (Lightning is slow to import here)
    def __init__(self, timeout=None): ...


rank, port, timeout_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
try:
    dist.init_process_group("gloo", rank=rank, world_size=2, **waits.strategy_timeout(Strategy, timeout_s))
    if rank == 1:
        time.sleep(300)  # never reaches the all-reduce; the test ends this process
    waits.entering("the weight sync after rollout step 3")
    dist.all_reduce(torch.ones(4))
    print("the all-reduce returned")
except Exception as error:
    named = waits.named_timeout(error, rank)
    print(named if named is not None else f"not recognised: {type(error).__name__}: {error}")
"""
"""One gloo rank under the run's process-group timeout. Rank 1, when started, joins the process group but never the
all-reduce; rank 0 prints the run's one line for what it waited in."""


@pytest.mark.parametrize(
    "absent_from, phase",
    [
        ("all_reduce", "the weight sync after rollout step 3"),
        ("process_group", "the ranks' start (the process group's rendezvous)"),
    ],
)
def test_a_rank_that_never_joins_stops_the_wait_naming_it(absent_from, phase):
    """Rank 1 never joins the all-reduce (it sleeps), or never joins the process group (it never starts)."""
    port = str(free_port())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))

    def rank(r: int) -> subprocess.Popen:
        command = [sys.executable, "-c", RANK_SCRIPT, str(r), port, str(COLLECTIVE_TIMEOUT_S)]
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    ranks = [rank(0)] + ([rank(1)] if absent_from == "all_reduce" else [])
    try:
        answer = ranks[0].communicate(timeout=120)[0].strip().splitlines()[-1]
    finally:
        for process in ranks:
            process.kill()
            process.wait()
    assert answer == (
        f"rank 0 waited more than trainer.collective_timeout_s=3s for the other ranks in {phase}; a rank hung or "
        "stopped there (its log: <run>/logs/run.rank<N>.log); fix: find what held it up, or raise "
        f"trainer.collective_timeout_s if {phase} is only slow on some ranks"
    )


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_strategys_process_group_gets_the_collective_timeout(strategy):
    config = compose_run_config(f"strategy={strategy}", "trainer.collective_timeout_s=7")
    assert lightning_strategy(config)._timeout == timedelta(seconds=7)


def test_an_engine_start_past_its_limit_stops_the_run_naming_it(tiny_model_dir, arithmetic_files, tmp_path, engine):
    """The real vLLM engine, started by the data module inside `fit`, given less time than it takes to start.

    `engine` (the session's shared one, unused here) is started first, so vLLM is wholly imported before the deadline
    cuts a start: cut during vLLM's first import, the half-imported package breaks every later engine in this process
    ("module vllm has no attribute logging_utils")."""
    from lit_ppo.config import RolloutConfig

    rollout = RolloutConfig(max_response_tokens=6, eval_samples_per_prompt=2, engine_start_timeout_s=0.05)
    trainer, module, datamodule, _ = build_run(tiny_model_dir, None, arithmetic_files, tmp_path, rollout=rollout)
    assert type(datamodule) is RolloutDataModule
    with pytest.raises(WaitTimeoutError) as raised:
        trainer.fit(module, datamodule=datamodule)
    assert str(raised.value).startswith(
        "the vLLM engine's start took more than rollout.engine_start_timeout_s=0.05s and was stopped"
    )
    assert datamodule.engine is None


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.collective_timeout_s=0", "trainer.collective_timeout_s=0"),
        ("rollout.engine_start_timeout_s=-1", "rollout.engine_start_timeout_s=-1"),
    ],
)
def test_a_limit_that_is_not_positive_is_refused(override, key):
    with pytest.raises(ConfigError, match=f"^{key}.*fix: a positive number of seconds"):
        compose_run_config(override)


def test_a_long_wait_is_said_after_a_while_then_each_time_it_doubles(caplog):
    """`said_while_waiting`: nothing for a wait shorter than `after_s`; then lines at after_s, 2x, 4x...; none after
    the block."""
    with caplog.at_level(logging.INFO, logger="lit_ppo"):
        with waits.said_while_waiting(lambda s: f"waiting for the thing: {s:.2f} s so far", after_s=0.5):
            time.sleep(0.1)
        assert caplog.records == []
        with waits.said_while_waiting(lambda s: f"waiting for the thing: {s:.2f} s so far", after_s=0.1):
            time.sleep(0.7)  # lines near 0.1, 0.2 and 0.4 s (the next would be at 0.8)
        said = [r.getMessage() for r in caplog.records]
        time.sleep(0.3)
    assert [r.getMessage() for r in caplog.records] == said, "a line after the wait ended"
    assert 2 <= len(said) <= 3 and all(line.startswith("waiting for the thing: ") for line in said), said
    seconds = [float(line.split(": ")[1].split(" ")[0]) for line in said]
    assert seconds[0] >= 0.1 and seconds[1] >= 0.2 and seconds == sorted(seconds), said
