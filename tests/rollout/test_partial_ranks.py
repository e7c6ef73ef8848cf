"""Partial rollouts on several trainer ranks (rollout.partial with strategy.devices=2, colocated; lit_ppo/rollout/
partial.py): each rank generates its share of every chunk, every rank holds every group in flight, and each trains its
contiguous share of the batch. Two in-process gloo ranks against one process: the same samples, versions and
statistics, the carry bound held, and a resume from a rank's checkpoint state continues exactly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from lit_ppo.plan import check_carried_tokens
from lit_ppo.topology import RankTopology
from tests.helpers import ROOT, datamodule_on, plan_of
from tests.helpers.partial import PPO, CountdownEngine, countdown_prompts, episode_rollout, partial_rollout
from tests.helpers.ranks import start_ranks

# Imported here, not in the ranks: the fork server imports this module once and each rank starts from it.

STEPS, RESUME_AT = 6, 3
FIELDS = ("prompt_positions", "dataset_indices", "response_ids", "rollout_logprobs", "version_spans", "truncated")


def run_steps(rank: int, world: int, model_dir: str, at_max_age: str) -> dict:
    """The data module of `rank` of `world` on the countdown engine: its batches of STEPS rollout steps, the prompts
    each of its generate calls held, its groups in flight at the end, its checkpoint state after RESUME_AT steps and
    the batches of a data module resumed from that state."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rollout = partial_rollout(4, 2, at_max_age, max_response_tokens=12)

    def datamodule():
        plan = plan_of(16, ppo=PPO, rollout=rollout, steps=STEPS, dp=world)
        topology = RankTopology(rank=rank, world_size=world)
        return datamodule_on(
            countdown_prompts(16), rollout, tokenizer, model_dir, CountdownEngine(), plan=plan, topology=topology
        )

    dm = datamodule()
    batches, state = [], None
    for step in range(STEPS):
        if step == RESUME_AT:
            state = dm.state_dict()
        batches.append(dm.produce_rollout(step))
    resumed = datamodule()
    resumed.load_state_dict(state)
    return {
        "batches": batches,
        "resumed": [resumed.produce_rollout(step) for step in range(RESUME_AT, STEPS)],
        "generated": [r.prompt_count * r.n for r in dm.engine.requests],
        "groups": dm.partial.groups,
        "state": state,
        "plan": dm.plan,
    }


def values(batch, name: str) -> list:
    """A per-sample field of `batch` as a list (a tensor's as Python values)."""
    field = getattr(batch, name)
    return field.tolist() if isinstance(field, torch.Tensor) else list(field)


MODES = ("finish", "drop")  # rollout.partial.at_max_age: cut to fill a batch, or continue within the step (fill chunks)


def _rank(rank: int, world: int, model_dir: str, out: str) -> None:
    sys.path.insert(0, str(ROOT))
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=world)
    try:
        for mode in MODES:  # one start of the ranks for both (their start is most of the test's time)
            torch.save(run_steps(rank, world, model_dir, mode), Path(out, f"{mode}-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("partial_ranks")
    start_ranks(_rank, 2, 2, tiny_model_dir, str(out))
    return out


@pytest.mark.parametrize("at_max_age", MODES)
def test_two_ranks_generate_shares_of_every_chunk_and_train_the_one_process_samples(
    two_ranks, tiny_model_dir, at_max_age
):
    ranks = [torch.load(two_ranks / f"{at_max_age}-rank{r}.pt", weights_only=False) for r in range(2)]
    one = run_steps(0, 1, tiny_model_dir, at_max_age)
    plan = ranks[0]["plan"]
    per_rank = plan.counts.samples_per_rank_per_rollout_step
    assert (per_rank, plan.partial.oldest_token_age) == (4, 2)  # 4 groups of 2 samples over 2 ranks; the carry bound
    carried = 0
    for step in range(STEPS):
        whole, shares = one["batches"][step], [r["batches"][step] for r in ranks]
        for share in shares:
            assert len(share.response_ids) == per_rank  # the plan's share: as many samples and micro-batches
            check_carried_tokens(plan, step, share.version_spans, [len(x) for x in share.response_ids])
            assert share.partial_stats == whole.partial_stats  # the whole batch's, on every rank
        for name in FIELDS:  # rank 0's groups, then rank 1's: the one-process batch
            joined = [values(share, name) for share in shares]
            assert joined[0] + joined[1] == values(whole, name), (step, name)
        carried += sum(len(spans) > 1 for share in shares for spans in share.version_spans)
    assert carried > 0  # samples continued in a later step than they started were trained
    # Each rank generated its share of every chunk (the prompts of its calls add up to the one process's), and every
    # rank holds every group in flight: one checkpoint state, the one process's.
    assert sum(map(sum, (r["generated"] for r in ranks))) == sum(one["generated"])
    assert all(sum(r["generated"]) < sum(one["generated"]) for r in ranks)
    assert ranks[0]["groups"] == ranks[1]["groups"] == one["groups"] and one["groups"]
    assert ranks[0]["state"] == ranks[1]["state"] == one["state"] and one["state"]["partial_groups"]
    if at_max_age == "drop":
        fills = sum(b.partial_stats["rollout/partial_fill_chunks"] for b in one["batches"])
        assert fills > 0  # continued within the step, each rank its share of the fill chunks
    # A resume from the checkpoint state continues exactly, on each rank.
    for r in ranks:
        for resumed, uninterrupted in zip(r["resumed"], r["batches"][RESUME_AT:]):
            assert all(values(resumed, name) == values(uninterrupted, name) for name in FIELDS)


@pytest.mark.slow  # two 2-rank `python train.py` runs (a vLLM engine per rank); the in-process ranks above: make test
def test_a_two_rank_run_resumed_with_groups_in_flight_ends_as_the_uninterrupted_one(tmp_path):
    """`python train.py strategy=ddp strategy.devices=2` with partial rollouts, 3 rollout steps, and the same run
    resumed from its checkpoint of step 1, which holds groups in flight (rank 0's state: every rank's): the same
    samples of step 2 and the same final weights, bitwise."""
    import shutil

    from tests.helpers.cli_runs import DDP, experience, final_actor, metrics, train_cli

    cache = tmp_path / "cache"
    partial = ["rollout.partial.step_tokens=3", "rollout.partial.max_age_steps=2", "trainer.total_rollout_steps=3"]
    partial += ["trainer.keep_checkpoints=3"]
    run = train_cli(tmp_path / "full", cache, *DDP, *partial)
    saved = run / "checkpoints" / "rollout_step_000001.ckpt"
    state = next(v for k, v in torch.load(saved, weights_only=False).items() if "RolloutDataModule" in k)
    assert any(not s["finished"] for g in state["partial_groups"] for s in g["samples"])  # carried, unfinished
    out = tmp_path / "resumed"
    out.mkdir()
    resumed = train_cli(out, cache, *DDP, *partial, f"resume={shutil.copy(saved, out / 'start.ckpt')}")
    a, b = experience(run, 2, world=2), experience(resumed, 2, world=2)
    assert b["response_ids"] == a["response_ids"]
    keys = ("rollout/carried_samples", "rollout/token_age_mean", "rollout/token_age_max", "rollout/reward_mean")
    rows = {r["rollout_step"]: [r[k] for k in keys] for r in metrics(run)}
    assert {r["rollout_step"]: [r[k] for k in keys] for r in metrics(resumed)}.items() <= rows.items()
    assert metrics(resumed)[-1]["rollout_step"] == "3"
    final, final_resumed = final_actor(run), final_actor(resumed)
    assert final.keys() == final_resumed.keys()
    assert all(torch.equal(final_resumed[name], final[name]) for name in final)


def test_tool_episodes_with_more_than_one_trainer_rank_are_refused_in_one_line():
    from lit_ppo.errors import ConfigError
    from tests.helpers import run_config

    run_config(ppo=PPO, rollout=episode_rollout())  # one rank: composes
    with pytest.raises(ConfigError) as error:
        run_config(ppo=PPO, rollout=episode_rollout(), dp=2)
    message = str(error.value)
    assert "rollout.episodes.environment with more than one trainer rank" in message and "\n" not in message.strip()
