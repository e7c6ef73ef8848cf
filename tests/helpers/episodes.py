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
