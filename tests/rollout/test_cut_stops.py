"""Stop strings across a partial rollout's cut (lit_ppo/rollout/cut_stops.py): a stop string begun before the cut
ends the sample where it completes, as within one call."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import AutoTokenizer

from lit_ppo.config import PPOConfig, RolloutConfig
from lit_ppo.config.partial import PartialConfig
from lit_ppo.contract import GenerateRequest, Generation
from lit_ppo.rollout.cut_stops import stopped_across_cut, text_before_stop
from lit_ppo.rollout.prompts import Prompt, PromptSet
from tests.helpers import datamodule_on, run_config

PPO = PPOConfig(rollout_batch_size=4, n_samples_per_prompt=2, train_batch_size=8, micro_train_batch_size=4)
PROMPT = 6  # prompt tokens


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)  # one token per character


class ScriptEngine:
    """Every response is `script` (one token per character), from where its prompt's continuation stands, ending as
    vLLM ends one: at its token limit (truncated) or at a stop string within the call's own text (the token that
    completes it kept, the text cut before it)."""

    adapter_version = 0

    def __init__(self, tokenizer, script: str):
        self.tokenizer, self.script = tokenizer, tokenizer(script).input_ids

    def generate(self, request: GenerateRequest) -> list[Generation]:
        out = []
        for i, (ids, limit) in enumerate(zip(request.prompt_token_ids, request.limits)):
            for _ in range(request.n):
                tokens = self.script[len(ids) - PROMPT :][:limit]
                truncated, text = len(tokens) == limit, self.tokenizer.decode(tokens)
                for k in range(1, len(tokens) + 1):
                    text = self.tokenizer.decode(tokens[:k])
                    if any(s in text for s in request.stop):
                        tokens, truncated, text = tokens[:k], False, text_before_stop(text, request.stop)
                        break
                out.append(Generation(i, tokens, truncated, text, [-0.5] * len(tokens)))
        return out

    def wake_up(self):
        pass


def stop_rollout(stop) -> RolloutConfig:
    return RolloutConfig(max_response_tokens=12, temperature=0.7, stop=stop, partial=PartialConfig(4, 2))


def test_rollout_stop_composes_with_partial_rollouts():
    run_config(ppo=PPO, rollout=stop_rollout(["xy"]))  # no longer refused


@pytest.mark.parametrize(
    "stop, tokens, text",
    [
        (["xy"], "abcxy", "abc"),  # "x" ends chunk 0, "y" begins chunk 1: the cut splits the stop string
        (["bcxyz"], "abcxyz", "a"),  # three of its characters before the cut
        (["yz"], "abcxyz", "abcx"),  # within chunk 1: the engine's own match
        (["q"], "abcxyzuvwrst", "abcxyzuvwrst"),  # never: the response budget of 12
    ],
)
def test_a_stop_string_across_the_cut_ends_the_sample_where_it_completes(tokenizer, tiny_model_dir, stop, tokens, text):
    """Chunks of 4 tokens of the script "abcxyzuvwrst": the sample ends at the token that completes the stop string,
    whether the cut splits it or not, and its text is cut before it, as a response generated in one call."""
    prompts = PromptSet([Prompt([40 + i] * PROMPT, f"p{i}", "0", {}) for i in range(16)], "test")
    dm = datamodule_on(
        prompts, stop_rollout(stop), tokenizer, tiny_model_dir, ScriptEngine(tokenizer, "abcxyzuvwrst"), ppo=PPO
    )
    trained = [dm.produce_rollout(step) for step in range(3)][-1]  # every group of step 0 has ended by step 2
    assert {tokenizer.decode(r) for r in trained.response_ids} == {tokens}
    assert set(trained.responses) == {text}
    assert all(trained.truncated.tolist()) == (stop == ["q"])  # ended by the stop string, or by the budget
    assert all(len(lp) == len(r) for lp, r in zip(trained.rollout_logprobs, trained.response_ids))


def test_stopped_across_cut_keeps_the_token_that_completes_the_stop_string(tokenizer):
    ids = tokenizer("hello wor").input_ids
    chunk = Generation(0, tokenizer("ld and more").input_ids, True, "ld and more", [-1.0] * 11)
    ended = stopped_across_cut(ids, chunk, ["world"], tokenizer)
    assert tokenizer.decode(ended.token_ids) == "ld" and ended.logprobs == [-1.0, -1.0] and not ended.truncated
    assert stopped_across_cut(ids, chunk, ["planet"], tokenizer) == chunk  # no stop string: as generated
    assert stopped_across_cut([], chunk, ["world"], tokenizer) == chunk  # a first chunk: the engine's own matching
    same = dataclasses.replace(chunk, token_ids=tokenizer("ld").input_ids, logprobs=[-1.0] * 2, truncated=False)
    assert stopped_across_cut(ids, same, ["world"], tokenizer) == same  # the engine ended it there itself


def byte_tokenizer():
    """One token per byte (a byte-level BPE without merges): a CJK character is 3 tokens, an emoji 4."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core)


@pytest.mark.parametrize(
    "text, stop, cut",
    [
        ("ab🙂🙃😀cd", "🙂🙃😀", 10),  # the cut between two emoji: 8 of the stop string's 12 byte tokens before it
        ("ab🙂🙃😀cd", "🙂🙃😀", 12),  # the cut inside the third emoji's 4 bytes
        ("日本語のテキストです", "語のテキスト", 21),  # 7 characters before the cut, 21 tokens; the stop string's 6th
    ],
)
def test_a_stop_string_of_many_byte_characters_begun_before_the_cut_is_found(text, stop, cut):
    """A stop string of 3-byte or 4-byte characters that a cut (after `cut` tokens) splits, each byte one token (byte
    fallback): found wherever in its bytes the cut falls (a look-back of characters, not of tokens)."""
    tokenizer = byte_tokenizer()
    ids = tokenizer(text).input_ids
    end = len(text[: text.index(stop) + len(stop)].encode())  # the token that completes the stop string: kept
    chunk = Generation(0, ids[cut:], True, "", [-0.25 * (k + 1) for k in range(len(ids) - cut)])
    ended = stopped_across_cut(ids[:cut], chunk, [stop], tokenizer)
    assert ended.token_ids == ids[cut:end] and not ended.truncated
    assert ended.logprobs == chunk.logprobs[: end - cut]
    assert stopped_across_cut(ids[:cut], chunk, ["🙂😀", "のです"], tokenizer) == chunk  # not in the text: as generated
