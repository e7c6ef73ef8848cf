"""Tool episodes with partial rollouts (lit_ppo/rollout/partial_episodes.py): a cut inside a turn or between turns,
observations never cut, each token's version, failures as without partial rollouts, a resume replaying the
environments."""

from __future__ import annotations

import dataclasses
import io
import random
import re

import pytest
import torch
from transformers import AutoTokenizer

from lit_ppo.config.partial import PartialConfig
from lit_ppo.contract import GenerateRequest, Generation
from lit_ppo.errors import ConfigError, EnvironmentFailure
from lit_ppo.plan import check_carried_tokens
from lit_ppo.rewards.scorer import RewardScorer
from lit_ppo.rollout.datamodule import RolloutDataModule
from lit_ppo.rollout.partial import continuation_seed
from lit_ppo.rollout.prompts import Prompt, PromptSet
from tests.helpers import integer_match, plan_of, run_config
from tests.helpers.episodes import DigitCallCalculator
from tests.helpers.partial import PPO, episode_rollout
from tests.helpers.prompts import long_prompts


class SecondStepFails(DigitCallCalculator):
    """DigitCallCalculator whose second step raises: an episode fails once its second turn has ended."""

    def step(self, action):
        if self.turn == 1:
            raise RuntimeError("the sandbox is down")
        return super().step(action)


class CountedCalculator(DigitCallCalculator):
    """DigitCallCalculator whose observations count every step of every instance: a replay answers otherwise."""

    steps = 0

    def step(self, action):
        CountedCalculator.steps += 1
        observation, reward, done, info = super().step(action)
        return (f"={CountedCalculator.steps};" if observation else observation), reward, done, info


class FailsOnReplay(DigitCallCalculator):
    """DigitCallCalculator whose next `left` steps (of any instance) hang for 5 s (`failing = "hang"`) or raise
    (`"raise"`): a tool down while a resumed run replays its carried episodes (each replay's first step fails)."""

    failing, left = None, 0

    def step(self, action):
        if FailsOnReplay.left > 0:
            FailsOnReplay.left -= 1
            if FailsOnReplay.failing == "raise":
                raise ConnectionError("the sandbox is down")
            import time

            time.sleep(5.0)
        return super().step(action)


def environment(name: str) -> dict:
    return {"_target_": f"tests.rollout.test_partial_episodes.{name}", "call_end": ";"}


def datamodule(prompts, rollout, tokenizer, model_dir, engine, on_error="raise", steps=6) -> RolloutDataModule:
    return RolloutDataModule(
        plan=plan_of(len(prompts), ppo=PPO, rollout=rollout, steps=steps),
        train_prompts=prompts,
        eval_prompts=None,
        rollout=rollout,
        scorer=RewardScorer(fn=integer_match, on_error=on_error),
        tokenizer=tokenizer,
        model_dir=model_dir,
        seed=0,
        engine=engine,
    )


def prompt_set(tokenizer, count=16, low=80, high=90) -> PromptSet:
    ids = long_prompts(tokenizer, count, low, high, seed=5)
    return PromptSet([Prompt(p, tokenizer.decode(p), "0", {}) for p in ids], "test")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


class TurnEngine:
    """Turns of 1..8 tokens drawn from (seed, context length), the last one the stop `;`: a deterministic stand-in
    for an engine, cut at each call's limit (truncated). Log-probs tell tokens apart."""

    adapter_version = 0

    def __init__(self, tokenizer):
        self.stop = tokenizer.convert_tokens_to_ids(";")
        self.letters = tokenizer.convert_tokens_to_ids(list("abcdef"))
        self.calls = 0

    def generate(self, request: GenerateRequest) -> list[Generation]:
        out = []
        for i, (ids, limit, seed) in enumerate(zip(request.prompt_token_ids, request.limits, request.seeds)):
            rng = random.Random(f"{seed}/{len(ids)}")
            tokens = [rng.choice(self.letters) for _ in range(rng.randint(0, 7))] + [self.stop]
            logprobs = [-rng.random() for _ in tokens]
            out.append(Generation(i, tokens[:limit], len(tokens) > limit, "", logprobs[:limit]))
        self.calls += 1
        return out

    def wake_up(self):
        pass


# ------------------------------------------------------------ settings


def test_tool_episodes_compose_colocated_and_are_refused_with_rollout_workers_in_one_line():
    run_config(ppo=PPO, rollout=episode_rollout())  # no refusal
    with pytest.raises(ConfigError) as error:
        run_config(ppo=PPO, rollout=dataclasses.replace(episode_rollout(), mode="disaggregated"))
    assert "rollout.episodes.environment with rollout workers" in str(error.value)
    assert "\n" not in str(error.value).strip()
    # The budget the chunks must reach is the episode's (turns and observations), not a turn's.
    with pytest.raises(ConfigError, match=r"step_tokens=4 x \(max_age_steps=4 \+ 1\) < rollout.episodes.max_tokens=24"):
        run_config(ppo=PPO, rollout=episode_rollout(max_age_steps=4))
    assert plan_of(16, ppo=PPO, rollout=episode_rollout()).partial.longest_response_tokens == 24


# ------------------------------------------------------------ by hand, on the real engine


def by_hand(engine, tokenizer, prompt: Prompt, seed: int, chunks: int, stops: list[int]) -> dict:
    """The episode of `seed` generated call by call, each call within its turn's (6), its episode's (24) and its
    chunk's (3 policy tokens) budget, `chunks` chunks: its tokens, mask, log-probs, spans (chunk c: version c) and
    reward; cut after the last chunk when it has not ended (an observation after its last turn left out)."""
    env = DigitCallCalculator(call_end=";")
    env.reset({"prompt": prompt.text, "reference": prompt.reference})
    tokens, mask, logprobs, spans, turn, calls, reward, ended = [], [], [], [], [], 0, 0.0, False
    cuts = {"inside a turn": 0, "between turns": 0}
    for chunk in range(chunks):
        left, start = 3, len(tokens)
        while left > 0 and not ended:
            room = min(6 - len(turn), 24 - len(tokens))
            call = GenerateRequest(
                [list(prompt.prompt_ids) + tokens],
                n=1,
                temperature=0.7,
                top_p=1.0,
                max_tokens=min(room, left),
                seeds=[seed if calls == 0 else continuation_seed(seed, calls)],
                stop_token_ids=stops,
            )
            out = engine.generate(call)[0]
            calls, left = calls + 1, left - len(out.token_ids)
            tokens, mask, logprobs = tokens + out.token_ids, mask + [1] * len(out.token_ids), logprobs + out.logprobs
            turn += out.token_ids
            if out.truncated and left == 0 and room > len(out.token_ids):
                cuts["inside a turn"] += chunk + 1 < chunks
                break  # the cut, inside the turn
            observation, r, done, _ = env.step(tokenizer.decode(turn, skip_special_tokens=True))
            reward, turn = reward + r, []
            ids = tokenizer(observation, add_special_tokens=False).input_ids if observation else []
            if done or env.turn == 3 or len(tokens) + len(ids) >= 24:
                ended = True
            else:
                tokens, mask, logprobs = tokens + ids, mask + [0] * len(ids), logprobs + [0.0] * len(ids)
                cuts["between turns"] += left == 0 and chunk + 1 < chunks
        spans.append([start, chunk])
    if not ended and mask[-1] == 0:  # cut between turns: the observation the policy never read left out
        end = max(i for i, m in enumerate(mask) if m) + 1
        tokens, mask, logprobs = tokens[:end], mask[:end], logprobs[:end]
    return {"tokens": tokens, "mask": mask, "logprobs": logprobs, "spans": spans, "reward": reward, "cuts": cuts}


def test_a_carried_episode_equals_generating_it_by_hand_call_by_call(engine, tokenizer, tiny_model_dir):
    """Prompts of 80-90 tokens at temperature 0.7 on vLLM: the episodes a step trains, carried over up to 6 steps, have
    the tokens, policy masks, log-probs (atol 1e-5), version spans and rewards of the episodes played by hand, call by
    call, with the same seeds; every observation in them whole (`=<n>;`); the carry bound holds."""
    prompts = prompt_set(tokenizer)
    # Cut every 3 policy tokens: turns that run to their 6 tokens end on a cut (between turns), others inside one.
    dm = datamodule(prompts, episode_rollout(step_tokens=3, max_age_steps=7), tokenizer, tiny_model_dir, engine)
    seeds = {}  # (dataset index, sample j) -> the episode's seed, as its group was first carried
    cuts = {"inside a turn": 0, "between turns": 0}
    checked = 0
    for step in range(4):
        batch = dm.produce_rollout(step)
        check_carried_tokens(dm.plan, step, batch.version_spans, [len(r) for r in batch.response_ids])
        for i, (response, mask) in enumerate(zip(batch.response_ids, batch.policy_masks)):
            assert len(mask) == len(response) and mask[0] == 1 or not response  # no reset observation here
            for run in re.finditer("0+", "".join(map(str, mask))):  # each observation whole
                assert re.fullmatch(r"=\d+;", tokenizer.decode(response[run.start() : run.end()]))
            index, j = batch.dataset_indices[i], i % PPO.n_samples_per_prompt
            if (index, j) not in seeds or len(batch.version_spans[i]) < 2 or checked >= 6:
                continue
            first = batch.version_spans[i][0][1]
            spans = [[s, v - first] for s, v in batch.version_spans[i]]
            stops = dm.episode_settings.stop_token_ids
            hand = by_hand(engine, tokenizer, prompts.prompts[index], seeds[index, j], len(spans), stops)
            assert response == hand["tokens"] and batch.policy_masks[i] == hand["mask"]
            torch.testing.assert_close(
                torch.tensor(batch.rollout_logprobs[i]), torch.tensor(hand["logprobs"]), atol=1e-5, rtol=0
            )
            assert spans == hand["spans"] and float(batch.rewards[i]) == hand["reward"]
            cuts = {k: cuts[k] + hand["cuts"][k] for k in cuts}
            checked += 1
        seeds.update({(g.dataset_index, j): s.seed for g in dm.partial.groups for j, s in enumerate(g.samples)})
    assert checked >= 4 and cuts["inside a turn"] > 0 and cuts["between turns"] > 0, (checked, cuts)


# ------------------------------------------------------------ failures and resumes (a stand-in engine)


def test_a_failing_environment_in_a_carried_episode_scores_0_or_stops_the_run_as_without_partial_rollouts(
    tokenizer, tiny_model_dir
):
    prompts = prompt_set(tokenizer)
    rollout = episode_rollout(environment("SecondStepFails"), at_max_age="drop")  # no episode trains cut
    dm = datamodule(prompts, rollout, tokenizer, tiny_model_dir, TurnEngine(tokenizer), on_error="zero")
    failed = 0
    for step in range(4):
        batch = dm.produce_rollout(step)
        for i, mask in enumerate(batch.policy_masks):
            turns = len(re.findall("1+", "".join(map(str, mask))))
            if turns == 2:  # its second turn ended: the environment failed there
                assert float(batch.rewards[i]) == 0.0 and mask[-1] == 1  # no observation after the failed step
                failed += 1
        assert batch.episode_stats["environment_errors"] == sum(
            len(re.findall("1+", "".join(map(str, m)))) == 2 for m in batch.policy_masks
        )
    assert failed > 0
    # Without partial rollouts the same environment scores the same way: 0, counted.
    whole = dataclasses.replace(rollout, partial=PartialConfig())
    plain = datamodule(prompts, whole, tokenizer, tiny_model_dir, TurnEngine(tokenizer), on_error="zero")
    batch = plain.produce_rollout(0)
    assert batch.episode_stats["environment_errors"] > 0
    # reward.on_error=raise: the run stops in one line naming the environment, as without partial rollouts.
    for module_rollout in (rollout, whole):
        strict = datamodule(prompts, module_rollout, tokenizer, tiny_model_dir, TurnEngine(tokenizer))
        with pytest.raises(EnvironmentFailure, match=r"SecondStepFails.step failed in episode \d+ \(turn 2"):
            for step in range(4):
                strict.produce_rollout(step)


def test_carried_episodes_resume_from_a_checkpoint_their_environments_replayed(tokenizer, tiny_model_dir):
    prompts = prompt_set(tokenizer)
    dm = datamodule(prompts, episode_rollout(), tokenizer, tiny_model_dir, TurnEngine(tokenizer))
    dm.produce_rollout(0)
    carried = [s for g in dm.partial.groups for s in g.samples if not s.finished and s.episode.turns]
    assert carried  # episodes carried with a turn the environment has read
    buffer = io.BytesIO()
    torch.save(dm.state_dict(), buffer)
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    resumed = datamodule(prompts, episode_rollout(), tokenizer, tiny_model_dir, TurnEngine(tokenizer))
    resumed.load_state_dict(state)
    assert resumed.partial.groups == dm.partial.groups and not resumed.partial.episodes.environments
    for step in (1, 2):
        a, b = dm.produce_rollout(step), resumed.produce_rollout(step)
        assert (a.response_ids, a.policy_masks, a.rollout_logprobs, a.version_spans) == (
            b.response_ids,
            b.policy_masks,
            b.rollout_logprobs,
            b.version_spans,
        )
        assert torch.equal(a.rewards, b.rewards)
    # An environment whose answers a replay does not reproduce stops the resumed run in one line.
    counted = episode_rollout(environment("CountedCalculator"))
    dm = datamodule(prompts, counted, tokenizer, tiny_model_dir, TurnEngine(tokenizer))
    dm.produce_rollout(0)
    state = dm.state_dict()
    resumed = datamodule(prompts, counted, tokenizer, tiny_model_dir, TurnEngine(tokenizer))
    resumed.load_state_dict(state)
    with pytest.raises(EnvironmentFailure, match="answered otherwise than it did.*fix: make the environment"):
        resumed.produce_rollout(1)


def test_a_checkpoint_of_single_turn_samples_in_flight_does_not_resume_as_tool_episodes(tokenizer, tiny_model_dir):
    """Carried single-turn samples resumed with rollout.episodes.environment set are refused in one line (they hold
    no episode state to continue), as carried episodes resumed without it are."""
    from lit_ppo.errors import ConfigError

    prompts = prompt_set(tokenizer)
    dm = datamodule(prompts, episode_rollout(), tokenizer, tiny_model_dir, TurnEngine(tokenizer))
    dm.produce_rollout(0)
    state = dm.state_dict()
    groups = state["partial_groups"]
    assert any(not s["finished"] for g in groups for s in g["samples"])
    for group in groups:  # the same groups as a single-turn run carries them: no episode state
        for sample in group["samples"]:
            sample["episode"] = None
    resumed = datamodule(prompts, episode_rollout(), tokenizer, tiny_model_dir, TurnEngine(tokenizer))
    with pytest.raises(ConfigError, match="single-turn samples, but rollout.episodes.environment is set; fix"):
        resumed.load_state_dict(state)


def test_token_ages_count_an_episode_s_policy_tokens_only():
    """rollout/token_age_*: an episode's observation tokens (policy mask 0) carry the span of the chunk that appended
    them but no policy sampled them and no loss reads them: left out. At rollout step 3, a turn of versions 1 (2
    tokens) and 2 (1 token), an observation of 2 tokens appended by chunk 2, a turn of 1 token of version 2."""
    from lit_ppo.rollout.partial import CarriedGroup, CarriedSample, token_ages
    from lit_ppo.rollout.partial_episodes import EpisodeState

    state = EpisodeState((1, 1, 1, 0, 0, 1), ((0, 3), (5, 6)), None)
    episode = CarriedSample(0, (5,) * 6, (-0.5,) * 6, ((0, 1), (2, 2)), "", 2, True, False, episode=state)
    single = CarriedSample(0, (5,) * 3, (-0.5,) * 3, ((0, 1), (1, 3)), "", 2, True, False)  # a single-turn sample
    groups = [CarriedGroup(0, Prompt([40], "p", "0", {}), 1, 0, (episode, single))]
    assert token_ages(groups, 3) == [2, 2, 1, 1] + [2, 0, 0]  # not [2, 2, 1, 1, 1, 1]: the observation left out


@pytest.mark.parametrize("failing, on_error", [("hang", "raise"), ("hang", "zero"), ("raise", "zero")])
def test_a_replay_whose_tool_hangs_or_fails_behaves_as_a_live_call(
    tokenizer, tiny_model_dir, monkeypatch, failing, on_error
):
    """A resumed run replays its carried episodes' environments: each call under rollout.episodes.environment_timeout_s
    (0.5 s here), as a live call. A tool that hangs stops the run in one line naming the environment and the setting
    (reward.on_error=raise), or ends the episode scored 0 and counted (zero), as a tool that raises does."""
    prompts = prompt_set(tokenizer)
    rollout = episode_rollout(environment("FailsOnReplay"), environment_timeout_s=0.5)
    dm = datamodule(prompts, rollout, tokenizer, tiny_model_dir, TurnEngine(tokenizer), on_error=on_error)
    dm.produce_rollout(0)
    carried = sum(not s.finished and bool(s.episode.turns) for g in dm.partial.groups for s in g.samples)
    assert carried  # episodes carried with a turn their environment has read: the resume replays it
    monkeypatch.setattr(FailsOnReplay, "failing", failing)
    monkeypatch.setattr(FailsOnReplay, "left", carried)  # each replay's first step; the live calls after them answer
    resumed = datamodule(prompts, rollout, tokenizer, tiny_model_dir, TurnEngine(tokenizer), on_error=on_error)
    resumed.load_state_dict(dm.state_dict())
    if on_error == "raise":
        with pytest.raises(EnvironmentFailure) as error:
            resumed.produce_rollout(1)
        message = str(error.value)
        assert "FailsOnReplay.step (turn 1 replayed after a resume or a dropped step) timed out" in message
        assert "rollout.episodes.environment_timeout_s=0.5s" in message and "\n" not in message
        return
    kind = "environment_timeouts" if failing == "hang" else "environment_errors"
    failed = 0
    for step in (1, 2, 3):
        batch = resumed.produce_rollout(step)
        failed += batch.episode_stats[kind]
        assert batch.episode_stats["environment_errors" if failing == "hang" else "environment_timeouts"] == 0
    assert FailsOnReplay.left == 0 and 0 < failed <= carried  # the replays that failed, scored 0 when trained


class ScriptTurnEngine:
    """Every response follows the script `ab;;` (one token per character, from its context's length), as vLLM ends a
    call: at its token limit (truncated) or at a rollout.stop string in the call's own text (the token that completes
    it kept), never across the prompt, so not across a cut."""

    adapter_version = 0

    def __init__(self, tokenizer):
        self.tokenizer, self.script = tokenizer, tokenizer.convert_tokens_to_ids(list("ab;;"))

    def generate(self, request: GenerateRequest) -> list[Generation]:
        out = []
        for i, (ids, limit, seed) in enumerate(zip(request.prompt_token_ids, request.limits, request.seeds)):
            tokens = [self.script[(len(ids) + k) % 4] for k in range(limit)]
            ends = [k for k in range(1, limit + 1) if any(s in self.tokenizer.decode(tokens[:k]) for s in request.stop)]
            tokens = tokens[: ends[0]] if ends else tokens
            logprobs = [-((seed + k) % 97 + 1) / 100 for k in range(len(tokens))]
            out.append(Generation(i, tokens, not ends, "", logprobs))
        return out

    def wake_up(self):
        pass


def test_a_stop_string_that_a_cut_splits_inside_a_turn_ends_the_turn_there(tokenizer, tiny_model_dir):
    """rollout.stop=[";;"] with tool episodes cut every 4 policy tokens (turns end at `#` tokens, the calculator's
    call end, never generated; observations `=<n>;`): every turn ends at its first ";;", also when the cut falls
    between its two ";" (matched across the cut), and a turn that starts with ";" after an observation ending in ";"
    does not end there (matched within the turn only, not across the observation)."""
    prompts = prompt_set(tokenizer)
    calculator = {"_target_": "tests.helpers.episodes.DigitCallCalculator", "call_end": "#"}
    rollout = dataclasses.replace(episode_rollout(calculator, at_max_age="drop"), stop=[";;"])
    dm = datamodule(prompts, rollout, tokenizer, tiny_model_dir, ScriptTurnEngine(tokenizer))
    split, after_observation, turns, semicolon = 0, 0, 0, tokenizer.convert_tokens_to_ids(";")
    for step in range(4):
        batch = dm.produce_rollout(step)
        for response, mask, spans in zip(batch.response_ids, batch.policy_masks, batch.version_spans):
            runs = list(re.finditer("1+", "".join(map(str, mask))))
            for n, run in enumerate(runs):
                text = tokenizer.decode(response[run.start() : run.end()])
                if n + 1 < len(runs) or text.endswith(";;"):  # a turn the episode's budget ended is the last
                    assert text.find(";;") == len(text) - 2, (text, tokenizer.decode(response))
                    turns += 1
                after_observation += run.start() > 0 and text.startswith(";")
            for start, _ in spans[1:]:  # a cut inside a turn, between the two ";" of its stop string
                split += mask[start - 1] == mask[start] == 1 and response[start - 1] == response[start] == semicolon
    assert turns > 20 and split > 0 and after_observation > 0, (turns, split, after_observation)
