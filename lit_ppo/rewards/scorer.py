"""The scorer: calls the user's reward function on a batch and enforces its contract (finite numbers, one per
response, failures raised or counted), then applies the overlong shaping."""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lit_ppo import waits
from lit_ppo.algorithms import overlong_penalty
from lit_ppo.config import ON_ERROR, RunConfig, check_overlong_buffer
from lit_ppo.console import capture_prints, printed_by
from lit_ppo.errors import ConfigError, RewardError
from lit_ppo.rewards.calling import SIGNATURES, RewardCall, _name, detect_signature
from lit_ppo.rewards.workers import RewardWorkers, _Timeout
from lit_ppo.signals import raised_by_code
from lit_ppo.waits import call_with_deadline

log = logging.getLogger("lit_ppo")


# This many samples in a row past reward.timeout_s (in process, reward.workers=0: after the batch call did too) mean the
# function hangs on everything (a remote judge that is down), and the call's other samples are not tried.
TIMEOUTS_BEFORE_GIVING_UP = 2

# Reward metrics that count samples (the others are per-sample means): summed over data-parallel ranks, not averaged.
COUNT_METRICS = ("errors", "timeouts", "none")


class Scores(list):
    """One call's rewards, one float per response (a list), with what the call measured: `sample_metrics` (the reward
    function's per-sample metrics that every sample has) and `metrics` (their means, and this call's counts of
    `errors`, `timeouts` and TRL's `none`, COUNT_METRICS). Returned, not kept by the scorer: each caller holds the
    metrics of its own call."""

    def __init__(self, values: list[float], sample_metrics: dict[str, list[float]], metrics: dict[str, float]):
        super().__init__(values)
        self.sample_metrics = sample_metrics
        self.metrics = metrics


@dataclass
class RewardScorer:
    """Calls the user's reward function on a batch and enforces its contract.

    A sample whose reward raises, times out, kills its worker, or is not a finite number stops the run
    (`on_error=raise`, naming the sample) or scores 0 and is counted (`on_error=zero`): `errors` and
    `timeouts` count them over the run, and the returned `Scores.metrics["errors"]`, `["timeouts"]` in that call
    (logged as `rollout/reward_errors`, `rollout/reward_timeouts`). From a TRL-style function a None score
    ("not applicable") scores 0 and is counted in `metrics["none"]`; from the others it is an error."""

    fn: Callable[..., Any]
    on_error: str = "raise"  # raise: stop with the sample; zero: score 0 and count it
    overlong_penalty: float = 0.0  # subtracted from responses that hit the length limit
    # DAPO's soft overlong shaping (`algorithms.overlong_penalty`): off while overlong_buffer_tokens is 0
    overlong_buffer_tokens: int = 0
    overlong_penalty_factor: float = 1.0
    # The end of the overlong buffer: the most tokens a response can have (a whole episode's, turns and observations,
    # with an environment; `RolloutConfig.response_budget_tokens`).
    response_budget_tokens: int = 0
    signature: str = "auto"  # auto | lit_ppo | trl | verl | openrlhf (see RewardCall)
    reference_key: str | None = "answer"  # the reference's column name, for TRL-style functions
    workers: int = 0  # 0: call the function in this process; N: in N worker processes, one sample each
    # workers > 0: per sample (its worker is killed); workers = 0: per call (the batch, then one sample at a time)
    timeout_s: float | None = 60.0
    solved_threshold: float = 1.0  # reward at which a sample counts as solved, without a `correct` metric
    errors: int = 0  # over the run
    timeouts: int = 0  # over the run
    all_none_calls: int = 0  # over the run: calls of a TRL-style function that returned None for every sample

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR:
            raise ConfigError(f"reward.on_error={self.on_error!r}; fix: use one of {list(ON_ERROR)}")
        check_overlong_buffer(self.overlong_buffer_tokens, self.response_budget_tokens)
        if self.signature not in SIGNATURES:
            raise ConfigError(f"reward.signature={self.signature!r}; fix: use one of {', '.join(SIGNATURES)}")
        if int(self.workers) < 0 or (self.timeout_s is not None and self.timeout_s <= 0):
            raise ConfigError(
                f"reward.workers={self.workers}, reward.timeout_s={self.timeout_s}; "
                "fix: workers >= 0 (0: in process) and timeout_s > 0 or null"
            )
        chosen = detect_signature(self.fn) if self.signature == "auto" else self.signature
        how = "chosen by reward.signature=auto from its parameters" if self.signature == "auto" else "reward.signature"
        log.info("reward: %s, called with the %s signature (%s)", _name(self.fn), chosen, how)
        self.call = RewardCall(self.fn, chosen, self.reference_key)
        self._last_call_s = 0.0  # the last call's seconds (a long call is said on the console: `_waiting_line`)
        self._scored = 0  # samples of the call in progress scored one at a time (in this process)
        self.pool = (
            RewardWorkers(
                self.call,
                int(self.workers),
                self.timeout_s,
                TIMEOUTS_BEFORE_GIVING_UP,
                printed=lambda line: printed_by(f"reward function {_name(self.fn)}")(line),
            )
            if self.workers
            else None
        )

    @classmethod
    def from_config(cls, config: RunConfig) -> RewardScorer:
        """The scorer of a run: the `reward` settings, the references from `data.answer_key`, and the overlong
        shaping measured against the most tokens a response can have (`RolloutConfig.response_budget_tokens`: a
        whole episode's with an environment, not one turn's)."""
        import hydra

        reward = config.reward

        try:
            fn = hydra.utils.instantiate(reward.fn)
        except Exception as e:
            raise ConfigError(
                f"reward.fn: cannot build {reward.fn.get('_target_')!r}: {e}; fix: name an importable "
                "function (with _partial_: true) or callable class by its dotted path"
            ) from e
        if not callable(fn):
            raise ConfigError(
                f"reward.fn built {type(fn).__name__}, which is not callable; fix: add `_partial_: true` "
                "for a function, or name a class with __call__"
            )
        return cls(
            fn=fn,
            on_error=reward.on_error,
            overlong_penalty=reward.overlong_penalty,
            overlong_buffer_tokens=reward.overlong_buffer_tokens,
            overlong_penalty_factor=reward.overlong_penalty_factor,
            response_budget_tokens=config.rollout.response_budget_tokens(),
            solved_threshold=reward.solved_threshold,
            signature=reward.signature,
            reference_key=config.data.answer_key,
            workers=reward.workers,
            timeout_s=reward.timeout_s,
        )

    def close(self) -> None:
        """Stop the worker processes (they are daemons: they also end with this process)."""
        if self.pool is not None:
            self.pool.close()

    def __call__(
        self,
        prompts: list[str],
        responses: list[str],
        references: list,
        extras: list[dict],
        truncated: list[bool],
        lengths: list[int] | None = None,
    ) -> Scores:
        """Scores of the responses, with the call's metrics; `lengths` (tokens per response) are needed for the
        overlong shaping."""
        errors_before, timeouts_before = self.errors, self.timeouts
        started, self._scored = time.monotonic(), 0
        # A function slow by nature (an LLM judge) is not announced at every call: after 3 times its last call's time.
        after_s = max(waits.NOTICE_AFTER_S, 3 * self._last_call_s)
        with waits.said_while_waiting(lambda seconds: self._waiting_line(len(responses), seconds), after_s):
            scores, extra_metrics = self._score(prompts, responses, references, extras)
        self._last_call_s = time.monotonic() - started
        none = 0
        for i, score in enumerate(scores):
            if score is None and self.call.signature == "trl":  # TRL's "does not apply to this sample"
                none += 1
                scores[i] = 0.0
            elif not _is_finite_number(score):
                self._sample_failed(
                    i,
                    prompts,
                    responses,
                    ValueError(
                        f"returned {score!r}, not a finite number (a float, int or bool; not {type(score).__name__})"
                    ),
                )
                scores[i] = 0.0
        if scores and none == len(scores):
            self._said_all_none(len(scores), references, extras)
        scores = [float(s) - self.overlong_penalty * bool(t) for s, t in zip(scores, truncated)]
        if self.overlong_buffer_tokens:
            if lengths is None:
                raise ValueError(
                    "RewardScorer: reward.overlong_buffer_tokens is set but no response lengths were given"
                )
            shaping = overlong_penalty(
                torch.tensor(lengths),
                max_response_tokens=self.response_budget_tokens,
                buffer_tokens=self.overlong_buffer_tokens,
                penalty_factor=self.overlong_penalty_factor,
            )
            scores = [s + float(p) for s, p in zip(scores, shaping)]
        errors, timeouts = self.errors - errors_before, self.timeouts - timeouts_before
        if errors or timeouts:
            log.warning(
                "reward: %d of %d samples scored 0 after reward errors and %d after timeouts (reward.on_error=zero)",
                errors,
                len(scores),
                timeouts,
            )
        metrics = {k: float(sum(v) / max(len(v), 1)) for k, v in extra_metrics.items()}
        metrics.update(errors=float(errors), timeouts=float(timeouts), none=float(none))
        # Per sample only where every sample has a value (a sample whose reward failed has none).
        sample_metrics = {k: [float(x) for x in v] for k, v in extra_metrics.items() if len(v) == len(scores)}
        return Scores(scores, sample_metrics, metrics)

    def _score(self, prompts, responses, references, extras):
        """The raw scores of a call, and the function's metrics (in workers, or in this process)."""
        if self.pool is not None:
            return self._score_in_workers(prompts, responses, references, extras)
        try:
            result = call_with_deadline(lambda: self._call(prompts, responses, references, extras), self.timeout_s)
        except KeyboardInterrupt as interrupt:
            if not raised_by_code(interrupt):
                raise
            raise self._interrupted(f"on the batch of {len(responses)} samples") from interrupt
        except Exception as batch_error:  # find the sample that fails (or is slow), one by one
            if isinstance(batch_error, TimeoutError):
                log.warning(
                    "reward: the call on the batch of %d ran past reward.timeout_s=%gs and was cut; scoring its "
                    "samples one at a time, each under the same limit",
                    len(responses),
                    self.timeout_s,
                )
            return self._score_one_by_one(prompts, responses, references, extras, batch_error)
        return self._checked(result, len(responses))

    def _waiting_line(self, samples: int, seconds: float) -> str:
        """The console line for a reward call that takes long (`waits.said_while_waiting`)."""
        scored = self.pool.scored if self.pool is not None else self._scored
        where = f"in {self.workers} reward worker processes" if self.pool is not None else "in this process"
        limit = "null: no limit" if self.timeout_s is None else f"{self.timeout_s:g}"
        return (
            f"waiting for the reward function {_name(self.fn)}: {seconds:.0f} s so far, {scored} of {samples} samples "
            f"scored ({where}; reward.timeout_s={limit})"
        )

    def _said_all_none(self, samples: int, references: list, extras: list[dict]) -> None:
        """A TRL-style function that returned None for every sample of a call: said at the 1st such call, the 10th,
        the 100th... Not an error: in TRL a function may apply to some tasks of a mixed dataset only, and a batch
        can hold none of them; but a function that never applies (it reads a column under another name) trains on
        nothing but zeros, which the run should not do in silence."""
        self.all_none_calls += 1
        if self.all_none_calls != 10 ** (len(str(self.all_none_calls)) - 1):  # 1, 10, 100, ...
            return
        columns = ["prompts", "completions"] + ([self.reference_key] if self.reference_key else []) + list(extras[0])
        log.warning(
            'reward: the TRL-style reward function %s returned None (TRL\'s "does not apply to this sample") for all '
            "%d samples of a call, %d such call(s) so far (said again at 10, 100, ...): each scores 0, counted in "
            "rollout/reward_none, so these samples carry no reward signal; fix: if the function should apply, check "
            "that it reads the columns it is given (%s; the reference under data.answer_key's name, %s)",
            _name(self.fn),
            samples,
            self.all_none_calls,
            ", ".join(f"{c}=" for c in columns),
            "present" if any(r is not None for r in references) else "None for every sample",
        )

    def _call(self, prompts, responses, references, extras):
        """The function called in this process, what it prints shown and kept in run.log (`console.capture_prints`)."""
        with capture_prints(printed_by(f"reward function {_name(self.fn)}")):
            return self.call(prompts, responses, references, extras)

    def _checked(self, result, n: int) -> tuple[list, dict[str, list[float]]]:
        scores, extra_metrics = result
        scores = list(scores)
        if len(scores) != n:
            raise RewardError(
                f"reward function {_name(self.fn)} returned {len(scores)} scores for {n} responses; "
                "fix: return one float per response"
            )
        return scores, dict(extra_metrics)

    def _score_one_by_one(self, prompts, responses, references, extras, batch_error):
        scores, extra_metrics, failed = [], defaultdict(list), 0
        timeouts_in_a_row, batch_timed_out = 0, isinstance(batch_error, TimeoutError)
        for i in range(len(responses)):
            self._scored = i  # for the console line of a long call
            # Hung, not slow on one sample: the rest would hang too.
            if batch_timed_out and timeouts_in_a_row == TIMEOUTS_BEFORE_GIVING_UP:
                self._give_up(i, prompts, responses)
                scores.extend([0.0] * (len(responses) - i))
                break
            try:
                one, metrics = self._checked(
                    call_with_deadline(
                        lambda: self._call([prompts[i]], [responses[i]], [references[i]], [extras[i]]), self.timeout_s
                    ),
                    1,
                )
            except KeyboardInterrupt as interrupt:
                if not raised_by_code(interrupt):
                    raise
                raise self._interrupted(f"on sample {i} (prompt {_clip(prompts[i], 80)!r})") from interrupt
            except Exception as e:
                self._sample_failed(i, prompts, responses, e)
                timeouts_in_a_row = timeouts_in_a_row + 1 if isinstance(e, TimeoutError) else 0
                failed += 1
                scores.append(0.0)
                continue
            timeouts_in_a_row = 0
            scores.extend(one)
            for k, v in metrics.items():
                extra_metrics[k].extend(v)
        if responses and not failed and not isinstance(batch_error, TimeoutError):  # a slow batch, fine one by one
            raise RewardError(
                f"reward function {_name(self.fn)} raised on the batch of {len(responses)} but on no single "
                f"sample: {type(batch_error).__name__}: {batch_error}; fix: make it work on whole batches"
            )
        return scores, extra_metrics

    def _give_up(self, first: int, prompts, responses) -> None:
        """After the batch and TIMEOUTS_BEFORE_GIVING_UP samples in a row ran past the limit, samples `first`... of
        this call are scored as reward.on_error says (0, counted as timeouts) without calling the function: a hung
        function (a remote judge that is down) would otherwise cost timeout_s for every sample of every call."""
        rest = len(responses) - first
        log.warning(
            "reward: the batch and then %d samples in a row ran past reward.timeout_s=%gs: the reward function looks "
            "hung (a remote service down?); the other %d samples of this call score 0 without being scored "
            "(reward.on_error=zero, counted as timeouts)",
            TIMEOUTS_BEFORE_GIVING_UP,
            self.timeout_s,
            rest,
        )
        for i in range(first, len(responses)):
            self._sample_failed(
                i, prompts, responses, TimeoutError("not scored: the function hung on the samples before it")
            )

    def _score_in_workers(self, prompts, responses, references, extras):
        outcomes = self.pool.run(list(zip(prompts, responses, references, extras)))
        given_up = sum(status == "given up" for status, _ in outcomes)
        if given_up and self.on_error != "raise":  # (raise stops at the first timeout, naming it)
            log.warning(
                "reward: %d samples in a row ran past reward.timeout_s=%gs in the reward workers: the reward function "
                "looks hung (a remote service down?); the other %d samples of this call score 0 without being scored "
                "(reward.on_error=zero, counted as timeouts)",
                TIMEOUTS_BEFORE_GIVING_UP,
                self.timeout_s,
                given_up,
            )
        scores, extra_metrics = [], defaultdict(list)
        for i, (status, payload) in enumerate(outcomes):
            if status == "ok":
                one, metrics = payload
                if len(one) == 1:
                    scores.append(one[0])
                    for k, v in metrics.items():
                        extra_metrics[k].extend(v)
                    continue
                failure, timed_out = RewardError(f"returned {len(one)} scores for 1 response"), False
            elif status == "error":
                name, message, timed_out = payload
                if name == "KeyboardInterrupt":  # (the workers ignore SIGINT: raised by the function's code)
                    raise self._interrupted(f"on sample {i} (prompt {_clip(prompts[i], 80)!r}, in a reward worker)")
                failure = (_Timeout if timed_out else RewardError)(f"{name}: {message}")
            else:
                timed_out = status in ("timeout", "given up")
                failure = (_Timeout if timed_out else RewardError)(payload)
            self._sample_failed(i, prompts, responses, failure, timed_out=timed_out)
            scores.append(0.0)
        return scores, extra_metrics

    def _interrupted(self, where: str) -> RewardError:
        """The error for a KeyboardInterrupt that the reward function's code raised (`signals.raised_by_code`): it
        asked to stop, so the run stops as at an error, whatever reward.on_error says, naming it; a Ctrl-C stops the
        run through lit_ppo.preemption instead, with a checkpoint."""
        return RewardError(
            f"reward function {_name(self.fn)} raised KeyboardInterrupt {where}, which no Ctrl-C sent (lit-ppo "
            "handles Ctrl-C itself, stopping at a safe point with a checkpoint): the run stops here whatever "
            "reward.on_error says; fix: raise an Exception for a sample it cannot score (reward.on_error decides "
            "then), or stop the run with a signal"
        )

    def _sample_failed(self, i: int, prompts, responses, error: Exception, *, timed_out: bool | None = None) -> None:
        if timed_out is None:
            timed_out = isinstance(error, TimeoutError)
        if self.on_error == "raise":
            what = f"{type(error).__name__}: {error}" if not isinstance(error, (_Timeout, RewardError)) else str(error)
            raise RewardError(
                f"reward function {_name(self.fn)} {'timed out' if timed_out else 'failed'} on sample {i} "
                f"(prompt {_clip(prompts[i])!r}, response {_clip(responses[i])!r}): {what}; fix: correct the function, "
                "or set reward.on_error=zero to score such samples 0"
            ) from error
        if timed_out:
            self.timeouts += 1
        else:
            self.errors += 1
        log.info(
            "reward: sample %d %s and scores 0 (prompt %r, response %r): %s",
            i,  # run.log only: one per sample
            "timed out" if timed_out else "failed",
            _clip(prompts[i], 80),
            _clip(responses[i], 80),
            error,
            extra={"console": False},
        )


def _is_finite_number(x) -> bool:
    """A real number (bool included) that is finite. Text is not one: float("1.0") would take the string "1.0"
    from a function that formats its scores, and "0.5 " or "1,0" next time."""
    if not isinstance(x, numbers.Real):
        item = getattr(x, "item", None)  # a 0-d tensor or NumPy array holds one number
        if getattr(x, "ndim", None) != 0 or item is None:
            return False
        x = item()
        if not isinstance(x, numbers.Real):
            return False
    return math.isfinite(float(x))


def _clip(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"
