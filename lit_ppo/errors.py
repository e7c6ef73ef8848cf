"""Every error a user can act on, under one base `UserError`; `train.py` prints any of them as one line.

Each keeps the built-in base it had (ValueError for bad settings and data, RuntimeError for what went wrong
while running), so code that catches those still does.
"""


class UserError(Exception):
    """A mistake or a condition the user can fix; the message is one line naming the place and the fix."""


class ConfigError(UserError, ValueError):
    """A setting the user can fix; the message is one line naming the keys, values and fix."""


class DataError(UserError, ValueError):
    """Bad input data; the message names the file and the line or record."""


class RewardError(UserError, RuntimeError):
    """The reward function failed or returned something unusable; the message names the sample."""


class StepAccountingError(UserError, RuntimeError):
    """The run did something other than what the plan said."""


class NonFiniteUpdatesError(UserError, RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


class DynamicSamplingShortfallError(UserError, RuntimeError):
    """Dynamic sampling found too few prompt groups with differing rewards (ppo.dynamic_sampling.on_shortfall=stop)."""


class RolloutMismatchError(UserError, RuntimeError):
    """The trainer's log-probs of the sampled tokens are far from the sampler's: it trains on other data than it thinks."""


class EnvironmentFailure(UserError, RuntimeError):
    """An episode's environment raised or timed out (reward.on_error=raise); the message names the episode."""


class WaitTimeoutError(UserError, RuntimeError):
    """A wait ran past its limit (a collective, the engine's start); the message names what was waited for and the
    setting to raise (lit_ppo/waits.py)."""


class WeightSyncError(UserError, RuntimeError):
    """The rollout engine does not serve the weights the trainer pushed (a LoRA adapter version missing or stale)."""
