"""Partial rollouts (rollout.partial, lit_ppo/rollout/partial.py): what is refused, the plan's section, a carried
sample equal to generating it in two calls by hand (the real vLLM engine), groups trained only once all their samples
ended, the carry bound checked at run time, and the carried groups in the data module's checkpoint state."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import re

import pytest
import torch
from transformers import AutoTokenizer

from lit_ppo.config import (
    DynamicSamplingConfig,
    LoraConfig,
    ModelConfig,
    RolloutConfig,
    RolloutCorrectionConfig,
    RunConfig,
    StrategyConfig,
)
from lit_ppo.config.partial import PartialConfig
from lit_ppo.contract import GenerateRequest, Generation
from lit_ppo.errors import ConfigError, StalenessError
from lit_ppo.plan import check_carried_tokens
from lit_ppo.rollout.engine import sampling_seeds
from lit_ppo.rollout.partial import CarriedGroup, CarriedSample, aged, continuation_seed, generation_of, take_batch
from lit_ppo.rollout.prompt_stream import round_purpose
from lit_ppo.rollout.prompts import Prompt, PromptSet
from tests.helpers import datamodule_on, plan_of, run_config
from tests.helpers.partial import PPO, CountdownEngine, countdown_prompts, partial_rollout
from tests.helpers.prompts import PROMPT_TOKENS, long_prompts


def hashed_responses(prompts, responses, references, extras):
    """A reward in [0, 1) by the response's hash: a group's samples differ, so GRPO moves the weights every step."""
    return [int.from_bytes(hashlib.sha256(r.encode()).digest()[:4], "little") / 2**32 for r in responses]


TIS_KW = {"rollout_correction": RolloutCorrectionConfig(mode="tis")}


# ------------------------------------------------------------ settings and plan


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"rollout": {"engine": "hf", "mode": "disaggregated"}}, "rollout.engine=hf with rollout workers"),
        (
            {"rollout": {"mode": "disaggregated"}, "model": {"lora": LoraConfig(rank=8)}},
            "model.lora with rollout workers",
        ),
        ({"rollout": {"mode": "disaggregated", "max_staleness": 2}}, "rollout.max_staleness=2"),
        ({"ppo": {"dynamic_sampling": DynamicSamplingConfig(enabled=True)}}, "ppo.dynamic_sampling"),
        ({"ppo": {"old_logprobs": "rollout"}}, "ppo.old_logprobs=rollout"),
        ({"rollout": {"mode": "disaggregated"}, "dp": 2}, "rollout workers with more than one trainer rank"),
        ({"strategy": {"devices": 2, "context_parallel_size": 2}}, "strategy.context_parallel_size=2"),
    ],
)
def test_what_partial_rollouts_do_not_compose_with_is_refused_in_one_line(changes, named):
    rollout = partial_rollout(**changes.get("rollout", {}))
    ppo = dataclasses.replace(PPO, **changes.get("ppo", {}))
    with pytest.raises(ConfigError) as error:
        sections = {"model": ModelConfig(**changes["model"])} if "model" in changes else {}
        if "strategy" in changes:
            RunConfig(
                ppo=ppo, rollout=rollout, strategy=StrategyConfig(accelerator="cpu", name="ddp", **changes["strategy"])
            )
        run_config(ppo=ppo, rollout=rollout, dp=changes.get("dp", 1), **sections)
    message = str(error.value)
    assert named in message and "rollout.partial.step_tokens=4" in message and "\n" not in message.strip("\n")


def test_partial_settings_are_checked_and_turn_the_rollout_correction_on():
    with pytest.raises(ConfigError, match="step_tokens=12 >= rollout.max_response_tokens=12"):
        run_config(ppo=PPO, rollout=partial_rollout(step_tokens=12, max_response_tokens=12))
    with pytest.raises(ConfigError, match="at_max_age='keep'"):
        PartialConfig(step_tokens=4, at_max_age="keep")
    with pytest.raises(ConfigError, match="ppo.rollout_correction.mode=none"):
        run_config(
            ppo=dataclasses.replace(PPO, rollout_correction=RolloutCorrectionConfig(mode="none")),
            rollout=partial_rollout(),
        )
    assert run_config(ppo=PPO, rollout=partial_rollout()).ppo.rollout_correction.mode == "tis"  # null resolved
    assert run_config(ppo=PPO).ppo.rollout_correction.mode == "none"  # off: as before


def test_the_plan_states_the_cut_the_groups_in_flight_and_the_carry_bound():
    plan = plan_of(16, ppo=PPO, rollout=partial_rollout(step_tokens=4, max_age_steps=2, max_response_tokens=12))
    assert (plan.partial.step_tokens, plan.partial.groups_in_flight, plan.partial.oldest_token_age) == (4, 12, 2)
    assert plan.partial.longest_response_tokens == 12  # min(12, 3 chunks of 4)
    assert plan.partial.lag_steps == 2  # the backlog of 8 groups over batches of 4
    table = plan.table()
    assert "partial: carry bound" in table and "older than version s - 2" in table
    assert "partial: lag" in table and "partial: weight-sync guard" in table
    assert plan.to_dict()["partial"]["max_age_steps"] == 2
    assert plan_of(16, ppo=PPO).partial is None
    smaller = partial_rollout(4, 2, max_response_tokens=12, groups_in_flight=8)
    assert (
        plan_of(16, ppo=PPO, rollout=smaller).partial.groups_in_flight,
        plan_of(16, ppo=PPO, rollout=smaller).partial.lag_steps,
    ) == (8, 1)


def test_a_response_budget_the_chunks_cannot_reach_is_refused_in_one_line():
    with pytest.raises(ConfigError) as error:
        run_config(ppo=PPO, rollout=partial_rollout(step_tokens=512, max_age_steps=1, max_response_tokens=4096))
    message = str(error.value)
    assert "capped at 1024 tokens" in message and "\n" not in message
    assert "rollout.partial.step_tokens>=2048" in message and "rollout.partial.max_age_steps>=7" in message
    run_config(ppo=PPO, rollout=partial_rollout(step_tokens=2048, max_age_steps=1, max_response_tokens=4096))


@pytest.mark.parametrize("count", [4, 6, 16])
def test_groups_in_flight_outside_whole_rounds_within_the_bound_is_refused(count):
    with pytest.raises(ConfigError, match=f"groups_in_flight={count} with ppo.rollout_batch_size=4.*from 8 to 12"):
        run_config(ppo=PPO, rollout=partial_rollout(4, 2, max_response_tokens=12, groups_in_flight=count))


# ------------------------------------------------------------ a fake engine whose samples end where their seed says


def countdown_datamodule(tokenizer, model_dir, rollout=None, steps=6):
    rollout = rollout or partial_rollout(step_tokens=4, max_age_steps=2, max_response_tokens=12)
    return datamodule_on(countdown_prompts(16), rollout, tokenizer, model_dir, CountdownEngine(), ppo=PPO, steps=steps)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_a_group_trains_only_once_all_its_samples_ended(tokenizer, tiny_model_dir, monkeypatch):
    from lit_ppo.rollout import partial

    taken = []  # each step's trained groups, as take_batch hands them over (cut or not)
    real_take = partial.take_batch

    def watched(*args, **kwargs):
        trained, left = real_take(*args, **kwargs)
        taken.append(trained)
        return trained, left

    monkeypatch.setattr(partial, "take_batch", watched)
    dm = countdown_datamodule(
        tokenizer, tiny_model_dir, rollout=partial_rollout(4, max_age_steps=3, max_response_tokens=13)
    )
    batches = [dm.produce_rollout(step) for step in range(6)]
    carried = 0
    for step, batch in enumerate(batches):
        assert len(batch.response_ids) == PPO.rollout_batch_size * PPO.n_samples_per_prompt  # the plan's shape
        check_carried_tokens(dm.plan, step, batch.version_spans, [len(r) for r in batch.response_ids])
        groups = taken[step]
        assert batch.partial_stats["rollout/partial_cut_groups"] == sum(g.cut for g in groups)
        for g, group in enumerate(groups):
            ended = [batch.response_ids[i][-1] == 0 or len(batch.response_ids[i]) == 13 for i in (2 * g, 2 * g + 1)]
            # Every sample of a trained group ended (its countdown at 0, or the budget), unless this group was cut.
            assert all(ended) or group.cut
            assert not group.cut or not all(ended)
        carried += sum(len(spans) > 1 for spans in batch.version_spans)
        assert batch.partial_stats["rollout/token_age_max"] <= 3
    assert carried > 0  # samples continued in a later step than they started were trained


def test_a_group_that_ended_in_its_first_chunk_trains_within_the_backlog_s_lag(tokenizer, tiny_model_dir):
    """Steady state over 8 steps: a group whose samples all ended in the chunk of the step that started it trains at
    most lag = backlog / rollout_batch_size steps later: 1 with groups_in_flight=8, 2 with the default 12 (the
    backlog of max_age_steps batches: every batch is the cohort started max_age_steps steps before)."""
    lags = {}
    for count in (8, None):
        rollout = partial_rollout(4, 2, max_response_tokens=12, groups_in_flight=count)
        dm = countdown_datamodule(tokenizer, tiny_model_dir, rollout=rollout, steps=8)
        lags[count] = []
        for step in range(8):
            batch = dm.produce_rollout(step)
            for g in range(PPO.rollout_batch_size):
                samples = [(batch.response_ids[i], batch.version_spans[i]) for i in (2 * g, 2 * g + 1)]
                if all(len(r) <= 4 and r[-1] == 0 and len(spans) == 1 for r, spans in samples):  # one chunk each
                    lags[count].append(step - samples[0][1][0][1])
        assert dm.plan.partial.lag_steps == (1 if count else 2)
    assert lags[8] and max(lags[8]) <= 1
    assert 2 in lags[None]  # the default backlog: a short group waits max_age_steps steps


def test_continuations_are_seeded_per_sample_and_limited_by_the_budget(tokenizer, tiny_model_dir):
    dm = countdown_datamodule(tokenizer, tiny_model_dir, rollout=partial_rollout(5, 2, max_response_tokens=13))
    dm.produce_rollout(0)
    first = dm.engine.requests[0]  # step 0: its fresh rounds alone
    assert first.n == 2 and first.limits == [5] * len(first.prompt_token_ids) == [5] * 12  # 3 rounds of 4 prompts
    assert first.seeds[:4] == sampling_seeds(0, "rollout_step=0", range(4), 2)  # round 0: a run without partial's
    unfinished = [(g, s) for g in dm.partial.groups for s in g.samples if not s.finished]
    dm.produce_rollout(1)
    continuation = dm.engine.requests[1]  # step 1: the carried samples, then its fresh round
    assert continuation.n == 1
    assert continuation.prompt_token_ids == [list(g.prompt.prompt_ids) + list(s.token_ids) for g, s in unfinished]
    assert continuation.limits == [min(5, 13 - len(s.token_ids)) for _, s in unfinished]
    assert continuation.seeds == [continuation_seed(s.seed, 1) for _, s in unfinished]
    assert {s.seed for _, s in unfinished} <= {seed + j for seed in first.seeds for j in range(2)}


def test_the_carry_bound_check_stops_a_batch_with_an_older_token(tokenizer, tiny_model_dir):
    # Generated with a carry of up to 3 steps, checked against a plan that allows 1: the check fires.
    dm = countdown_datamodule(
        tokenizer, tiny_model_dir, rollout=partial_rollout(2, max_age_steps=3, max_response_tokens=8)
    )
    tight = plan_of(16, ppo=PPO, rollout=partial_rollout(2, max_age_steps=1, max_response_tokens=4), steps=6)
    batches = [dm.produce_rollout(step) for step in range(4)]
    lengths = lambda b: [len(r) for r in b.response_ids]  # noqa: E731
    assert max(b.partial_stats["rollout/token_age_max"] for b in batches) >= 2
    with pytest.raises(StalenessError, match=r"rollout.partial.max_age_steps=1\); the carried samples"):
        for step, batch in enumerate(batches):
            check_carried_tokens(dm.plan, step, batch.version_spans, lengths(batch))  # its own plan: holds
            check_carried_tokens(tight, step, batch.version_spans, lengths(batch))
    with pytest.raises(StalenessError, match="holds no policy version spans"):
        check_carried_tokens(dm.plan, 0, None, [3])


def stand_in(started: int, ended: bool = True, index: int = 0) -> CarriedGroup:
    """A prompt group of 2 samples started at rollout step `started`: ended (its countdown at 0) or not."""
    tokens = (1, 0) if ended else (2, 1)
    sample = CarriedSample(index, tokens, (-0.5, -0.5), ((0, started),), "x", 1, ended, False)
    return CarriedGroup(index, Prompt([40] * 6, f"p{index}", "0", {}), started, 0, (sample, sample))


def test_groups_at_max_age_are_dropped_and_counted():
    groups = [stand_in(0, ended=False, index=0), stand_in(0, index=1), stand_in(1, ended=False, index=2)]
    kept, dropped = aged(groups, 2, 2, "drop")
    assert ([g.dataset_index for g in kept], dropped) == ([1, 2], 1)
    finished, none = aged(groups, 2, 2, "finish")
    assert none == 0 and [g.cut for g in finished] == [True, False, False] and finished[0].finished


def test_at_max_age_drop_never_trains_a_group_cut_and_keeps_the_batch_size(tokenizer, tiny_model_dir):
    """at_max_age=drop: a batch short of finished groups is filled by continuing the oldest unfinished within the
    step, not by cutting them (which at_max_age=finish does)."""
    rollouts = {mode: partial_rollout(4, 2, mode, max_response_tokens=12) for mode in ("finish", "drop")}
    cuts = {}
    for mode, rollout in rollouts.items():
        dm = countdown_datamodule(tokenizer, tiny_model_dir, rollout=rollout)
        batches = [dm.produce_rollout(step) for step in range(4)]
        cuts[mode] = sum(b.partial_stats["rollout/partial_cut_groups"] for b in batches)
        for step, batch in enumerate(batches):
            assert len(batch.response_ids) == PPO.rollout_batch_size * PPO.n_samples_per_prompt
            check_carried_tokens(dm.plan, step, batch.version_spans, [len(r) for r in batch.response_ids])
            if mode == "drop":  # every sample ended: its countdown at 0, or the response budget reached
                assert all(r[-1] == 0 or len(r) == 12 for r in batch.response_ids)
        fills = sum(b.partial_stats["rollout/partial_fill_chunks"] for b in batches)
        assert fills > 0 if mode == "drop" else fills == 0
    assert cuts["finish"] > 0 and cuts["drop"] == 0


def test_a_batch_never_holds_more_groups_than_its_size():
    groups = [stand_in(0, index=i) for i in range(12)]  # all due now: more than a batch (a resume with a smaller bound)
    with pytest.raises(AssertionError, match="12 groups due, the batch holds 4"):
        take_batch(groups, 4, 3, 1)


def test_the_carried_groups_are_in_the_checkpoint_state(tokenizer, tiny_model_dir):
    dm = countdown_datamodule(tokenizer, tiny_model_dir)
    dm.produce_rollout(0)
    assert dm.partial.groups  # carried
    buffer = io.BytesIO()
    torch.save(dm.state_dict(), buffer)
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    resumed = countdown_datamodule(tokenizer, tiny_model_dir)
    resumed.load_state_dict(state)
    assert resumed.partial.groups == dm.partial.groups
    a, b = dm.produce_rollout(1), resumed.produce_rollout(1)
    assert (a.response_ids, a.rollout_logprobs, a.version_spans) == (
        b.response_ids,
        b.rollout_logprobs,
        b.version_spans,
    )
    off = datamodule_on(
        countdown_prompts(16), RolloutConfig(max_response_tokens=13), tokenizer, tiny_model_dir, ppo=PPO
    )
    with pytest.raises(ConfigError, match="partial rollouts in flight, but rollout.partial.step_tokens=null"):
        off.load_state_dict(state)
    assert state["partial_settings"] == {"step_tokens": 4, "max_age_steps": 2, "groups_in_flight": None}
    for changed, named in [((4, 3), "max_age_steps=2 (now 3)"), ((6, 2), "step_tokens=4 (now 6)")]:
        other = countdown_datamodule(
            tokenizer, tiny_model_dir, rollout=partial_rollout(*changed, max_response_tokens=12)
        )
        with pytest.raises(ConfigError, match=re.escape(named) + ".*fix: resume with the checkpoint's rollout.partial"):
            other.load_state_dict(state)


def test_every_sample_s_text_is_its_tokens_decoded_whatever_its_chunks(tokenizer):
    """vLLM's incremental text of a one-chunk sample and a whole decode may differ in spaces: a reward on text scores
    carried and uncarried samples alike only if every text is decoded one way."""
    ids = tuple(tokenizer.encode("Hello , world !"))
    for chunks in (1, 2):
        sample = CarriedSample(0, ids, (-0.5,) * len(ids), ((0, 0),), "vLLM's own text", chunks, True, False)
        assert generation_of(sample, 0, tokenizer).text == tokenizer.decode(list(ids), skip_special_tokens=True)


# ------------------------------------------------------------ rollout workers generating ahead (k = 1)


class QueuedCountdownWorkers(CountdownEngine):
    """Stands in for the rollout workers' client: each request generated (as `CountdownEngine`) by the version pushed
    last before it was submitted (the workers' ordered queue), handed out when collected."""

    def __init__(self):
        super().__init__()
        self.version = 0  # the last version pushed
        self.submitted: list[int] = []  # the version each request was submitted behind

    def submit(self, request: GenerateRequest):
        self.submitted.append(self.version)
        return self.generate(request), self.version

    def collect(self, ticket):
        generations, version = ticket
        return generations, [version] * len(generations), 0.5


def token_versions(batch) -> list[list[int]]:
    """Each response token's policy version, from the batch's spans."""
    out = []
    for spans, ids in zip(batch.version_spans, batch.response_ids):
        ends = [start for start, _ in spans[1:]] + [len(ids)]
        out.append([v for (start, v), end in zip(spans, ends) for _ in range(end - start)])
    return out


def workers_datamodule(tokenizer, model_dir, k: int = 1, steps: int = 6):
    rollout = partial_rollout(4, 2, max_response_tokens=12, mode="disaggregated", max_staleness=k)
    dm = datamodule_on(
        countdown_prompts(16), rollout, tokenizer, model_dir, QueuedCountdownWorkers(), ppo=PPO, steps=steps
    )
    assert type(dm.source).__name__ == "AheadOfTimeSource"
    return dm


def run_pushed(dm, steps) -> list:
    """`produce_rollout` of `steps`, version s pushed before step s (as the trainer pushes it after training s - 1)."""
    batches = []
    for step in steps:
        dm.engine.version = step
        batches.append(dm.produce_rollout(step))
    return batches


def test_rollout_workers_at_k1_generate_the_next_chunk_ahead_and_train_the_colocated_samples(tokenizer, tiny_model_dir):
    """With rollout workers at k = 1 the chunk of step s + 1 is requested when step s is taken (behind the push of
    version s, before step s trains), and every chunk is of version s - 1 instead of s: the groups in flight, the cuts,
    the tokens, log-probs and seeds are the colocated run's, each token's version the colocated one's minus the lag,
    and the carry bound the plan states, max_age_steps + 1, holds (and is reached) where the colocated one does not."""
    same = countdown_datamodule(tokenizer, tiny_model_dir)
    colocated = [same.produce_rollout(step) for step in range(6)]
    dm = workers_datamodule(tokenizer, tiny_model_dir, k=1)
    batches = []
    for step in range(6):
        batches += run_pushed(dm, [step])
        assert len(dm.engine.submitted) == step + 2  # step s + 1 requested ahead, generated while step s trains
        assert dm.engine.submitted[-1] == step  # behind version s: the schedule's max(0, (s + 1) - 1)
    assert dm.plan.partial.oldest_token_age == 3 and dm.plan.partial.worker_lag == 1
    assert dm.plan.max_staleness == 1 and "max_age_steps 2 + the workers' lag 1" in dm.plan.table()
    tight = countdown_datamodule(tokenizer, tiny_model_dir).plan  # k = 0: a carry bound of 2
    for step, (a, b) in enumerate(zip(colocated, batches)):
        assert (b.response_ids, b.rollout_logprobs, b.dataset_indices) == (
            a.response_ids,
            a.rollout_logprobs,
            a.dataset_indices,
        )
        assert a.partial_stats["rollout/partial_cut_groups"] == b.partial_stats["rollout/partial_cut_groups"]
        lagged = [[max(0, v - 1) for v in versions] for versions in token_versions(a)]
        assert token_versions(b) == lagged
        check_carried_tokens(dm.plan, step, b.version_spans, [len(r) for r in b.response_ids])
    assert max(b.partial_stats["rollout/token_age_max"] for b in batches) == 3
    with pytest.raises(StalenessError, match=r"max_age_steps=2\); the carried"):
        for step, b in enumerate(batches):
            check_carried_tokens(tight, step, b.version_spans, [len(r) for r in b.response_ids])


def test_rollout_workers_at_k0_request_each_chunk_when_taken(tokenizer, tiny_model_dir):
    dm = workers_datamodule(tokenizer, tiny_model_dir, k=0, steps=4)
    colocated = countdown_datamodule(tokenizer, tiny_model_dir, steps=4)
    for step in range(4):
        b, a = run_pushed(dm, [step])[0], colocated.produce_rollout(step)
        assert dm.engine.submitted == list(range(step + 1))  # nothing ahead: each behind its own version
        assert (b.response_ids, b.version_spans) == (a.response_ids, a.version_spans)


def test_a_resume_with_rollout_workers_keeps_the_chunk_generated_ahead_and_the_groups_in_flight(
    tokenizer, tiny_model_dir
):
    """A checkpoint after step 2 at k = 1: the chunk of step 3 (in flight, of version 2) is received and kept with the
    groups it continues; the resumed run requests step 4 first and trains what the uninterrupted one does."""
    full = run_pushed(workers_datamodule(tokenizer, tiny_model_dir), range(6))
    dm = workers_datamodule(tokenizer, tiny_model_dir)
    run_pushed(dm, range(3))
    buffer = io.BytesIO()
    torch.save(dm.state_dict(), buffer)
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert set(state["prefetched"]) == {3} and state["partial_groups"]
    resumed = workers_datamodule(tokenizer, tiny_model_dir)
    resumed.load_state_dict(state)
    later = run_pushed(resumed, range(3, 6))
    assert resumed.engine.submitted == [3, 4, 5]  # steps 4, 5, 6 requested ahead; step 3 came from the checkpoint
    for a, b in zip(full[3:], later):
        assert (b.response_ids, b.rollout_logprobs, b.version_spans) == (
            a.response_ids,
            a.rollout_logprobs,
            a.version_spans,
        )
        assert a.partial_stats == b.partial_stats


def test_a_dropped_step_with_rollout_workers_is_taken_again_without_a_second_request(tokenizer, tiny_model_dir):
    """A preemption drops step 1 after it requested step 2's chunk: taken again from the snapshot, it is the same
    step, and the chunk in flight is not requested twice (the workers' queue holds it once)."""
    dm = workers_datamodule(tokenizer, tiny_model_dir)
    run_pushed(dm, [0])
    snapshot = dm.snapshot()
    first = run_pushed(dm, [1])[0]
    requested = list(dm.engine.submitted)
    dm.restore(snapshot)
    again = run_pushed(dm, [1])[0]
    assert dm.engine.submitted == requested == [0, 0, 1]
    assert (first.response_ids, first.version_spans) == (again.response_ids, again.version_spans)
    assert run_pushed(dm, [2])[0].version_spans  # step 2 takes the chunk requested once


def test_partial_rollouts_with_workers_at_k2_are_refused_and_k1_plans_the_lag():
    with pytest.raises(
        ConfigError, match=r"rollout.max_staleness=2 \(chunk s continues the groups step s - 1 left.*use k <= 1"
    ):
        run_config(ppo=PPO, rollout=partial_rollout(mode="disaggregated", max_staleness=2))
    config = run_config(ppo=PPO, rollout=partial_rollout(mode="disaggregated"))  # k = 1, the mode's default
    assert config.ppo.rollout_correction.mode == "tis" and config.rollout.oldest_token_steps() == 2


@pytest.mark.slow
def test_a_run_with_a_rollout_worker_at_k1_trains_chunks_of_the_lagged_versions(
    tiny_model_dir, long_prompt_files, tmp_path
):
    """Three rollout steps with a spawned vLLM rollout worker at k = 1 (its weights pushed each step): the trainer's
    carry-bound check passes each step, every chunk is of the version the worker held (step u's chunk: max(0, u - 1)),
    a batch's oldest token is max_age_steps + k = 2 steps old."""
    from tests.helpers.asynchronous import disaggregated, fit_then_close, workers_run

    rollout = dataclasses.replace(disaggregated(1), partial=PartialConfig(step_tokens=3, max_age_steps=1))
    trainer, module, dm, plan = workers_run(tiny_model_dir, long_prompt_files, tmp_path, rollout, 3, **TIS_KW)
    fit_then_close(trainer, module, dm)
    assert plan.partial.oldest_token_age == 2
    batches = type(dm).batches
    for step, batch in enumerate(batches):
        started = {spans[0][1] for spans in batch.version_spans}
        assert all(v in (max(0, u - 1) for u in range(step + 1)) for spans in batch.version_spans for _, v in spans)
        assert max(started) <= max(0, step - 1)
    assert [row["rollout/token_age_max"] for row in module.history] == [0, 1, 2]
    assert module.ppo.rollout_correction.mode == "tis"


# ------------------------------------------------------------ the real engine


def carried_samples_equal_two_calls_by_hand(sampler, tokenizer, model_dir, **rollout) -> None:
    """Two rollout steps of prompts of ~100 tokens on `sampler` (an engine) at temperature 0.7: two samples carried
    from step 0 to step 1 have the tokens, log-probs (atol 1e-5), version spans and text of a first call and a
    continuation made by hand, seeded as the data module seeds them."""
    ids = long_prompts(tokenizer, 8, PROMPT_TOKENS - 10, PROMPT_TOKENS - 2, seed=3)
    prompts = PromptSet([Prompt(p, f"p{i}", "0", {}) for i, p in enumerate(ids)], "test")
    settings = partial_rollout(step_tokens=4, max_age_steps=1, max_response_tokens=8, **rollout)
    dm = datamodule_on(prompts, settings, tokenizer, model_dir, sampler, ppo=PPO, steps=2)
    dm.produce_rollout(0)
    carried = {g.dataset_index: g for g in dm.partial.groups}
    batch = dm.produce_rollout(1)
    checked = 0
    for i, spans in enumerate(batch.version_spans):
        index = batch.dataset_indices[i]
        if len(spans) < 2 or index not in carried:
            continue
        j = i % PPO.n_samples_per_prompt
        group = carried[index]
        seed = group.samples[j].seed
        prompt = prompts.prompts[index].prompt_ids
        first_call = GenerateRequest([prompt], n=2, temperature=0.7, top_p=1.0, max_tokens=4, seeds=[seed - j])
        first = sampler.generate(first_call)[j]
        second_call = GenerateRequest(
            [prompt + first.token_ids],
            n=1,
            temperature=0.7,
            top_p=1.0,
            max_tokens=min(4, 8 - len(first.token_ids)),
            seeds=[continuation_seed(seed, 1)],
        )
        second = sampler.generate(second_call)[0]
        assert batch.response_ids[i] == first.token_ids + second.token_ids
        torch.testing.assert_close(
            torch.tensor(batch.rollout_logprobs[i]), torch.tensor(first.logprobs + second.logprobs), atol=1e-5, rtol=0
        )
        assert spans == [[0, 0], [4, 1]]
        assert batch.responses[i] == tokenizer.decode(first.token_ids + second.token_ids, skip_special_tokens=True)
        assert first.text + second.text == batch.responses[i]  # one character per token: the calls' texts join
        # Its first chunk seeded as its prompt's position in round 0 or 1 of step 0 (max_age_steps + 1 rounds).
        rounds = [round_purpose(0, r) for r in range(2)]
        assert seed - j in [s for p in rounds for s in sampling_seeds(0, p, range(4), PPO.n_samples_per_prompt)]
        checked += 1
        if checked == 2:  # enough: each by-hand pair of calls costs a generate
            break
    assert checked == 2


def test_a_carried_sample_equals_generating_it_in_two_calls_by_hand(engine, tokenizer, tiny_model_dir):
    carried_samples_equal_two_calls_by_hand(engine, tokenizer, tiny_model_dir)


def test_a_carried_sample_of_the_hf_engine_equals_generating_it_in_two_calls_by_hand(tokenizer, tiny_model_dir):
    """rollout.engine=hf: the continuation from the carried tokens, on the same seed stream (the engine's per-sample
    generators), with the sampler's log-probs, whatever the other samples in the call."""
    from transformers import AutoModelForCausalLM

    from lit_ppo.rollout.hf_engine import HFEngine

    actor = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    carried_samples_equal_two_calls_by_hand(HFEngine(actor, tokenizer), tokenizer, tiny_model_dir, engine="hf")


def test_a_run_trains_carried_samples_within_the_bound_and_logs_them(
    engine, tiny_model_dir, long_prompt_files, monkeypatch, tmp_path
):
    """Two rollout steps of a run (the real engine, weights synced each step): every batch passes the trainer's
    carry-bound check, carried samples are trained with the sampler's log-probs as the behaviour policy (TIS), and the
    step's partial metrics are logged."""
    run_with_carried_samples(engine, tiny_model_dir, long_prompt_files, monkeypatch, tmp_path)


@pytest.mark.slow  # 43 s on 2 loaded cores; the HF engine's continuation: the by-hand test above (default suite)
def test_a_run_on_the_hf_engine_trains_carried_samples(tiny_model_dir, long_prompt_files, monkeypatch, tmp_path):
    """rollout.engine=hf (the actor generates): the same run; the weight-sync guard on the step's own tokens holds
    (the engine is the actor: they agree)."""
    module = run_with_carried_samples(None, tiny_model_dir, long_prompt_files, monkeypatch, tmp_path, engine="hf")
    assert all(r["rollout/logprob_abs_diff"] < 1e-4 for r in module.history[:1])  # step 1: every token its own


def run_with_carried_samples(sampler, tiny_model_dir, long_prompt_files, monkeypatch, tmp_path, **rollout):
    """`test_a_run_trains_carried_samples_within_the_bound_and_logs_them`'s run on `sampler` (an engine; None: the
    run's own); its module."""
    from lit_ppo.plan import checks
    from tests.helpers import build_run

    checked = []
    real_check = checks.check_carried_tokens  # the trainer's (`check_batch_versions`), watched
    monkeypatch.setattr(checks, "check_carried_tokens", lambda *a: checked.append(a[1]) or real_check(*a))
    settings = partial_rollout(step_tokens=3, max_age_steps=1, max_response_tokens=6, **rollout)
    trainer, module, datamodule, plan = build_run(
        tiny_model_dir,
        sampler,
        long_prompt_files,
        tmp_path,
        total_rollout_steps=2,
        rollout=settings,
        advantage_estimator="grpo",
        kl_coef=0.0,
        kl_mode="loss",
        rollout_batch_size=4,
        n_samples_per_prompt=2,
        reward_fn=hashed_responses,
    )
    trainer.fit(module, datamodule=datamodule)
    assert checked == [0, 1]
    rows = module.history
    assert all(k in rows[-1] for k in ("rollout/carried_samples", "rollout/token_age_mean", "rollout/token_age_max"))
    assert max(r["rollout/token_age_max"] for r in rows) == 1  # carried tokens of the step before were trained
    assert module.ppo.rollout_correction.mode == "tis"
    return module


def test_a_dropped_step_restores_the_groups_in_flight(tokenizer, tiny_model_dir):
    """The snapshot a preemption restores (lit_ppo.preemption) holds the groups in flight: the step taken again is the
    step taken the first time."""
    dm = countdown_datamodule(tokenizer, tiny_model_dir)
    dm.produce_rollout(0)
    snapshot = dm.snapshot()
    first = dm.produce_rollout(1)
    dm.restore(snapshot)
    again = dm.produce_rollout(1)
    assert (first.response_ids, first.version_spans, first.dataset_indices) == (
        again.response_ids,
        again.version_spans,
        again.dataset_indices,
    )
    assert first.partial_stats == again.partial_stats


@pytest.mark.slow
def test_a_run_resumed_with_groups_in_flight_matches_the_uninterrupted_run(
    engine, tiny_model_dir, long_prompt_files, tmp_path
):
    """Three rollout steps uninterrupted, and the same run crashed after step 2 and resumed from the checkpoint of step
    1, which holds groups in flight: the same weights bitwise, the same samples trained."""
    from lit_ppo.checkpoints import checkpoint_path
    from tests.helpers.resume import assert_same_weights, checkpointed_run

    paths = (tiny_model_dir, long_prompt_files)
    settings = dict(
        total_rollout_steps=3,
        rollout=partial_rollout(step_tokens=3, max_age_steps=2, max_response_tokens=9),
        advantage_estimator="grpo",
        kl_coef=0.0,
        kl_mode="loss",
        rollout_batch_size=4,
        n_samples_per_prompt=2,
        reward_fn=hashed_responses,
    )
    _, full, _ = checkpointed_run(paths, engine, tmp_path / "full", every=1, keep=10, **settings)
    checkpointed_run(paths, engine, tmp_path / "split", every=1, keep=10, crash_after=2, **settings)
    saved = checkpoint_path(tmp_path / "split" / "checkpoints", 1)
    state = next(v for k, v in torch.load(saved, weights_only=False).items() if "RolloutDataModule" in k)
    assert state["partial_groups"]  # the resumed run continues carried groups
    _, resumed, _ = checkpointed_run(
        paths, engine, tmp_path / "split", every=1, keep=10, resume_from=str(saved), **settings
    )
    assert resumed.actor_optimizer_steps == full.actor_optimizer_steps
    assert_same_weights(resumed.actor.state_dict(), full.actor.state_dict())
    keys = ("rollout/reward_mean", "rollout/carried_samples", "rollout/token_age_mean", "rollout/response_length_mean")
    assert [[r[k] for k in keys] for r in resumed.history] == [[r[k] for k in keys] for r in full.history]


# ------------------------------------------------------------ the weight-sync guard on carried batches


def test_the_weight_sync_guard_bounds_the_tokens_of_the_batch_s_own_version():
    """A carried sample's tokens of an older version differ from the trainer's log-probs by the updates since: the
    guard (rollout.max_logprob_abs_diff) reads only the tokens of the step's own version, so 2 nats off on the carried
    tokens pass and 2 nats off on the step's own stop the step; the logged difference is over every token."""
    from types import SimpleNamespace

    from lit_ppo.errors import RolloutMismatchError
    from lit_ppo.training.experience import check_rollout_logprobs, current_version_tokens

    mask = torch.tensor([[1.0] * 6, [1.0] * 4 + [0.0] * 2])  # [2, 6]
    batch = SimpleNamespace(rollout_step=3, version_spans=[[[0, 2], [3, 3]], [[0, 3]]])
    current = current_version_tokens(batch, mask)
    assert current.tolist() == [[0.0] * 3 + [1.0] * 3, [1.0] * 4 + [0.0] * 2]
    old = torch.zeros(2, 6)
    carried_off = torch.tensor([[2.0] * 3 + [0.0] * 3, [0.0] * 6])  # the version-2 tokens 2 nats off
    mean, _ = check_rollout_logprobs(batch, old, carried_off, mask, 0.5)
    assert float(mean) == pytest.approx(6 / 10)  # logged over all 10 tokens
    own_off = torch.tensor([[0.0] * 3 + [2.0] * 3, [0.0] * 6])  # the step's own tokens off: a failed sync
    with pytest.raises(RolloutMismatchError, match=r"^rollout step 4: .* 0.857 nats .* on its 7 tokens of version 3"):
        check_rollout_logprobs(batch, old, own_off, mask, 0.5)
    whole = SimpleNamespace(rollout_step=3, version_spans=None, policy_versions=None)  # without partial rollouts: all
    assert current_version_tokens(whole, mask) is mask
    with pytest.raises(RolloutMismatchError, match=r"0.600 nats per token on average \(max"):
        check_rollout_logprobs(whole, old, carried_off, mask, 0.5)


def test_a_carried_batch_from_an_engine_left_with_stale_weights_stops_the_run(
    engine, tiny_model_dir, long_prompt_files, monkeypatch, tmp_path
):
    """Partial rollouts, a high learning rate, and the engine NOT given the weights after step 1: step 2 trains the
    groups carried from step 1, continued by the stale engine under version 1. The guard on the tokens of version 1
    stops the run there (it was off for every batch holding a carried token)."""
    from lit_ppo.errors import RolloutMismatchError
    from tests.helpers import build_run

    rollout = partial_rollout(step_tokens=3, max_age_steps=1, max_response_tokens=6)
    trainer, module, datamodule, _ = build_run(
        tiny_model_dir,
        engine,
        long_prompt_files,
        tmp_path,
        total_rollout_steps=2,
        rollout=rollout,
        actor_lr=5e-2,
        rollout_batch_size=4,
        n_samples_per_prompt=2,
        reward_fn=hashed_responses,
    )
    real_sync, synced = type(module).sync_weights, []

    def sync_only_at_the_start(self, engine_, *args, **kwargs):
        if not synced:
            real_sync(self, engine_, *args, **kwargs)
        synced.append(self.rollout_step)

    monkeypatch.setattr(type(module), "sync_weights", sync_only_at_the_start)
    with pytest.raises(
        RolloutMismatchError, match=r"^rollout step 2: .* tokens of version 1 .*max_logprob_abs_diff=0.5"
    ):
        trainer.fit(module, datamodule=datamodule)
    assert module.history[0]["rollout/logprob_abs_diff"] < 1e-3  # step 1 sampled from the synced weights


# ------------------------------------------------------------ LoRA: each chunk's adapter


def test_each_chunk_records_its_adapter_and_a_stale_one_stops_the_run():
    """model.lora: a carried sample keeps the LoRA adapter version of each chunk (span); a chunk whose adapter did not
    advance with its policy version (a sync that did not reach the engine) stops the run in one line; the sample's
    adapter as the trainer checks it is its last chunk's."""
    from lit_ppo.errors import WeightSyncError
    from lit_ppo.rollout.partial import extended

    first = extended(CarriedSample(7, (), (), (), "", 0, False, False), chunk(3, adapter=1), 0, 8)
    second = extended(first, chunk(3, adapter=2), 1, 8)
    assert (second.spans, second.adapters) == (((0, 0), (3, 1)), (1, 2))
    assert generation_of(second, 0, FakeTokenizer()).adapter_version == 2
    with pytest.raises(
        WeightSyncError, match=r"^rollout step 2: a carried sample's tokens from 3 of policy version 1 "
    ):
        extended(first, chunk(3, adapter=1), 1, 8)  # the adapter of version 0 still served at version 1
    shared = extended(CarriedSample(7, (), (), (), "", 0, False, False), chunk(3, adapter=0), 0, 8)
    assert extended(shared, chunk(3, adapter=0), 1, 8).adapters == (0, 0)  # the HF engine shares the actor's


def chunk(length: int, adapter: int) -> Generation:
    return Generation(0, list(range(10, 10 + length)), True, "x" * length, [-0.5] * length, adapter)


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)
