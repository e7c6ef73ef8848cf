"""Rewards: the math verifier, the reward-model reward, and the scorer's contract (errors, non-finite, overlong)."""

from __future__ import annotations

import logging
import math
import time

import pytest
import torch

from lit_ppo import waits
from lit_ppo.errors import ConfigError
from lit_ppo.rewards import RewardError, RewardScorer, SequenceClassifierReward
from lit_ppo.rewards.math_verifier import extract_answer, math_reward
from lit_ppo.rewards.scorer import TIMEOUTS_BEFORE_GIVING_UP
from tests.helpers import compose_run_config

# ------------------------------------------------------------------ the math verifier

GSM8K_ANSWER = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips.\n#### 72"
# (reference, response, correct): references are bare answers, GSM8K answer fields or MATH solutions.
MATH_PAIRS = [
    # GSM8K `####` answers
    ("72", "48 + 24 = 72\n#### 72", True),
    (GSM8K_ANSWER, "She sold 72 clips.\n#### 72", True),
    (GSM8K_ANSWER, "#### 24", False),
    ("42", "#### 42 apples.", True),
    ("42", "first #### 41 then #### 42", True),  # the last marker counts
    ("42", "#### 42\n#### 43", False),
    ("-3", "#### -3", True),
    ("-3", "#### 3", False),
    ("18", "#### $18", True),
    ("18", "#### $18.00", True),
    # thousands separators
    ("1000", "#### 1,000", True),
    ("1,000", "#### 1000", True),
    ("1,000", "#### 100", False),
    ("1234567", "#### 1,234,567", True),
    ("1 000", "#### 1000", True),
    ("1,000", "\\boxed{1{,}000}", True),
    # decimals and fractions
    ("1.5", "#### 3/2", True),
    ("1.5", "#### 1.50", True),
    ("1.5", "#### 1.05", False),
    ("0.75", "#### 75%", True),
    ("\\frac{1}{2}", "#### 1/2 cup", True),
    ("\\frac{1}{2}", "\\boxed{0.5}", True),
    ("0.5", "\\boxed{\\frac{1}{2}}", True),
    ("1/2", "\\boxed{\\dfrac{1}{2}}", True),
    ("\\frac{2}{4}", "\\boxed{\\frac12}", True),
    ("\\frac{1}{3}", "\\boxed{0.33}", False),
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}", False),
    ("3", "\\boxed{\\frac{9}{3}}", True),
    ("75\\%", "\\boxed{75\\%}", True),
    # LaTeX and symbolic forms
    ("\\sqrt{2}", "\\boxed{\\frac{2}{\\sqrt{2}}}", True),
    ("\\sqrt{2}", "\\boxed{2}", False),
    ("2\\pi", "\\boxed{\\pi \\cdot 2}", True),
    ("3.14", "\\boxed{\\pi}", False),
    ("x+1", "\\boxed{1+x}", True),
    ("(x+1)^2", "\\boxed{x^2+2x+1}", True),
    ("2x", "\\boxed{x}", False),
    ("12", "\\boxed{\\text{12}}", True),
    ("2", "the answer is \\boxed{{2}}.", True),
    ("\\infty", "\\boxed{\\infty}", True),
    ("5", "so \\boxed{x = 5}", True),
    ("10", "\\boxed{10}, no wait: \\boxed{11}", False),  # the last box counts
    ("The area is \\boxed{\\frac{9}{2}}.", "\\boxed{4.5}", True),  # a MATH solution as the reference
    ("1,000", "#### 10,000", False),
    ("0.5", "\\boxed{5}", False),
    ("\\frac{3}{4}", "#### 4/3", False),
    ("x+1", "\\boxed{x-1}", False),
    # no answer in an accepted format
    ("12", "", False),
    ("5", "no answer here", False),
    ("7", "3 apples and 4 pears make 7", False),  # the last-number fallback is off by default
]


@pytest.mark.parametrize("reference, response, correct", MATH_PAIRS)
def test_math_verifier(reference, response, correct):
    scores, metrics = math_reward([""], [response], [reference], [{}])
    assert scores == [float(correct)]
    assert metrics["correct"] == [float(correct)]


@pytest.mark.parametrize(
    "text, fallback, expected",
    [
        ("#### 42", False, ("42", "gsm8k")),
        ("x \\boxed{\\frac{1}{\\sqrt{2}}} y", False, ("\\frac{1}{\\sqrt{2}}", "boxed")),
        ("\\boxed{1} and #### 2", False, ("2", "gsm8k")),  # formats are tried in config order
        ("\\boxed{unclosed", False, (None, None)),
        ("####   ", False, (None, None)),
        ("it is 1,234.5 or -7", False, (None, None)),
        ("it is 1,234.5 or -7", True, ("-7", "last_number")),
        ("costs 1,234.5 dollars", True, ("1,234.5", "last_number")),
        ("nothing", True, (None, None)),
    ],
)
def test_extract_answer(text, fallback, expected):
    assert extract_answer(text, last_number_fallback=fallback) == expected


def test_format_weight_and_last_number_fallback():
    responses = ["#### 42", "#### 41", "I think 42", "\\boxed{42}", "nothing"]
    scores, metrics = math_reward(
        [""] * 5, responses, ["42"] * 5, [{}] * 5, last_number_fallback=True, format_weight=0.25
    )
    assert scores == [1.25, 0.25, 1.0, 1.25, 0.0]
    assert metrics == {"correct": [1, 0, 1, 1, 0], "formatted": [1, 1, 0, 1, 0]}
    only_boxed, _ = math_reward(
        [""] * 2, ["#### 42", "\\boxed{42}"], ["42"] * 2, [{}] * 2, formats=["boxed"], format_weight=0.5
    )
    assert only_boxed == [0.0, 1.5]


def test_math_reward_through_the_config_and_scorer():
    scorer = RewardScorer.from_config(compose_run_config("reward=math", "reward.fn.format_weight=0.1"))
    scores = scorer(["p"] * 3, ["#### 1,000", "#### 7", "7"], ["1000", "8", "7"], [{}] * 3, [False] * 3)
    assert scores == pytest.approx([1.1, 0.1, 0.0])
    assert scores.metrics == pytest.approx(
        {"correct": 1 / 3, "formatted": 2 / 3, "errors": 0.0, "timeouts": 0.0, "none": 0.0}
    )
    assert scores.sample_metrics == {"correct": [1.0, 0.0, 0.0], "formatted": [1.0, 1.0, 0.0]}


def test_math_reward_without_reference_names_the_sample():
    scorer = RewardScorer.from_config(compose_run_config("reward=math"))
    with pytest.raises(RewardError, match=r"failed on sample 1 \(prompt 'b'.*no reference answer .*data.answer_key"):
        scorer(["a", "b"], ["#### 1", "#### 2"], ["1", None], [{}, {}], [False, False])


# ------------------------------------------------------------------ the scorer's contract


def exact_length(prompts, responses, references, extras):
    return [float(len(r)) for r in responses]


def fails_on_bad(prompts, responses, references, extras):
    for r in responses:
        if "bad" in r:
            raise ValueError(f"cannot score {r!r}")
    return [1.0] * len(responses), {"ones": [1.0] * len(responses)}


def call(scorer, responses, truncated=None):
    n = len(responses)
    return scorer([f"prompt {i}" for i in range(n)], responses, ["r"] * n, [{}] * n, truncated or [False] * n)


def test_raising_reward_names_sample_prompt_and_exception():
    scorer = RewardScorer(fn=fails_on_bad)
    with pytest.raises(RewardError) as info:
        call(scorer, ["ok", "fine", "bad one", "ok"])
    message = str(info.value)
    assert "fails_on_bad failed on sample 2" in message
    assert "prompt 'prompt 2'" in message and "response 'bad one'" in message
    assert "ValueError: cannot score 'bad one'" in message and "reward.on_error=zero" in message
    assert isinstance(info.value.__cause__, ValueError)


def test_on_error_zero_scores_zero_and_counts_exactly():
    scorer = RewardScorer(fn=fails_on_bad, on_error="zero")
    scores = call(scorer, ["ok", "bad", "ok", "bad", "bad", "ok"])
    assert scores == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert scorer.errors == 3 and scores.metrics == {"ones": 1.0, "errors": 3.0, "timeouts": 0.0, "none": 0.0}
    assert call(scorer, ["bad", "ok"]).metrics["errors"] == 1.0 and scorer.errors == 4  # this call's, the run's
    assert call(scorer, ["ok"]).metrics["errors"] == 0.0 and scorer.errors == 4


def interrupts(prompts, responses, references, extras):
    """Raises KeyboardInterrupt on a response that says `stop`, and ValueError on a batch of more than 3."""
    if len(responses) > 3:
        raise ValueError("batches of 3 at most")
    if "stop" in responses:
        raise KeyboardInterrupt
    return [1.0] * len(responses)


@pytest.mark.parametrize("on_error", ["raise", "zero"])
@pytest.mark.parametrize("batch", [2, 4], ids=["in-the-batch-call", "one-sample-at-a-time"])
def test_a_keyboard_interrupt_from_the_reward_stops_the_run_in_one_line_naming_it(sigint_handled, on_error, batch):
    """During a run lit-ppo handles SIGINT (a Ctrl-C stops at a safe point with a checkpoint), so a KeyboardInterrupt
    out of the reward function is its code's: it went through Lightning's "graceful shutdown", exit 1, no line. Now a
    RewardError naming the function, whatever reward.on_error says (the function asked to stop)."""
    responses = ["ok"] * (batch - 1) + ["stop"]
    with pytest.raises(RewardError) as info:
        call(RewardScorer(fn=interrupts, on_error=on_error), responses)
    message = str(info.value)
    where = "on the batch of 2 samples" if batch == 2 else "on sample 3 (prompt 'prompt 3')"
    assert f"test_rewards.interrupts raised KeyboardInterrupt {where}, which no Ctrl-C sent" in message, message
    assert "\n" not in message and isinstance(info.value.__cause__, KeyboardInterrupt)


def test_a_keyboard_interrupt_under_pythons_default_handler_passes_through():
    """Without lit-ppo's handlers (a notebook, a test) a KeyboardInterrupt may be a real Ctrl-C: it is not turned
    into a reward error."""
    with pytest.raises(KeyboardInterrupt):
        call(RewardScorer(fn=interrupts, on_error="zero"), ["ok", "stop"])


def reads_solution(prompts, completions, **kwargs):
    """A TRL reward that reads its reference as `solution`, a column this run names otherwise: None for every sample."""
    solutions = kwargs.get("solution") or [None] * len(completions)
    return [None if s is None else float(c == s) for c, s in zip(completions, solutions)]


def test_a_trl_function_returning_none_for_every_sample_is_said_on_the_console(caplog):
    """TRL's None ("does not apply to this sample") scores 0 and is counted in rollout/reward_none; a call where it
    applies to no sample at all was silent, and a function that never applies trained on zeros. Said at the 1st such
    call, the 10th, the 100th...; a call where it applies to some samples is not."""
    scorer = RewardScorer(fn=reads_solution)
    with caplog.at_level(logging.WARNING, logger="lit_ppo"):
        for _ in range(12):
            scores = call(scorer, ["a", "b"])
    said = [r.getMessage() for r in caplog.records if "returned None" in r.getMessage()]
    assert scores == [0.0, 0.0] and scores.metrics["none"] == 2.0 and len(said) == 2, said
    assert [line.split("samples of a call, ")[1].split(" so far")[0] for line in said] == [
        "1 such call(s)",
        "10 such call(s)",
    ]
    assert said[0].startswith(
        f"reward: the TRL-style reward function {__name__}.reads_solution returned None (TRL's \"does not apply to "
        'this sample") for all 2 samples of a call, 1 such call(s) so far (said again at 10, 100, ...): each scores 0, '
        "counted in rollout/reward_none"
    ), said[0]
    assert "(prompts=, completions=, answer=; the reference under data.answer_key's name, present)" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lit_ppo"):
        scores = scorer(["p", "q"], ["a", "b"], [None, None], [{"solution": "a"}, {"solution": None}], [False] * 2)
    assert scores == [1.0, 0.0] and scores.metrics["none"] == 1.0 and caplog.records == []


def slow(prompts, responses, references, extras):
    time.sleep(0.3 * len(responses))
    return [1.0] * len(responses)


def test_a_reward_call_that_takes_long_is_said_on_the_console_with_its_progress(monkeypatch, caplog):
    """A reward call that stalls printed nothing. Now, after waits.NOTICE_AFTER_S (5 s; 0.12 here), a line says
    what the run waits for and how far it is, and again each time the wait doubles; a call no slower than 3 times
    the last one is not said (a function slow by nature, an LLM judge, would say it at every call)."""
    monkeypatch.setattr(waits, "NOTICE_AFTER_S", 0.12)
    scorer = RewardScorer(fn=slow, timeout_s=0.5)
    with caplog.at_level(logging.INFO, logger="lit_ppo"):
        # The batch is cut at 0.5 s, then its samples take 0.3 s each (0.5-0.8, 0.8-1.1, 1.1-1.4 s): lines near
        # 0.12, 0.24, 0.48 s (none of the 3 scored) and 0.96 s (one scored).
        assert call(scorer, ["a", "b", "c"]) == [1.0, 1.0, 1.0]
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for")]
    assert said[0] == (
        f"waiting for the reward function {__name__}.slow: 0 s so far, 0 of 3 samples scored (in this process; "
        "reward.timeout_s=0.5)"
    ), said
    assert any(", 1 of 3 samples scored" in line for line in said) and 3 <= len(said) <= 5, said
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lit_ppo"):
        call(scorer, ["a"])  # 0.3 s: past NOTICE_AFTER_S, but not past 3 times the last call's 1.4 s
    assert not [r for r in caplog.records if r.getMessage().startswith("waiting for")]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), None, "high", "1.0", b"1"])
def test_non_finite_reward_is_an_error(bad):
    def fn(prompts, responses, references, extras):
        return [1.0, bad, 2.0]

    with pytest.raises(
        RewardError, match=rf"failed on sample 1 \(prompt 'prompt 1'.*returned {bad!r}, not a finite number"
    ):
        call(RewardScorer(fn=fn), ["a", "b", "c"])
    scorer = RewardScorer(fn=fn, on_error="zero")
    assert call(scorer, ["a", "b", "c"]) == [1.0, 0.0, 2.0] and scorer.errors == 1


def test_rewards_are_real_numbers_bools_included():
    import numpy as np

    def fn(prompts, responses, references, extras):
        return [True, 2, np.float32(0.5), torch.tensor(0.25), np.bool_(False)]

    assert call(RewardScorer(fn=fn), ["a"] * 5) == [1.0, 2.0, 0.5, 0.25, 0.0]

    def text_scores(prompts, responses, references, extras):
        return ["1.0" for _ in responses]

    with pytest.raises(RewardError) as info:
        call(RewardScorer(fn=text_scores), ["a", "b"])
    message = str(info.value)
    assert "\n" not in message and "text_scores failed on sample 0" in message
    assert "returned '1.0', not a finite number (a float, int or bool; not str)" in message


def test_contract_violations():
    with pytest.raises(RewardError, match="returned 2 scores for 3 responses"):
        call(RewardScorer(fn=lambda p, r, ref, e: [0.0, 1.0]), ["a", "b", "c"])

    def batch_only_failure(prompts, responses, references, extras):
        if len(responses) > 1:
            raise MemoryError("batch too big")
        return [0.5]

    with pytest.raises(
        RewardError, match="raised on the batch of 2 but on no single sample: MemoryError: batch too big"
    ):
        call(RewardScorer(fn=batch_only_failure), ["a", "b"])
    with pytest.raises(ConfigError, match="reward.on_error='ignore'; fix: use one of"):
        RewardScorer(fn=exact_length, on_error="ignore")


def test_overlong_penalty_applies_to_truncated_responses_only():
    scorer = RewardScorer(fn=exact_length, overlong_penalty=0.5)
    assert call(scorer, ["ab", "abcd", "abc"], truncated=[False, True, False]) == [2.0, 3.5, 3.0]
    cfg = compose_run_config("reward=math", "reward.overlong_penalty=1.0")
    scorer = RewardScorer.from_config(cfg)
    assert scorer(["p", "p", "p"], ["#### 5", "#### 9", "#### 5"], ["5"] * 3, [{}] * 3, [True, True, False]) == [
        0.0,
        -1.0,
        1.0,
    ]


def test_a_bad_target_is_a_config_error():
    cfg = compose_run_config("reward=custom_example", "reward.fn._target_=tests.rewards.test_rewards.no_such_function")
    with pytest.raises(ConfigError, match="reward.fn: cannot build 'tests.rewards.test_rewards.no_such_function'"):
        RewardScorer.from_config(cfg)


# ------------------------------------------------------------------ a local reward model


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory) -> str:
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from lit_ppo.demo.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("reward_model")
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_reward_model_scores_prompt_plus_response(reward_model_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    cfg = compose_run_config("reward=reward_model", f"reward.fn.model_dir={reward_model_dir}", "reward.fn.batch_size=2")
    scorer = RewardScorer.from_config(cfg)
    assert isinstance(scorer.fn, SequenceClassifierReward)
    prompts, responses = ["1+1=", "What is 12+30? ", "x"], ["2", "42", "a much longer response"]
    scores = scorer(prompts, responses, [None] * 3, [{}] * 3, [False] * 3)

    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    with torch.no_grad():  # one text at a time: no padding involved
        expected = [
            float(model(**tokenizer(p + r, return_tensors="pt")).logits[0, 0]) for p, r in zip(prompts, responses)
        ]
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(round(s, 6) for s in scores)) == 3 and all(math.isfinite(s) for s in scores)


def test_reward_model_configuration_errors(reward_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="not a model directory"):
        SequenceClassifierReward(str(tmp_path))
    with pytest.raises(ConfigError, match="score_index=1 but the model has 1 labels"):
        SequenceClassifierReward(reward_model_dir, score_index=1)


@pytest.mark.parametrize("name", ["arithmetic", "math", "custom_example"])
def test_every_reward_config_builds_a_scorer(name):
    scorer = RewardScorer.from_config(compose_run_config(f"reward={name}"))
    assert callable(scorer.fn) and scorer.on_error == "raise"


# ------------------------------------------------------------------ pass@k counts solved samples


class ScriptedEngine:
    """An engine that answers prompt i with `responses[i]` (greedy: the first of them)."""

    def __init__(self, responses: list[list[str]]):
        self.responses = responses

    def wake_up(self) -> None:
        pass

    def generate(self, request):
        from lit_ppo.rollout.engine import Generation

        prompt_token_ids, n = request.prompt_token_ids, request.n

        return [
            Generation(prompt_index=i, token_ids=[1], truncated=False, text=self.responses[i][j], logprobs=[0.0])
            for i in range(len(prompt_token_ids))
            for j in range(n)
        ]


def evaluate_with(responses: list[list[str]], references: list[str], scorer: RewardScorer) -> dict:
    from lit_ppo.config import RolloutConfig
    from lit_ppo.rollout.datamodule import RolloutDataModule
    from lit_ppo.rollout.prompts import Prompt, PromptSet

    prompts = PromptSet([Prompt([1, 2], f"q{i}", ref, {}) for i, ref in enumerate(references)], "test")
    datamodule = RolloutDataModule(
        plan=None,
        train_prompts=prompts,
        eval_prompts=prompts,
        rollout=RolloutConfig(eval_samples_per_prompt=2),
        scorer=scorer,
        tokenizer=None,
        model_dir="",
        seed=0,
        engine=ScriptedEngine(responses),
    )
    return datamodule.evaluate()


def test_pass_at_k_with_format_weight_counts_only_correct_answers():
    # Prompt 0: two well-formatted wrong answers (reward 0.1 each from format_weight); prompt 1: one right answer.
    scorer = RewardScorer.from_config(compose_run_config("reward=math", "reward.fn.format_weight=0.1"))
    result = evaluate_with([["#### 5", "#### 9"], ["#### 8", "#### 7"]], ["4", "7"], scorer)
    assert result["eval/pass@2"] == 0.5


def test_pass_at_k_without_a_correct_metric_uses_the_solved_threshold():
    # Rewards 0.5 (partial credit) do not solve a prompt at the default threshold of 1.0.
    def partial(prompts, responses, references, extras):
        return [1.0 if r == ref else 0.5 for r, ref in zip(responses, references)]

    result = evaluate_with([["1", "2"], ["3", "4"]], ["2", "9"], RewardScorer(fn=partial))
    assert result["eval/pass@2"] == 0.5
    result = evaluate_with([["1", "2"], ["3", "4"]], ["2", "9"], RewardScorer(fn=partial, solved_threshold=0.5))
    assert result["eval/pass@2"] == 1.0


def test_dapo_overlong_shaping_measures_an_episode_against_the_episode_budget():
    """In an episode rollout.max_response_tokens is one turn's budget; the overlong shaping compares the whole
    episode (turns and observations, up to rollout.episodes.max_tokens=2048 here) with the episode's budget, so an
    episode of 1,500 tokens under gsm8k_tools' 1,024-token turns is not penalized."""
    config = compose_run_config("+experiment=gsm8k_tools", "ppo=dapo", "reward.overlong_buffer_tokens=512")
    assert (config.rollout.max_response_tokens, config.rollout.response_budget_tokens()) == (1024, 2048)
    scorer = RewardScorer.from_config(config)
    scores = scorer(["q"] * 3, ["#### 5"] * 3, ["5"] * 3, [{}] * 3, [False] * 3, lengths=[1500, 1800, 2048])
    # Linear over the last 512 tokens before 2048: 1500 is before the buffer; 1800 is 264 into it.
    assert scores == pytest.approx([1.0, 1.0 - 264 / 512, 0.0])


class SleepsOnHang:
    """A reward that sleeps far past any limit on the response "hang" (a verifier stuck on one sample)."""

    def __init__(self):
        self.finished_sleeping = False

    def __call__(self, prompts, responses, references, extras):
        if "hang" in responses:
            time.sleep(60)
            self.finished_sleeping = True
        return [1.0] * len(responses)


class HangsOnEverything:
    """A reward whose every call hangs: a remote judge that is down."""

    def __init__(self):
        self.calls = 0

    def __call__(self, prompts, responses, references, extras):
        self.calls += 1
        time.sleep(60)
        return [1.0] * len(responses)


def test_a_reward_hanging_on_every_sample_in_process_gives_up_on_the_rest_of_the_call(caplog):
    """The batch call, cut at reward.timeout_s, was followed by every sample alone under the same limit: with the
    default 60 s, a dead remote judge made each rollout step of 128 samples take two hours. After the batch and
    two samples in a row time out, the call's other samples score as reward.on_error says, at once, with a line."""
    reward = HangsOnEverything()
    scorer = RewardScorer(fn=reward, on_error="zero", timeout_s=0.2)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="lit_ppo"):
        scores = scorer(["p"] * 8, [str(i) for i in range(8)], ["1"] * 8, [{}] * 8, [False] * 8)
    assert reward.calls == 1 + TIMEOUTS_BEFORE_GIVING_UP == 3  # the batch, then two samples, then none
    assert time.monotonic() - started < 0.2 * 8
    assert scores == [0.0] * 8 and scores.metrics["timeouts"] == 8.0 and scorer.timeouts == 8
    given_up = [r.getMessage() for r in caplog.records if "looks hung" in r.getMessage()]
    assert given_up == [
        "reward: the batch and then 2 samples in a row ran past reward.timeout_s=0.2s: the reward function looks hung "
        "(a remote service down?); the other 6 samples of this call score 0 without being scored "
        "(reward.on_error=zero, counted as timeouts)"
    ]


def test_a_reward_sleeping_past_timeout_s_in_process_is_cut_and_counted():
    """The default reward.workers=0: the batch call is cut at reward.timeout_s, then each sample is scored alone
    under the same limit; only the sample that hangs scores 0, counted as a timeout."""
    reward = SleepsOnHang()
    scorer = RewardScorer(fn=reward, on_error="zero", timeout_s=0.5)
    assert scorer.workers == 0
    scores = scorer(["p"] * 4, ["1", "2", "hang", "4"], ["1"] * 4, [{}] * 4, [False] * 4)
    assert scores == [1.0, 1.0, 0.0, 1.0] and not reward.finished_sleeping
    assert scorer.timeouts == 1 and scores.metrics["timeouts"] == 1.0 and scores.metrics["errors"] == 0.0
    raising = RewardScorer(fn=SleepsOnHang(), timeout_s=0.5)  # on_error=raise names the sample
    with pytest.raises(RewardError, match="timed out on sample 2 .*reward.timeout_s=0.5s"):
        raising(["p"] * 4, ["1", "2", "hang", "4"], ["1"] * 4, [{}] * 4, [False] * 4)
