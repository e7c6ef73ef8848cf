"""A context-parallel group's rollouts (lit_ppo/rollout/context_group.py): the group's other ranks hold a
`FollowerEngine`, which generates nothing. The group's rank 0 producing for them: tests/test_context_share.py; the
whole rollout step: tests/training/test_context_parallel.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lit_ppo.rollout.context_group import FollowerEngine, follower_engine


class _Engine:
    def __init__(self):
        self.calls = []

    def sleep(self):
        self.calls.append("sleep")

    def close(self):
        self.calls.append("close")


def test_a_follower_engine_generates_nothing_and_reads_every_synced_tensor_in_order():
    from lit_ppo.contract import GenerateRequest, WeightUpdate

    read = []

    def tensors():  # as `full_tensors` yields them: under FSDP each read is a gather from every rank
        for name in ("embed.weight", "layer.0.weight", "lm_head.weight"):
            read.append(name)
            yield name, torch.zeros(2)

    inner = _Engine()
    engine = FollowerEngine(inner)
    assert inner.calls == ["sleep"]  # asleep from its start
    assert engine.update_weights(WeightUpdate(1, tensors=tensors())) == 0
    assert read == ["embed.weight", "layer.0.weight", "lm_head.weight"]
    engine.wake_up()
    try:
        engine.generate(GenerateRequest([[1, 2]], n=1, temperature=0.7, top_p=1.0, max_tokens=4))
        raise AssertionError("a follower generated")
    except RuntimeError as refused:
        assert "a context-parallel group's rank 0 generates its samples" in str(refused)
    engine.close()
    assert inner.calls == ["sleep", "close"]


def test_a_follower_starts_the_engine_only_where_its_start_is_a_collective():
    """Colocated vLLM (external_launcher: process groups created over every rank) starts on a follower too; the HF
    engine, which is the actor itself, does not start."""
    started = []

    def datamodule(engine: str):
        source = SimpleNamespace(start_engine=lambda dm: started.append(engine) or _Engine())
        return SimpleNamespace(
            rollout=SimpleNamespace(engine=engine),
            plan=SimpleNamespace(workers=None),
            topology=SimpleNamespace(distributed=True),
            source=source,
        )

    vllm = follower_engine(datamodule("vllm"))
    assert isinstance(vllm.inner, _Engine) and vllm.inner.calls == ["sleep"]
    assert follower_engine(datamodule("hf")).inner is None
    assert started == ["vllm"]
