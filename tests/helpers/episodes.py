"""A calculator environment that makes multi-turn episodes with a random policy (tests/rollout/test_tool_training.py,
test_hf_engine.py)."""

from __future__ import annotations

from lit_ppo.environments import CalculatorEnvironment


class DigitCallCalculator(CalculatorEnvironment):
    """A calculator whose every turn but the third is a tool call (observation `=<n>;` with n the turn's length),
    so a random policy makes 3-turn episodes."""

    def reset(self, record):
        self.turn = 0
        return super().reset(record)

    def step(self, action):
        self.turn += 1
        if self.turn < 3:
            return f"={len(action)};", 0.0, False, {"tool_call": True}
        return None, float(len(action) % 2), True, {"tool_call": False, "correct": float(len(action) % 2)}


ENVIRONMENT = {"_target_": "tests.helpers.episodes.DigitCallCalculator", "call_end": ";"}


class FlakyCalculator(DigitCallCalculator):
    """DigitCallCalculator whose second step fails in some episodes, chosen by the prompt (so a colocated run and a
    rollout worker fail the same ones): it raises where the prompt's digits sum to 0 mod 3, hangs for `hang_s` where
    they sum to 1 mod 3 (beyond rollout.episodes.environment_timeout_s: a timeout), and answers otherwise."""

    def __init__(self, hang_s: float = 5.0, **kwargs):
        super().__init__(**kwargs)
        self.hang_s = hang_s

    def reset(self, record):
        self.kind = sum(int(c) for c in record["prompt"] if c.isdigit()) % 3
        return super().reset(record)

    def step(self, action):
        if self.turn == 1 and self.kind == 0:
            raise RuntimeError("the sandbox is down")
        if self.turn == 1 and self.kind == 1:
            import time

            time.sleep(self.hang_s)
        return super().step(action)


FLAKY_ENVIRONMENT = {"_target_": "tests.helpers.episodes.FlakyCalculator", "call_end": ";", "hang_s": 5.0}


class RaisingCalculator(DigitCallCalculator):
    """DigitCallCalculator whose every step raises."""

    def step(self, action):
        raise RuntimeError("the sandbox is down")


RAISING_ENVIRONMENT = {"_target_": "tests.helpers.episodes.RaisingCalculator", "call_end": ";"}
