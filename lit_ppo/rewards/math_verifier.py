"""A math answer verifier on Hugging Face's `math-verify`: find the final answer, compare it with the reference.

math-verify parses numbers, fractions, thousands separators and LaTeX and compares numerically and
symbolically. This file adds what it lacks: GSM8K's `#### 42` answer marker, the choice of which
answer formats count (and a reward for using one), and an opt-in last-number fallback.

Use as `reward.fn` (conf/reward/math.yaml):

    fn: {_target_: lit_ppo.rewards.math_verifier.math_reward, _partial_: true, format_weight: 0.1}

References may be a bare answer (`42`, `\\frac{1}{2}`), a GSM8K answer field (`reasoning ... #### 42`)
or a MATH solution with a `\\boxed{...}` answer: the same extraction is applied to them.
"""

from __future__ import annotations

import re
import threading
from functools import lru_cache

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from math_verify.errors import TimeoutException

FORMATS = ("gsm8k", "boxed")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# A number as people write it: sign, thousands separators, decimals, an optional /denominator.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_UNIT_WORDS = re.compile(r"(?<=[\d%])\s+[A-Za-z][A-Za-z ]*\.?$")  # "42 apples" -> "42"
_LATEX_OR_SYMBOLS = re.compile(r"[A-Za-z\\{}^]")


def _last_boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{...}` (braces balanced), or None."""
    starts = list(_BOXED.finditer(text))
    for match in reversed(starts):
        depth, i = 1, match.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[match.end() : i - 1].strip()
    return None


def extract_answer(
    text: str, *, formats: tuple[str, ...] = FORMATS, last_number_fallback: bool = False
) -> tuple[str | None, str | None]:
    """(answer text, how it was found): `gsm8k` after the last `####`, `boxed` from the last `\\boxed{}`,
    `last_number` (only with the fallback on), or (None, None)."""
    for name in formats:
        if name == "gsm8k":
            marker = text.rfind("####")
            answer = text[marker + 4 :].split("\n", 1)[0].strip() if marker >= 0 else ""
            if answer:
                return answer, "gsm8k"
        elif name == "boxed":
            boxed = _last_boxed(text)
            if boxed:
                return boxed, "boxed"
        else:
            raise ValueError(f"math reward: unknown answer format {name!r}; fix: use some of {list(FORMATS)}")
    if last_number_fallback:
        numbers = _NUMBER.findall(text)
        if numbers:
            return numbers[-1], "last_number"
    return None, None


class MathVerifyTimeout(TimeoutError):
    """math-verify gave up on an expression (e.g. `9^{9^{9^{9}}}`). Raised, not scored 0: a verifier that
    quietly scores what it cannot check as wrong can zero a whole dataset unnoticed (verl PR #5635);
    the scorer names the sample and applies `reward.on_error`."""


def _timeout(timeout_s: int) -> int | None:
    # math-verify's timeouts use SIGALRM, which only the main thread may set (a reward worker process's
    # main thread can: reward.workers > 0).
    return timeout_s if threading.current_thread() is threading.main_thread() else None


@lru_cache(maxsize=65536)
def parse_answer(answer: str, timeout_s: int = 5) -> tuple:
    """math-verify's parse of an extracted answer. Plain numbers and arithmetic (`1 000`, `$18`, `3/2`,
    `42 apples`) are read as expressions, anything with letters or LaTeX as LaTeX; each falls back to the other."""
    answer = answer.replace("\\%", "%").strip()
    core = _UNIT_WORDS.sub("", answer)
    latex = ([LatexExtractionConfig(boxed_match_priority=0)], f"${answer}$")
    plain = ([ExprExtractionConfig()], core)
    for config, text in (latex, plain) if _LATEX_OR_SYMBOLS.search(core) else (plain, latex):
        try:
            parsed = parse(text, extraction_config=config, parsing_timeout=_timeout(timeout_s), raise_on_error=True)
        except TimeoutException as e:
            raise MathVerifyTimeout(f"math-verify could not parse {text[:200]!r} within {timeout_s}s") from e
        except Exception:  # unparseable: not an answer
            parsed = []
        if parsed:
            return tuple(parsed)
    return ()


def reference_answer(reference: str) -> str:
    """The answer inside a reference: after `####`, inside `\\boxed{}`, else the whole reference."""
    answer, _ = extract_answer(reference)
    return answer if answer is not None else reference.strip()


def answers_match(reference: str, answer: str, timeout_s: int = 5) -> bool:
    """Whether `answer` equals the reference's answer, numerically or symbolically; MathVerifyTimeout when
    math-verify cannot decide within `timeout_s` seconds."""
    gold, pred = parse_answer(reference_answer(reference), timeout_s), parse_answer(answer, timeout_s)
    if not gold or not pred:
        return False
    try:
        return bool(verify(list(gold), list(pred), timeout_seconds=_timeout(timeout_s), raise_on_error=True))
    except TimeoutException as e:
        raise MathVerifyTimeout(
            f"math-verify could not compare {answer[:200]!r} with the reference within {timeout_s}s"
        ) from e
    except Exception:  # not comparable
        return False


def math_reward(
    prompts,
    responses,
    references,
    extras,
    *,
    formats=FORMATS,
    last_number_fallback: bool = False,
    correct_reward: float = 1.0,
    format_weight: float = 0.0,
    timeout_s: int = 5,
):
    """`correct_reward` when the response's final answer equals the reference, plus `format_weight` when
    the answer is in one of `formats` (whether right or not). Logs `correct` and `formatted` rates.
    `timeout_s`: math-verify's own limit per parse and comparison (whole seconds, SIGALRM; main thread only)."""
    formats = tuple(formats)
    scores, correct, formatted = [], [], []
    for response, reference in zip(responses, references):
        if reference is None:
            raise ValueError("no reference answer to check against (is data.answer_key the answer field?)")
        answer, found_as = extract_answer(response, formats=formats, last_number_fallback=last_number_fallback)
        is_correct = answer is not None and answers_match(str(reference), answer, int(timeout_s))
        in_format = found_as in formats
        scores.append(correct_reward * is_correct + format_weight * in_format)
        correct.append(float(is_correct))
        formatted.append(float(in_format))
    return scores, {"correct": correct, "formatted": formatted}
