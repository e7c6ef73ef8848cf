"""PPOModule's own checkpoint state (lit_ppo/training/state.py): which random streams a resumed rank takes back."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lit_ppo.checkpoints import rng_state
from lit_ppo.topology import RankTopology
from lit_ppo.training import state as module_state


def _module(rank: int, world: int, C: int):
    counts = SimpleNamespace(
        data_parallel_size=world // C,
        context_parallel_size=C,
        optimizer_steps_per_rollout_step=4,
        samples_per_rollout_step=8,
    )
    return SimpleNamespace(
        topology=RankTopology(rank=rank, world_size=world, context_parallel_size=C),
        plan=SimpleNamespace(counts=counts),
        guarded_step=SimpleNamespace(skipped=0),
        shuffle_generator=torch.Generator(),
    )


def _checkpoint_of_two_ranks_at(C: int) -> dict:
    """What 2 ranks at context-parallel size C saved: rank 0's shuffle stream seeded 10, rank 1's seeded 11."""
    streams = [
        {"rng": rng_state(), "shuffle_generator": torch.Generator().manual_seed(10 + r).get_state()} for r in (0, 1)
    ]
    counts = dict(
        data_parallel_size=2 // C,
        context_parallel_size=C,
        optimizer_steps_per_rollout_step=4,
        samples_per_rollout_step=8,
    )
    return {
        **{k: 0 for k in module_state.MODULE_STATE},
        "skipped_updates": 0,
        **streams[0],
        "rank_states": streams,
        "plan": {"counts": counts},
    }


def test_a_rank_takes_its_own_streams_only_on_the_ranks_and_context_parallel_size_that_saved_them(monkeypatch):
    """Rank 1 of 2 resumed at the C it was saved at takes its own stream; at another C (2 ranks still: 2 -> 1 or
    1 -> 2) rank 0's, as on another number of ranks, and rank 0 says so in one line naming both Cs."""
    shown = []
    monkeypatch.setattr(module_state, "show", shown.append)
    for saved_C, resumed_C, own in [(2, 2, True), (1, 1, True), (2, 1, False), (1, 2, False)]:
        module = _module(1, 2, resumed_C)
        module_state.restore_module_state(module, _checkpoint_of_two_ranks_at(saved_C))
        expected = torch.Generator().manual_seed(11 if own else 10).get_state()
        assert torch.equal(module.shuffle_generator.get_state(), expected), (saved_C, resumed_C)
    assert shown == []  # rank 1 does not speak
    module_state.restore_module_state(_module(0, 2, 1), _checkpoint_of_two_ranks_at(2))
    assert shown == [
        "resharded: the checkpoint of rollout step 0 was written by 2 rank(s) (C = 2) and continues on 2 (C = 1); "
        "weights and optimizer states are whole, the data position and the sampling seeds global; each rank takes "
        "rank 0's random streams"
    ]
