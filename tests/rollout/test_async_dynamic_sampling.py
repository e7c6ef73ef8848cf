"""Dynamic sampling under rollout.mode=disaggregated (issue 36 item 2): each rollout step requested ahead with the
plan's rounds, refill rounds requested from the step's own version once its rewards are in, rounds not needed given
back to the prompt stream. At k = 0 the trained samples are colocated dynamic sampling's; at k = 1 every batch has the
plan's size and every sample the plan's version; no prompt round is used twice or skipped; a checkpoint (and a
dropped step's) resumes exactly.

The data module is driven as the trainer drives it (produce a step, push the next version), with a stand-in engine
whose samples depend only on the prompt and its seed, as vLLM's do: colocated, or queued as the rollout workers queue
them (tests/rollout/test_async.py runs the real workers)."""

from __future__ import annotations

import hashlib

import pytest

from lit_ppo.config import DynamicSamplingConfig, PPOConfig, RolloutConfig
from lit_ppo.contract import Generation
from lit_ppo.errors import DynamicSamplingShortfallError, StalenessError
from lit_ppo.plan import check_policy_versions, compute_plan
from lit_ppo.rollout.schedule import AheadOfTimeSource
from tests.helpers import compose_run_config, datamodule_on, plan_of
from tests.helpers.asynchronous import even_answers_are_uniform

ROLLOUT_BATCH = 8  # prompts per rollout step and per generation round
N = 4  # samples per prompt
STEPS = 7


def sample(prompt_ids: list[int], seed: int) -> Generation:
    """A response that depends only on the prompt and the seed (as a seeded vLLM sample does)."""
    digest = hashlib.sha256(f"{prompt_ids}/{seed}".encode()).digest()
    return Generation(0, list(digest[:3]), False, digest[:3].hex(), [-1.0, -1.0, -1.0])


class StandInEngine:
    """Colocated: generates now (contract `generate`)."""

    version = None

    def wake_up(self):
        pass

    def generate(self, request):
        out = []
        for i, (ids, seed) in enumerate(zip(request.prompt_token_ids, request.seeds)):
            for j in range(request.n):
                g = sample(ids, seed * 1000 + j)
                out.append(Generation(i, g.token_ids, g.truncated, g.text, g.logprobs))
        return out


class StandInWorkers(StandInEngine):
    """The rollout workers' client: a request is generated with the version pushed last before it (the workers'
    ordered queue); `requests` records (prompt ids, version) of each."""

    def __init__(self, version: int = 0):
        self.version = version
        self.requests: list[tuple[list[list[int]], int]] = []

    def submit(self, request):
        self.requests.append((request.prompt_token_ids, self.version))
        return self.generate(request), self.version

    def collect(self, ticket):
        generations, version = ticket
        return generations, [version] * len(generations), 0.1


@pytest.fixture(scope="module")
def parts(tiny_model_dir, arithmetic_files):
    from transformers import AutoTokenizer

    from lit_ppo.rollout.prompts import load_prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    return tiny_model_dir, tokenizer, load_prompts(arithmetic_files[0], tokenizer)


def ppo(**ds) -> PPOConfig:
    return PPOConfig(
        rollout_batch_size=ROLLOUT_BATCH,
        n_samples_per_prompt=N,
        train_batch_size=8,
        micro_train_batch_size=4,
        advantage_estimator="grpo",
        kl_coef=0.0,
        kl_mode="loss",
        dynamic_sampling=DynamicSamplingConfig(
            enabled=True, **{"max_generation_rounds": 3, "expected_informative_fraction": 0.5, **ds}
        ),
    )


def datamodule(parts, k: int | None, engine, steps: int = STEPS, **ds):
    """A data module of dynamic sampling, colocated (k None) or with rollout workers at staleness k."""

    model_dir, tokenizer, prompts = parts
    rollout = (
        RolloutConfig(max_response_tokens=6)
        if k is None
        else RolloutConfig(max_response_tokens=6, mode="disaggregated", max_staleness=k)
    )
    return datamodule_on(
        prompts, rollout, tokenizer, model_dir, engine, ppo=ppo(**ds), steps=steps, reward_fn=even_answers_are_uniform
    )


def drive(dm, first: int = 0, last: int = STEPS) -> list:
    """Rollout steps first..last-1 as the trainer takes them: each batch, then the push of the next version."""
    batches = []
    for step in range(first, last):
        batches.append(dm.produce_rollout(step))
        dm.engine.version = step + 1
    return batches


def trained(batch) -> tuple:
    return (
        batch.dataset_indices,
        batch.response_ids,
        batch.rewards.tolist(),
        batch.generation_rounds,
        batch.dropped_groups,
        batch.filled_groups,
        batch.prompts_consumed,
        batch.data_epoch,
    )


def test_the_plan_states_the_rounds_requested_ahead_and_the_expected_refill():
    """8 prompts a round, 8 needed, half of the groups expected to differ, 3 rounds at most: 2 rounds requested ahead;
    P(R > 0) = 1, P(R > 1) = 1 - 2^-8 = 0.99609, P(R > 2) = P(Binomial(16, 1/2) <= 7) = 0.40181, so 2.40 rounds used,
    0.40 refill rounds and 0.0039 rounds returned per step."""
    disaggregated = RolloutConfig(mode="disaggregated", max_staleness=1)
    plan = plan_of(64, ppo=ppo(), rollout=disaggregated, steps=4)
    ds = plan.dynamic_sampling
    assert ds.rounds_requested_ahead == 2
    assert ds.expected_rounds == pytest.approx(1 + (1 - 2**-8) + 0.401809692, abs=1e-8)
    assert ds.expected_refill_rounds == pytest.approx(0.401809692, abs=1e-8)
    assert ds.expected_returned_rounds == pytest.approx(2**-8, abs=1e-12)
    table = plan.table()
    assert "dynamic sampling: ahead" in table and "behind the 1 step(s) requested ahead" in table
    assert "0.40  rounds / rollout step expected after its rewards, generated by version s (32 samples" in table
    # the schedule the plan states: rounds requested ahead by max(0, s - k), refill rounds by s
    assert [plan.generating_version(3, r) for r in range(3)] == [2, 2, 3]
    # colocated: the expected rounds, nothing requested ahead; every group differing: 1 round ahead
    colocated = plan_of(64, ppo=ppo(), steps=4).dynamic_sampling
    assert colocated.rounds_requested_ahead is None and colocated.expected_rounds == pytest.approx(ds.expected_rounds)
    assert (
        plan_of(
            64, ppo=ppo(expected_informative_fraction=1.0), rollout=disaggregated
        ).dynamic_sampling.rounds_requested_ahead
        == 1
    )


def test_dapo_runs_with_rollout_workers():
    """The refusal of issue 36 is lifted: ppo=dapo plans under rollout.mode=disaggregated."""
    plan = compute_plan(compose_run_config("rollout.mode=disaggregated", "ppo=dapo"), 2000)
    assert plan.dynamic_sampling.rounds_requested_ahead >= 1 and plan.workers.max_staleness == 1


@pytest.mark.parametrize(
    "ds, happens",
    [
        # every group expected to differ: 1 round requested, a second refilled after the rewards
        ({"expected_informative_fraction": 1.0}, "refill"),
        # rounds of 16 prompts for 8, 0.3 expected to differ: 2 requested, the second mostly given back
        ({"expected_informative_fraction": 0.3, "prompts_per_round": 16}, "returned"),
    ],
    ids=["refill", "returned"],
)
def test_k0_trains_exactly_the_colocated_samples(parts, ds, happens):
    """k = 0 (every round at version s): step for step the same prompts, samples, rewards, rounds, dropped and filled
    groups as colocated dynamic sampling, although each step is requested with the plan's rounds before its rewards
    are known, then refilled, or its rounds not needed given back to the prompt stream."""
    colocated = drive(datamodule(parts, None, StandInEngine(), **ds))
    dm = datamodule(parts, 0, StandInWorkers(), **ds)
    workers = drive(dm)
    assert [trained(b) for b in workers] == [trained(b) for b in colocated]
    assert [set(b.policy_versions) for b in workers] == [{s} for s in range(STEPS)]
    rounds, ahead = [b.generation_rounds for b in workers], dm.plan.dynamic_sampling.rounds_requested_ahead
    assert (max(rounds) > ahead) if happens == "refill" else (min(rounds) < ahead), (rounds, ahead)
    assert dm.stream.next_generation_round - len(dm.stream.returned_generation_rounds) == sum(rounds)


def test_k1_batches_have_the_plans_size_and_versions_and_no_round_is_used_twice_or_skipped(parts):
    dm = datamodule(parts, 1, StandInWorkers())
    used: list[int] = []
    original = dm.stream.finish_rounds
    dm.stream.finish_rounds = lambda step, n: used.extend(original(step, n)) or used[-n:]
    batches = drive(dm)
    plan = dm.plan
    for step, batch in enumerate(batches):
        assert len(batch.response_ids) == ROLLOUT_BATCH * N and len(set(batch.prompt_positions)) == ROLLOUT_BATCH
        planned = [plan.generating_version(step, r) for r in batch.rounds_in_step]
        assert batch.policy_versions == planned
        check_policy_versions(plan, step, batch.policy_versions, batch.rounds_in_step)
    refilled = [b for b in batches if max(b.rounds_in_step) >= 2]
    assert refilled and all(set(b.policy_versions) == {b.rollout_step - 1, b.rollout_step} for b in refilled)
    # Every round drawn is used once, or given back, or drawn for the step requested ahead: none twice, none skipped.
    ahead = [r for rounds in dm.stream.step_generation_rounds.values() for r in rounds]
    assert len(used) == len(set(used))
    assert sorted(used + dm.stream.returned_generation_rounds + ahead) == list(range(dm.stream.next_generation_round))
    # Each step's prompts are those of the rounds it used, and the trained prompts are among them.
    assert sum(b.prompts_consumed for b in batches) == len(used) * ROLLOUT_BATCH
    # A refill sample recorded with the version requested ahead stops the run, naming the plan's version.
    step, batch = refilled[0].rollout_step, refilled[0]
    with pytest.raises(StalenessError, match=rf"^rollout step {step + 1}: .* but the plan says version {step} "):
        check_policy_versions(plan, step, [step - 1] * len(batch.policy_versions), batch.rounds_in_step)


@pytest.mark.parametrize("k", [1, 2])
def test_a_checkpoint_and_a_dropped_steps_restore_resume_exactly(parts, k):
    """A checkpoint after step 2, and one written after step 3 was dropped (the snapshot at its start restored,
    after its refill rounds were drawn and requested): each resumed data module (fresh workers holding version 3)
    trains steps 3.. exactly as the uninterrupted one, requesting only what was not kept."""
    full = drive(datamodule(parts, k, StandInWorkers()))

    dm = datamodule(parts, k, StandInWorkers())
    drive(dm, 0, 3)
    after_step_2 = dm.state_dict()
    snapshot = dm.snapshot()
    dropped = dm.produce_rollout(3)
    assert trained(dropped) == trained(full[3])
    dm.restore(snapshot)
    after_drop = dm.state_dict()
    # The drop keeps what step 3 requested ahead (step 3 + k, in flight then), not its refill rounds.
    assert sorted(after_drop["prefetched"]) == list(range(3, min(3 + k, STEPS - 1) + 1))
    assert after_drop["step_generation_rounds"][3] == after_step_2["step_generation_rounds"][3]

    for state in (after_step_2, after_drop):
        resumed = datamodule(parts, k, StandInWorkers(version=3))
        resumed.load_state_dict(state)
        again = drive(resumed, 3, STEPS)
        assert [trained(b) for b in again] == [trained(b) for b in full[3:]]
        assert [b.policy_versions for b in again] == [b.policy_versions for b in full[3:]]
        assert all(v >= 3 for _, v in resumed.engine.requests)  # nothing is generated again by an older version


def test_on_shortfall_stop_raises_the_one_line_error_and_keeps_the_step_to_retry(parts):
    """1 round at most, fewer than 8 differing groups in it: the one-line error of colocated runs; the state a
    checkpoint then keeps has the step's rounds (requested ahead, kept) for a resume to retry it."""
    dm = datamodule(parts, 1, StandInWorkers(), max_generation_rounds=1, on_shortfall="stop")
    with pytest.raises(DynamicSamplingShortfallError) as info:
        dm.produce_rollout(0)
    message = str(info.value)
    assert (
        "\n" not in message and message.startswith("rollout step 1: ") and "on_shortfall=fill, then resume" in message
    )
    state = dm.state_dict()
    assert state["next_rollout_step"] == 0 and sorted(state["prefetched"]) == [0, 1]
    assert state["step_generation_rounds"] == {0: [0], 1: [1]}
    assert isinstance(dm.source, AheadOfTimeSource)


# ---------------------------------------------------------------- real rollout workers (vLLM in their own process)


def real_run(
    tiny_model_dir, files, tmp_path, rollout, engine=None, steps=4, checkpoints=None, crash_after=None, resume_from=None
):
    """`steps` rollout steps of dynamic sampling on the tiny model through the trainer (Lightning's loop), colocated on
    `engine` or with a rollout worker; every batch recorded. `checkpoints`: a directory to checkpoint into after every
    step; `crash_after`: end abruptly after that rollout step (tests.helpers.resume.Crash); `resume_from`: a
    checkpoint."""
    from lit_ppo.checkpoints import RolloutCheckpoint
    from tests.helpers import build_run
    from tests.helpers.asynchronous import RecordingDataModule, fit_then_close
    from tests.helpers.resume import CrashAfter

    callbacks = [RolloutCheckpoint(checkpoints, every=1, keep=10)] if checkpoints else []
    callbacks += [CrashAfter(crash_after)] if crash_after else []
    datamodule_class = RecordingDataModule.fresh()
    trainer, module, datamodule, plan = build_run(
        tiny_model_dir,
        engine,
        files,
        tmp_path,
        total_rollout_steps=steps,
        rollout=rollout,
        callbacks=callbacks,
        datamodule_class=datamodule_class,
        reward_fn=even_answers_are_uniform,
        advantage_estimator="grpo",
        kl_coef=0.0,
        kl_mode="loss",
        rollout_batch_size=ROLLOUT_BATCH,
        # every group expected to differ: 1 round requested ahead, the rest refilled after the step's rewards
        dynamic_sampling=DynamicSamplingConfig(
            enabled=True, max_generation_rounds=3, expected_informative_fraction=1.0
        ),
    )
    # the engine is closed when the run started it (workers); a test's own engine stays open for the next run
    fit_then_close(trainer, module, datamodule, resume_from=resume_from, close=engine is None)
    return module, datamodule_class.batches, plan


@pytest.fixture(scope="module")
def one_step_off(tiny_model_dir, arithmetic_files, tmp_path_factory):
    """5 rollout steps of dynamic sampling at k = 1 with a rollout worker, checkpointed after each."""
    from tests.helpers.asynchronous import disaggregated

    out = tmp_path_factory.mktemp("dynamic_k1")
    return real_run(tiny_model_dir, arithmetic_files, out, disaggregated(1), steps=5, checkpoints=out / "checkpoints")


@pytest.mark.slow
def test_real_workers_at_k0_train_the_colocated_samples_and_weights(tiny_model_dir, arithmetic_files, tmp_path, engine):
    """The key test of issue 36 item 2 with vLLM: `ppo=dapo`-style dynamic sampling with a rollout worker at k = 0
    equals the colocated run step for step (samples, rewards, rounds, dropped and filled groups) and ends with bitwise
    the same weights."""
    from tests.helpers.asynchronous import disaggregated
    from tests.helpers.resume import assert_same_weights

    colocated_rollout = RolloutConfig(max_response_tokens=6, temperature=0.8, eval_samples_per_prompt=2)
    colocated, theirs, _ = real_run(tiny_model_dir, arithmetic_files, tmp_path / "colocated", colocated_rollout, engine)
    module, ours, _ = real_run(tiny_model_dir, arithmetic_files, tmp_path / "k0", disaggregated(0))
    assert [trained(b) for b in ours] == [trained(b) for b in theirs]
    assert max(b.generation_rounds for b in ours) > 1  # refill rounds were requested
    assert [set(b.policy_versions) for b in ours] == [{s} for s in range(4)]
    assert_same_weights(module.actor.state_dict(), colocated.actor.state_dict())


@pytest.mark.slow  # a rollout worker's start and 5 checkpointed steps: 20-55 s on 2 shared cores
def test_real_workers_at_k1_train_full_batches_of_the_plans_versions(one_step_off):
    """k = 1 with a rollout worker: every trained batch has the plan's size; rounds requested ahead are of version
    max(0, s - 1), refill rounds of version s (the trainer's check passed on every step)."""
    module, batches, plan = one_step_off
    assert plan.dynamic_sampling.rounds_requested_ahead == 1
    for step, batch in enumerate(batches):
        assert len(batch.response_ids) == ROLLOUT_BATCH * N
        assert batch.policy_versions == [plan.generating_version(step, r) for r in batch.rounds_in_step]
    assert any(set(b.policy_versions) == {b.rollout_step - 1, b.rollout_step} for b in batches[1:])
    assert module.actor_optimizer_steps == len(batches) * plan.counts.optimizer_steps_per_rollout_step
    # counted per step: the rounds generated after the rewards (beyond the 1 requested ahead)
    refills = [row["rollout/refill_rounds"] for row in module.history]
    assert refills == [b.generation_rounds - 1 for b in batches] and max(refills) > 0
    assert all(row["rollout/returned_rounds"] == 0 for row in module.history)


@pytest.mark.slow
def test_real_workers_at_k1_resume_from_a_checkpoint_exactly(one_step_off, tiny_model_dir, arithmetic_files, tmp_path):
    """A k = 1 run that crashes after rollout step 4, resumed from its checkpoint after step 3 (which keeps step 3's
    rounds requested ahead, generated by version 2, and the prompt stream): the same batches and bitwise the same
    final weights as the uninterrupted run."""
    from lit_ppo.checkpoints import checkpoint_path
    from tests.helpers.asynchronous import disaggregated
    from tests.helpers.resume import Crash, assert_same_weights

    full, full_batches, _ = one_step_off
    checkpoints = tmp_path / "checkpoints"
    with pytest.raises(Crash):
        real_run(
            tiny_model_dir,
            arithmetic_files,
            tmp_path,
            disaggregated(1),
            steps=5,
            checkpoints=checkpoints,
            crash_after=4,
        )
    resumed, batches, _ = real_run(
        tiny_model_dir,
        arithmetic_files,
        tmp_path,
        disaggregated(1),
        steps=5,
        checkpoints=checkpoints,
        resume_from=str(checkpoint_path(checkpoints, 3)),
    )
    assert [b.rollout_step for b in batches] == [3, 4]
    assert [trained(b) for b in batches] == [trained(b) for b in full_batches[3:]]
    assert [b.policy_versions for b in batches] == [b.policy_versions for b in full_batches[3:]]
    assert_same_weights(resumed.actor.state_dict(), full.actor.state_dict())


def test_a_checkpoint_of_fewer_rounds_ahead_than_the_plan_completes_its_kept_steps_with_refill_rounds(parts):
    """A checkpoint whose steps were requested with fewer rounds ahead than the resumed run's plan (the settings
    changed on resume: ppo.dynamic_sampling.max_generation_rounds raised, as a shortfall's error advises, can raise
    the rounds requested ahead): the kept step's further rounds are refill rounds, requested from version s when
    needed, and the batch says so (`rounds_ahead`), so the version checks hold and its refill rounds are counted (issue 55
    item 8); later steps follow the new plan."""
    from lit_ppo.plan import check_policy_versions
    from lit_ppo.training.metrics import refill_and_returned_rounds

    dm = datamodule(parts, 1, StandInWorkers(), expected_informative_fraction=1.0)  # 1 round ahead
    drive(dm, 0, 2)
    state = dm.state_dict()
    resumed = datamodule(parts, 1, StandInWorkers(version=2))  # half expected to differ: 2 rounds ahead
    assert resumed.plan.dynamic_sampling.rounds_requested_ahead == 2
    resumed.load_state_dict(state)
    kept = resumed.produce_rollout(2)  # step 2 was kept with 1 round (version 1); its round 2 is a refill (version 2)
    assert kept.rounds_ahead == 1 and kept.generation_rounds >= 2
    assert {(r, v) for r, v in zip(kept.rounds_in_step, kept.policy_versions)} <= {(0, 1), (1, 2), (2, 2)}
    assert 1 in kept.rounds_in_step
    check_policy_versions(resumed.plan, 2, kept.policy_versions, kept.rounds_in_step, kept.rounds_ahead)
    with pytest.raises(Exception, match="the rollout schedule is not what the plan states"):  # the plan's own count
        check_policy_versions(resumed.plan, 2, kept.policy_versions, kept.rounds_in_step)
    # Its logged rounds (and summary.json's sums of them) count those refill rounds, not against the plan's 2.
    assert refill_and_returned_rounds(kept, resumed.plan) == {
        "rollout/refill_rounds": kept.generation_rounds - 1,
        "rollout/returned_rounds": 0,
    }
    resumed.engine.version = 3
    later = resumed.produce_rollout(3)  # step 3: requested after the resume with the new plan's 2 rounds
    assert later.rounds_ahead == 2
    check_policy_versions(resumed.plan, 3, later.policy_versions, later.rounds_in_step, later.rounds_ahead)


def test_a_refill_requested_while_the_workers_hold_another_version_stops(parts):
    """Refill rounds are requested from version s: workers that hold another one then (here a version pushed too
    early, 7, while step 0's refill is due for version 0) stop the run naming the step, the round and both versions."""

    class PushedTooEarly(StandInWorkers):
        def collect(self, ticket):
            got = super().collect(ticket)
            self.version = 7
            return got

    dm = datamodule(parts, 1, PushedTooEarly(), expected_informative_fraction=1.0)  # 1 round ahead, then refill
    with pytest.raises(
        RuntimeError,
        match=r"^rollout step 0 \(generation round 2\) is due for policy version 0 but the workers hold version 7$",
    ):
        dm.produce_rollout(0)
