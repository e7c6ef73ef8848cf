"""Multi-turn episodes with an environment: the calculator, the token-exact episode loop, truncation,
environment failures, and the loss on policy tokens only.

The episode loop is driven here by a scripted engine (the turns' token ids are fixed, so every expected id is
written out); tests/rollout/test_tool_training.py runs it with the real vLLM engine and trainer."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from lit_ppo.environments import (
    CalculatorEnvironment,
    CalculatorError,
    TokenIds,
    build_environment_factory,
    safe_arithmetic,
    stop_token_ids_of,
)
from lit_ppo.errors import ConfigError, EnvironmentFailure, RolloutMismatchError
from lit_ppo.rollout.engine import Generation
from lit_ppo.rollout.episodes import EpisodeLoop, EpisodeSettings, episode_stats
from lit_ppo.rollout.observations import ObservationEncoder
from lit_ppo.rollout.prompts import Prompt
from lit_ppo.testing import rollout_batch_from_ids
from lit_ppo.training.batching import check_rollout_ids, pack
from lit_ppo.training.metrics import episode_metrics
from tests.helpers import ROOT, datamodule_on

# ------------------------------------------------------------------ the calculator


def test_safe_arithmetic_computes_and_refuses_code():
    assert safe_arithmetic("123*456") == 56088
    assert safe_arithmetic(" -(3 + 4) * 2 ") == -14
    assert safe_arithmetic("7/2") == 3.5 and safe_arithmetic("8/2") == 4 and isinstance(safe_arithmetic("8/2"), int)
    assert safe_arithmetic("2**10 % 1000") == 24
    for text in [
        '__import__("os").system("true")',
        "x+1",
        "(1).real",
        "[1]",
        "lambda: 1",
        "1 if 1 else 2",
        "1/0",
        "9**9**9",
        "10**400",
        "1" * 300,
        "1e308*10",
        "",
    ]:
        with pytest.raises(CalculatorError):
            safe_arithmetic(text)


def test_calculator_environment_calls_and_answers():
    env = CalculatorEnvironment(
        call_start="[", call_end="]", result_format="={}\n", error_format="=error\n", max_calls=2
    )
    assert env.reset({"prompt": "12*45=", "reference": "540"}) is None
    assert env.step("[12*45]") == ("=540\n", 0.0, False, {"tool_call": True})
    assert env.step("[12*x]") == ("=error\n", 0.0, False, {"tool_call": True})  # a bad call is an observation
    assert env.step("[1+1]") == ("=error\n", 0.0, False, {"tool_call": True})  # over max_calls
    assert env.step("it is 540") == (None, 1.0, True, {"tool_call": False, "correct": 1.0})
    env.reset({"reference": "540"})
    assert env.step("541")[1:3] == (0.0, True)


def test_environment_factory_from_config():
    assert build_environment_factory(None) is None
    make = build_environment_factory({"_target_": "lit_ppo.environments.CalculatorEnvironment", "call_end": "]"})
    first, second = make(), make()
    assert first is not second and first.call_end == "]"  # one environment per episode
    with pytest.raises(ConfigError, match="rollout.episodes.environment: cannot build"):
        build_environment_factory({"_target_": "lit_ppo.environments.NoSuchThing"})
    with pytest.raises(ConfigError, match="lacks reset"):
        build_environment_factory({"_target_": "builtins.dict"})


# ------------------------------------------------------------------ a tokenizer where decode -> encode is not the identity


def merging_tokenizer() -> PreTrainedTokenizerFast:
    """The character tokenizer plus BPE merges "12", "45", "54": the turn ids [1][2] decode to "12", which
    encodes to the single token "12". A pipeline that re-encodes decoded turns changes the ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from lit_ppo.demo.tiny import (
        CHARS,
        EOS_TOKEN,
        PAD_TOKEN,
        SPECIAL_TOKENS,
        _byte_level_symbol,
    )

    merges = [("1", "2"), ("4", "5"), ("5", "4")]
    tokens = SPECIAL_TOKENS + [_byte_level_symbol(c) for c in CHARS] + [a + b for a, b in merges]
    core = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, unk_token=None, fuse_unk=False)
    )
    core.add_special_tokens(SPECIAL_TOKENS)
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)


class ScriptedEngine:
    """Stands in for VLLMEngine: turn t of every episode is `turns[t]` (cut to the turn's token budget); records
    what it was given."""

    adapter_version = 0  # the contract's (lit_ppo/contract.py): no LoRA adapter

    def __init__(self, turns: list[list[int]], cycle: bool = False):
        self.turns, self.calls, self.cycle = turns, [], cycle  # cycle: turn t of call t % len(turns) (several rounds)

    def wake_up(self) -> None:
        pass

    def generate(self, request):
        contexts, max_tokens, seeds = request.prompt_token_ids, request.max_tokens, request.seeds
        assert request.n == 1
        turn = len(self.calls) % len(self.turns) if self.cycle else len(self.calls)
        self.calls.append({"contexts": [list(c) for c in contexts], "max_tokens": list(max_tokens), "seeds": seeds})
        outputs = []
        for i, _ in enumerate(contexts):
            ids = self.turns[min(turn, len(self.turns) - 1)][: max_tokens[i]]
            outputs.append(
                Generation(
                    prompt_index=i,
                    token_ids=list(ids),
                    text="<not used>",
                    truncated=len(ids) < len(self.turns[min(turn, len(self.turns) - 1)]),
                    logprobs=[-0.25] * len(ids),
                )
            )
        return outputs


def chars(tokenizer, text: str) -> list[int]:
    """One token per character, as a policy may well sample them (not as the tokenizer would merge them)."""
    return [tokenizer.convert_tokens_to_ids(c) for c in text]


def settings(**overrides) -> EpisodeSettings:
    values = dict(
        max_turns=3,
        max_episode_tokens=64,
        max_turn_tokens=16,
        timeout_s=5.0,
        on_error="raise",
        stop_token_ids=[],
        stop=[],
    )
    return EpisodeSettings(**{**values, **overrides})


def run_plain(
    engine, prompts, n, environment, tok, episode_settings, *, seeds=None, where="test", sample_positions=None
):
    """An `EpisodeLoop`'s episodes at temperature 1 and top-p 1 with plain observations, as the tests here run it."""
    encoder = ObservationEncoder(tok, False)
    loop = EpisodeLoop(
        engine, environment, tok, episode_settings, encoder, temperature=1.0, top_p=1.0, seeds=seeds, where=where
    )
    return loop.run(prompts, n, sample_positions)


def calculator():
    return CalculatorEnvironment(call_start="[", call_end="]", result_format="={}\n")


def test_three_turn_episode_ids_equal_what_the_trainer_packs():
    tok = merging_tokenizer()
    prompt_ids = tok("12*45+1=", add_special_tokens=False).input_ids
    prompt = Prompt(prompt_ids=prompt_ids, text="12*45+1=", reference="541", extras={})
    turns = [chars(tok, "[12*45]"), chars(tok, "[540+1]"), chars(tok, "541") + [tok.eos_token_id]]
    engine = ScriptedEngine(turns)
    [episode] = run_plain(engine, [prompt], 1, calculator, tok, settings(), seeds=lambda turn: [1000 * turn])

    first_obs, second_obs = (
        tok("=540\n", add_special_tokens=False).input_ids,
        tok("=541\n", add_special_tokens=False).input_ids,
    )
    assert episode.turns == 3 and episode.tool_calls == 2 and episode.reward == 1.0 and not episode.truncated
    assert episode.token_ids == turns[0] + first_obs + turns[1] + second_obs + turns[2]
    assert episode.policy_mask == [1] * 7 + [0] * len(first_obs) + [1] * 7 + [0] * len(second_obs) + [1] * 4
    assert (
        episode.logprobs == [-0.25] * 7 + [0.0] * len(first_obs) + [-0.25] * 7 + [0.0] * len(second_obs) + [-0.25] * 4
    )
    assert episode.observation_tokens == len(first_obs) + len(second_obs)
    # Each turn's vLLM prompt is the last one plus the last turn plus the observation: nothing was re-encoded.
    contexts = [call["contexts"][0] for call in engine.calls]
    assert contexts == [
        prompt_ids,
        prompt_ids + turns[0] + first_obs,
        prompt_ids + turns[0] + first_obs + turns[1] + second_obs,
    ]
    assert [call["seeds"] for call in engine.calls] == [[0], [1000], [2000]]
    assert episode.episode_ids == contexts[2] + turns[2]
    # The tokenizer is one where decode -> encode changes ids, on this very episode.
    assert tok(tok.decode(episode.token_ids), add_special_tokens=False).input_ids != episode.token_ids

    mb = pack([prompt_ids], [episode.token_ids], tok.pad_token_id, "cpu", policy_masks=[episode.policy_mask])
    assert mb.input_ids[0][mb.attention_mask[0].bool()].tolist() == episode.episode_ids
    assert mb.response_mask[0].tolist() == [float(m) for m in episode.policy_mask]
    batch = rollout_batch_from_ids([prompt_ids], [episode.token_ids], 1, policy_masks=[episode.policy_mask])
    batch.episode_ids = [episode.episode_ids]
    check_rollout_ids(batch)
    # The check catches a trajectory rebuilt from text (the bug of TRL #5224 / verl #3720).
    batch.episode_ids = [prompt_ids + tok(tok.decode(episode.token_ids), add_special_tokens=False).input_ids]
    with pytest.raises(RolloutMismatchError, match="differ from the ids vLLM was given"):
        check_rollout_ids(batch)
    stats = episode_stats([episode])
    assert stats["turns"] == 3 and stats["tool_calls"] == 2 and stats["tool_call_episodes"] == 1
    assert stats["episode_tokens"] == len(episode.token_ids)


def test_observations_follow_the_chat_template(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    encoder = ObservationEncoder(tok, chat_template=True, role="tool")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    wrapped = "\n<|im_start|>tool\n=540<|im_end|>\n<|im_start|>assistant\n"
    assert encoder("=540", [5, im_end]) == tok(wrapped, add_special_tokens=False).input_ids
    # A turn that did not end its message (it stopped at the tool call's end) gets the end-of-turn token first.
    assert encoder("=540", [5]) == [im_end] + tok(wrapped, add_special_tokens=False).input_ids
    assert encoder(TokenIds([7, 8]), [5]) == [7, 8]  # marked ids are appended as they are


def test_max_turns_truncates():
    tok = merging_tokenizer()
    prompt = Prompt(prompt_ids=chars(tok, "1+1="), text="1+1=", reference="2", extras={})
    engine = ScriptedEngine([chars(tok, "[1+1]")])  # the policy calls the tool forever
    episodes = run_plain(engine, [prompt], 2, calculator, tok, settings(max_turns=2))
    for ep in episodes:
        assert ep.turns == 2 and ep.truncated and ep.reward == 0.0
        assert ep.policy_mask[-1] == 1  # an episode ends on a policy turn: no observation nobody answers
        assert ep.token_ids == chars(tok, "[1+1]") + tok("=2\n", add_special_tokens=False).input_ids + chars(
            tok, "[1+1]"
        )
    assert len(engine.calls) == 2 and len(engine.calls[0]["contexts"]) == 2


def test_token_budget_truncates():
    tok = merging_tokenizer()
    prompt = Prompt(prompt_ids=chars(tok, "1+1="), text="1+1=", reference="2", extras={})
    call = chars(tok, "[1+1]")  # 5 tokens; the observation "=2\n" is 3
    engine = ScriptedEngine([call])
    [ep] = run_plain(
        engine, [prompt], 1, calculator, tok, settings(max_turns=10, max_episode_tokens=15, max_turn_tokens=6)
    )
    # Turns of 5 + observations of 3: 5, 8, 13; the second turn may take min(6, 15 - 8) = 6 tokens; the next
    # observation (13 + 3 = 16) would not fit with a token to spare: the episode is cut after the second turn.
    assert [c["max_tokens"][0] for c in engine.calls] == [6, 6]
    assert ep.truncated and ep.turns == 2 and len(ep.token_ids) == 13  # <= 15
    # A budget that cuts a turn short: the turn gets what is left.
    engine = ScriptedEngine([call])
    [ep] = run_plain(
        engine, [prompt], 1, calculator, tok, settings(max_turns=10, max_episode_tokens=10, max_turn_tokens=6)
    )
    assert [c["max_tokens"][0] for c in engine.calls] == [6, 2]
    assert ep.truncated and len(ep.token_ids) == 10


class RaisingEnvironment(CalculatorEnvironment):
    def step(self, action):
        raise RuntimeError("the sandbox is down")


class HangingEnvironment(CalculatorEnvironment):
    def step(self, action):
        time.sleep(30)


@pytest.mark.parametrize("environment, failure", [(RaisingEnvironment, "error"), (HangingEnvironment, "timeout")])
def test_environment_failures_follow_on_error(environment, failure):
    tok = merging_tokenizer()
    prompts = [Prompt(prompt_ids=chars(tok, "1+1="), text="1+1=", reference="2", extras={})]
    engine = ScriptedEngine([chars(tok, "[1+1]")])
    kwargs = dict(where="rollout step 3", sample_positions=[12, 13])
    started = time.monotonic()
    with pytest.raises(
        EnvironmentFailure,
        match=f"rollout step 3: the environment {environment.__name__}.step "
        f"{'timed out' if failure == 'timeout' else 'failed'} in episode 12",
    ):
        run_plain(engine, prompts, 2, environment, tok, settings(timeout_s=0.3), **kwargs)
    zeroed = settings(timeout_s=0.3, on_error="zero")
    episodes = run_plain(ScriptedEngine([chars(tok, "[1+1]")]), prompts, 2, environment, tok, zeroed, **kwargs)
    assert time.monotonic() - started < 5  # the hung steps were abandoned at the timeout
    assert [ep.failure for ep in episodes] == [failure, failure] and [ep.reward for ep in episodes] == [0.0, 0.0]
    stats = episode_stats(episodes)
    assert stats[f"environment_{failure}s" if failure == "timeout" else "environment_errors"] == 2


class InterruptingEnvironment(CalculatorEnvironment):
    def step(self, action):
        raise KeyboardInterrupt


@pytest.mark.parametrize("timeout_s", [0.3, None], ids=["in-threads", "inline"])
def test_a_keyboard_interrupt_from_an_environment_stops_the_run_in_one_line_naming_it(sigint_handled, timeout_s):
    """lit-ppo handles SIGINT during a run, so an environment's KeyboardInterrupt is its code's: it went through
    Lightning's "graceful shutdown", exit 1, no line. Now an EnvironmentFailure naming it, even under on_error=zero."""
    tok = merging_tokenizer()
    prompts = [Prompt(prompt_ids=chars(tok, "1+1="), text="1+1=", reference="2", extras={})]
    with pytest.raises(EnvironmentFailure) as info:
        run_plain(
            ScriptedEngine([chars(tok, "[1+1]")]),
            prompts,
            2,
            InterruptingEnvironment,
            tok,
            settings(timeout_s=timeout_s, on_error="zero"),
            where="rollout step 3",
        )
    message = str(info.value)
    assert message.startswith(
        "rollout step 3: the environment InterruptingEnvironment.step raised KeyboardInterrupt in episode 0 (turn 1), "
        "which no Ctrl-C sent"
    ), message
    assert "\n" not in message


class ObservingEnvironment(CalculatorEnvironment):
    """Answers every tool call with the observation it was built with."""

    observation = None

    def step(self, action):
        return self.observation, 0.0, False, {"tool_call": True}


def observing(observation):
    return type("NumbersTool", (ObservingEnvironment,), {"observation": observation})


@pytest.mark.parametrize(
    "observation", [[12, 7], [56088], ["result:", "42"], 42, 4.5, TokenIds([56088]), TokenIds(["7"])]
)
def test_an_observation_is_text_marked_token_ids_or_none(observation):
    """A tool returning numbers is not token ids: a plain list, a number, or ids outside the vocabulary are
    refused in one line naming the environment and what to return, under reward.on_error like any failure."""
    tok = merging_tokenizer()
    prompts = [Prompt(prompt_ids=chars(tok, "1+1="), text="1+1=", reference="2", extras={})]
    where = "rollout step 1"
    with pytest.raises(EnvironmentFailure) as info:
        run_plain(
            ScriptedEngine([chars(tok, "[1+1]")]), prompts, 1, observing(observation), tok, settings(), where=where
        )
    message = str(info.value)
    assert "\n" not in message and "NumbersTool.step" in message
    assert "TokenIds" in message or "str" in message
    zeroed = settings(on_error="zero")
    episodes = run_plain(
        ScriptedEngine([chars(tok, "[1+1]")]), prompts, 2, observing(observation), tok, zeroed, where=where
    )
    assert [ep.failure for ep in episodes] == ["error", "error"]


def test_marked_token_ids_and_text_observations_are_appended():
    tok = merging_tokenizer()
    prompts = [Prompt(prompt_ids=chars(tok, "1+1="), text="1+1=", reference="2", extras={})]
    call = chars(tok, "[1+1]")
    for observation, ids in [(TokenIds(chars(tok, "=2")), chars(tok, "=2")), ("=2", tok("=2").input_ids)]:
        [ep] = run_plain(ScriptedEngine([call]), prompts, 1, observing(observation), tok, settings(max_turns=2))
        assert ep.failure is None and ep.token_ids == call + ids + call


def test_environment_failures_under_on_error_zero_are_counted_and_said(caplog):
    tok = merging_tokenizer()
    prompts = [Prompt(prompt_ids=chars(tok, "1+1="), text="1+1=", reference="2", extras={})]
    with caplog.at_level("WARNING", logger="lit_ppo"):
        episodes = run_plain(
            ScriptedEngine([chars(tok, "[1+1]")]),
            prompts,
            3,
            RaisingEnvironment,
            tok,
            settings(on_error="zero"),
            where="rollout step 2",
        )
    assert episode_stats(episodes)["environment_errors"] == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert "rollout step 2: 3 of 3 episodes scored 0 after environment errors" in warnings[0]
    assert "RaisingEnvironment.step: RuntimeError: the sandbox is down" in warnings[0]


def test_observations_that_do_not_fit_the_episode_budget_are_counted_and_said(caplog):
    """An environment whose observations never fit rollout.episodes.max_tokens truncated every episode (reward 0,
    eval 0.000 -> 0.000) without a line."""
    tok = merging_tokenizer()
    prompts = [Prompt(prompt_ids=chars(tok, "1+1="), text="1+1=", reference="2", extras={})]
    observation = "=" + "9" * 80 + "\n"
    observation_tokens = len(tok(observation, add_special_tokens=False).input_ids)
    with caplog.at_level("WARNING", logger="lit_ppo"):
        episodes = run_plain(
            ScriptedEngine([chars(tok, "[1+1]")]),
            prompts,
            3,
            observing(observation),
            tok,
            settings(max_episode_tokens=64),
            where="rollout step 1",
        )
    assert all(ep.truncated and ep.turns == 1 for ep in episodes)
    stats = episode_stats(episodes)
    assert stats["observations_cut"] == 3 and episode_metrics(stats)["rollout/observations_cut"] == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        "rollout step 1: 3 of 3 episodes were cut at an observation that did not fit the episode's budget "
        "(rollout.episodes.max_tokens=64: prompt excluded, turns and observations; the longest cut observation had "
        f"{observation_tokens} tokens, with 59 left); fix: raise rollout.episodes.max_tokens or shorten the "
        "environment's observations"
    ]
    # Out of turns is not that: cut silently, as a response out of tokens is (rollout/truncated counts it).
    caplog.clear()
    with caplog.at_level("WARNING", logger="lit_ppo"):
        episodes = run_plain(
            ScriptedEngine([chars(tok, "[1+1]")]),
            prompts,
            1,
            observing("=2\n"),
            tok,
            settings(max_turns=2, max_episode_tokens=64),
            where="rollout step 1",
        )
    assert episodes[0].truncated and episode_stats(episodes)["observations_cut"] == 0 and not caplog.records


def test_turn_ending_text_must_be_one_token():
    tok = merging_tokenizer()
    assert stop_token_ids_of(calculator(), tok) == [tok.convert_tokens_to_ids("]")]
    with pytest.raises(ConfigError, match="not one"):
        stop_token_ids_of(CalculatorEnvironment(call_end="</calc>"), tok)


# ------------------------------------------------------------------ observation tokens carry no loss


def test_observation_tokens_carry_no_loss_and_no_count(tiny_model_dir):
    """The actor's gradient from PPOModule.actor_backward on a packed episode equals the gradient of the loss
    written out by hand over the policy tokens (positions listed by hand), with the token-mean over those 4
    tokens; advantages put on the observation tokens change nothing."""
    from lit_ppo.config import EpisodesConfig, PPOConfig, RolloutConfig
    from lit_ppo.training.experience import Experience, loss_denominators
    from lit_ppo.training.loss import LossInputs
    from lit_ppo.training.module import PPOModule
    from tests.helpers import plan_of

    ppo = PPOConfig(
        rollout_batch_size=1,
        n_samples_per_prompt=1,
        train_batch_size=1,
        micro_train_batch_size=1,
        advantage_estimator="reinforce_pp",
        kl_coef=0.0,
    )
    plan = plan_of(
        1,
        ppo=ppo,
        rollout=RolloutConfig(
            max_response_tokens=8,
            episodes=EpisodesConfig(environment={"_target_": "x"}, max_turns=2, max_tokens=8),
        ),
    )
    module = PPOModule(model_dir=tiny_model_dir, ppo=ppo, plan=plan, pad_token_id=0)
    module.manual_backward = lambda loss: loss.backward()
    prompt, response = [20, 21, 22], [30, 31, 40, 41, 42, 32, 33]
    policy_mask = [1, 1, 0, 0, 0, 1, 1]  # turn, observation, turn
    mb = pack([prompt], [response], 0, "cpu", policy_masks=[policy_mask])

    def gradients(advantages: torch.Tensor) -> list[torch.Tensor]:
        module.actor.zero_grad(set_to_none=True)
        with torch.no_grad():
            old = module.response_logprobs(module.actor, mb)
        mask = mb.response_mask
        exp = Experience(
            mask=mask,
            old_logp=old,
            advantages=advantages,
            returns=advantages,
            rewards=torch.zeros(1),
            rc_weights=mask.clone(),
            loss_mask=mask.clone(),
        )
        module.actor_backward(mb, LossInputs.of(exp, [0], mb, loss_denominators(exp, [0]), ppo))
        return [p.grad.clone() for p in module.actor.parameters()]

    advantages = torch.tensor([[1.0, -2.0, 0.0, 0.0, 0.0, 0.5, 3.0]])
    from_module = gradients(advantages)
    leaked = advantages.clone()
    leaked[0, 2:5] = torch.tensor([100.0, -100.0, 50.0])  # on the observation tokens
    assert all(torch.equal(a, b) for a, b in zip(from_module, gradients(leaked)))

    # By hand: ratio = 1 at the old policy, so the clipped surrogate's gradient is -A_t grad log p_t; token-mean
    # over the 4 policy tokens at response columns 0, 1, 5, 6.
    module.actor.zero_grad(set_to_none=True)
    logits = module.actor(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids).logits
    logp = torch.log_softmax(logits.float(), -1)
    P = len(prompt)
    loss = sum(-advantages[0, t] * logp[0, P - 1 + t, response[t]] for t in (0, 1, 5, 6)) / 4
    loss.backward()
    by_hand = [p.grad.clone() for p in module.actor.parameters()]
    for a, b in zip(from_module, by_hand):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------ advantages over policy tokens only


def test_gae_steps_over_observation_tokens():
    """mask [1, 1, 0, 1]: an observation at column 2. Hand-computed with gamma=1, lam=0.5, values 0.1, 0.2, (9.0
    on the observation, never read), 0.4 and reward 1 on the last policy token (column 3, not column
    mask.sum() - 1 = 2):
    A3 = 1 - 0.4 = 0.6; A1 = (0.4 - 0.2) + 0.5 * 0.6 = 0.5; A0 = (0.2 - 0.1) + 0.5 * 0.5 = 0.35."""
    from lit_ppo import algorithms as algo

    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    values = torch.tensor([[0.1, 0.2, 9.0, 0.4]])
    rewards = torch.tensor([1.0])
    advantages, returns = algo.gae(rewards, mask, values=values, gamma=1.0, lam=0.5, normalize=False)
    torch.testing.assert_close(advantages, torch.tensor([[0.35, 0.5, 0.0, 0.6]]))
    torch.testing.assert_close(returns, torch.tensor([[0.45, 0.7, 0.0, 1.0]]))
    assert algo.token_level_rewards(rewards, mask).tolist() == [[0.0, 0.0, 0.0, 1.0]]
    # REINFORCE-style returns carry over the observation too (gamma 0.5: 0.25, 0.5, -, 1).
    torch.testing.assert_close(
        algo.discounted_returns(algo.token_level_rewards(rewards, mask), mask, 0.5),
        torch.tensor([[0.25, 0.5, 0.0, 1.0]]),
    )


def test_warm_start_demonstrations_use_the_environment_format():
    """The tool demonstrations are written with the environment's call format and its own observation; the
    observation is never imitated, and in the practice demonstrations neither is the decision to call."""
    import random

    from lit_ppo.demo.warmstart import tool_demonstration_sampler

    sample = tool_demonstration_sampler(
        [{"prompt": "123*456=", "answer": "56088"}],
        tool_call_rate=0.25,
        tool_use_practice=0.25,
        environment=calculator(),
    )
    rng = random.Random(0)
    kinds = {"decide": 0, "practice": 0, "guess": 0}
    for _ in range(400):
        prompt, segments = sample(rng)
        assert prompt == "123*456="
        if len(segments) == 1:
            kinds["guess"] += 1
            assert segments[0][1] and segments[0][0] != "56088" and segments[0][0].startswith("56")
            continue
        assert [text for text, _ in segments] == ["[", "123*456]", "=56088\n", "56088"]
        assert [trained for _, trained in segments][1:] == [True, False, True]
        kinds["decide" if segments[0][1] else "practice"] += 1
    assert 70 < kinds["decide"] < 130 and 70 < kinds["practice"] < 130 and 170 < kinds["guess"] < 230


def test_episode_reward_from_the_reward_function(tiny_model_dir, arithmetic_files):
    """rollout.episodes.reward=reward: the reward function scores the episode's whole response text (turns and
    observations), as TRL-style tool setups do; =environment: the sum of the environment's step rewards."""
    from transformers import AutoTokenizer

    from lit_ppo.config import EpisodesConfig, PPOConfig, RolloutConfig
    from lit_ppo.rollout.prompts import load_prompts

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    seen = []

    def transcript_length(prompts, responses, references, extras):
        seen.extend(responses)
        return [float(len(r)) for r in responses]

    prompts = load_prompts(arithmetic_files[0], tok)
    ppo = PPOConfig(rollout_batch_size=2, n_samples_per_prompt=2, train_batch_size=4, micro_train_batch_size=4)
    for source in ("reward", "environment"):
        rollout = RolloutConfig(
            max_response_tokens=8,
            episodes=EpisodesConfig(
                max_turns=2,
                reward=source,
                environment={
                    "_target_": "lit_ppo.environments.CalculatorEnvironment",
                    "call_start": "[",
                    "call_end": "]",
                    "result_format": "={}\n",
                },
            ),
        )
        engine = ScriptedEngine([chars(tok, "[2+3]"), chars(tok, "5") + [tok.eos_token_id]])
        dm = datamodule_on(prompts, rollout, tok, tiny_model_dir, engine, ppo=ppo, reward_fn=transcript_length)
        batch = dm.produce_rollout(0)
        assert batch.responses == ["[2+3]=5\n5"] * 4
        if source == "reward":
            assert seen == batch.responses and batch.rewards.tolist() == [9.0] * 4
        else:  # the calculator: 5 is wrong for every one of these prompts unless its reference is 5
            assert batch.rewards.tolist() == [float(r == "5") for r in batch.references]
        assert batch.episode_stats["tool_calls"] == 4 and batch.episode_stats["turns"] == 8


def test_dynamic_sampling_runs_on_episodes(tiny_model_dir, arithmetic_files):
    """Dynamic sampling moves episodes between rounds like responses: groups of equal rewards are dropped and,
    on a shortfall, filled back; the batch keeps the episodes' policy masks and ids."""
    from transformers import AutoTokenizer

    from lit_ppo.config import DynamicSamplingConfig, EpisodesConfig, PPOConfig, RolloutConfig
    from lit_ppo.rollout.prompts import load_prompts

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = load_prompts(arithmetic_files[0], tok)
    ppo = PPOConfig(
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        train_batch_size=4,
        micro_train_batch_size=4,
        advantage_estimator="grpo",
        kl_mode="loss",
        dynamic_sampling=DynamicSamplingConfig(enabled=True, max_generation_rounds=2),
    )
    rollout = RolloutConfig(
        max_response_tokens=8,
        episodes=EpisodesConfig(
            max_turns=2,
            environment={
                "_target_": "lit_ppo.environments.CalculatorEnvironment",
                "call_start": "[",
                "call_end": "]",
                "result_format": "={}\n",
            },
        ),
    )
    engine = ScriptedEngine([chars(tok, "[1+1]"), chars(tok, "2") + [tok.eos_token_id]], cycle=True)
    dm = datamodule_on(prompts, rollout, tok, tiny_model_dir, engine, ppo=ppo)
    batch = dm.produce_rollout(0)
    assert batch.generation_rounds == 2 and batch.filled_groups == 2 - batch.rewards.view(2, 2).std(-1).gt(0).sum()
    assert len(batch.policy_masks) == 4 and all(0 in m for m in batch.policy_masks)
    assert batch.episode_ids == [p + r for p, r in zip(batch.prompt_ids, batch.response_ids)]
    assert len(engine.calls) == 4  # 2 turns x 2 generation rounds


class LongAnswerTool(CalculatorEnvironment):
    """Answers every call with more tokens than an episode may hold."""

    def step(self, action):
        return "=" + "9" * 40 + "\n", 0.0, False, {"tool_call": True}


def test_a_rollout_steps_environment_warnings_number_it_from_1(tiny_model_dir, arithmetic_files, caplog):
    """The warnings of the first rollout step said "rollout step 0" (the steps already taken), where the progress
    bar, the waits and every other message count from 1."""
    from transformers import AutoTokenizer

    from lit_ppo.config import EpisodesConfig, PPOConfig, RolloutConfig
    from lit_ppo.rollout.prompts import load_prompts

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = load_prompts(arithmetic_files[0], tok)
    ppo = PPOConfig(rollout_batch_size=2, n_samples_per_prompt=2, train_batch_size=4, micro_train_batch_size=4)
    rollout = RolloutConfig(
        max_response_tokens=8,
        episodes=EpisodesConfig(
            max_turns=2,
            max_tokens=24,
            environment={
                "_target_": "tests.rollout.test_environments.LongAnswerTool",
                "call_start": "[",
                "call_end": "]",
            },
        ),
    )
    dm = datamodule_on(prompts, rollout, tok, tiny_model_dir, ScriptedEngine([chars(tok, "[1+1]")]), ppo=ppo)
    with caplog.at_level("WARNING", logger="lit_ppo"):
        batch = dm.produce_rollout(0)  # the first rollout step (none taken before it)
    assert batch.episode_stats["observations_cut"] == 4
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning.startswith("rollout step 1: 4 of 4 episodes were cut at an observation"), warning


class RecordedHangingEnvironment(CalculatorEnvironment):
    """A tool that hangs on every call, recording when each call began."""

    started: list[float] = []

    def step(self, action):
        RecordedHangingEnvironment.started.append(time.monotonic())
        time.sleep(30)


def test_a_hanging_tool_costs_one_timeout_per_turn_not_one_per_episode():
    """32 episodes whose tool hangs: their steps are waited for together, so every one has begun before the first
    one's timeout ran out (in series each would start a timeout after the previous one)."""
    tok = merging_tokenizer()
    prompts = [
        Prompt(prompt_ids=chars(tok, f"{i}+1="), text=f"{i}+1=", reference=str(i + 1), extras={}) for i in range(8)
    ]
    RecordedHangingEnvironment.started = []
    timeout_s = 1.0
    episodes = run_plain(
        ScriptedEngine([chars(tok, "[1+1]")]),
        prompts,
        4,
        RecordedHangingEnvironment,
        tok,
        settings(timeout_s=timeout_s, on_error="zero"),
        where="rollout step 0",
    )
    starts = RecordedHangingEnvironment.started
    assert len(starts) == 32 and max(starts) - min(starts) < timeout_s
    assert [ep.failure for ep in episodes] == ["timeout"] * 32 and episode_stats(episodes)["environment_timeouts"] == 32


# ------------------------------------------------------------------ the docs' verl tool wrapper


class AsyncVerlStyleTool:
    """A stand-in with verl's BaseTool interface: every method a coroutine; create(create_kwargs=...) returns
    (instance_id, response); execute returns (response, step reward, metrics)."""

    def __init__(self, config, tool_schema):
        self.instances = {}

    async def create(self, instance_id=None, create_kwargs=None, **kwargs):
        await asyncio.sleep(0)
        instance_id = instance_id or f"i{len(self.instances)}"
        self.instances[instance_id] = {"answer": str((create_kwargs or {})["ground_truth"]), "calls": 0}
        return instance_id, SimpleNamespace(text=None)

    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(0)
        self.instances[instance_id]["calls"] += 1
        return SimpleNamespace(text=str(eval(parameters["expression"], {}))), 0.1, {}

    async def calc_reward(self, instance_id, **kwargs):
        return float(self.instances[instance_id]["calls"] > 0)

    async def release(self, instance_id, **kwargs):
        del self.instances[instance_id]


def test_the_docs_verl_tool_wrapper_runs_async_tools_in_the_episode_threads():
    """docs/environments.md's VerlToolEnvironment, run as the episode loop runs environments (each call in its own
    worker thread, lit_ppo.environments.call_all_with_timeout): verl's coroutine methods are awaited, the tool's
    response text is the observation, and the observations pass the protocol's check."""
    from lit_ppo.environments import call_all_with_timeout, check_observation, check_step_result

    docs = (ROOT / "docs" / "environments.md").read_text()
    code = docs[docs.index("class VerlToolEnvironment:") :]
    code = "import asyncio, json, re\n\n\n" + code[: code.index("```")]
    namespace: dict = {}
    exec(compile(code, "docs/environments.md", "exec"), namespace)
    environments = [namespace["VerlToolEnvironment"](AsyncVerlStyleTool, {}) for _ in range(3)]
    records = [{"prompt": f"{i}*7=", "reference": str(i * 7)} for i in range(3)]
    resets = call_all_with_timeout([(e.reset, (r,)) for e, r in zip(environments, records)], timeout_s=10)
    assert [ok for ok, _ in resets] == [True] * 3 and [check_observation(v, "reset") for _, v in resets] == [None] * 3
    call = '<tool_call>{"name": "calc", "arguments": {"expression": "6*7"}}</tool_call>'
    steps = call_all_with_timeout([(e.step, (call,)) for e in environments], timeout_s=10)
    assert [check_step_result(v) for ok, v in steps if ok] == [("42", 0.1, False, {"tool_call": True})] * 3
    finals = call_all_with_timeout([(e.step, ("#### 42",)) for e in environments], timeout_s=10)
    assert [check_step_result(v) for ok, v in finals if ok] == [(None, 1.0, True, {"tool_call": False})] * 3
