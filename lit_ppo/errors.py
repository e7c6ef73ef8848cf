"""Errors raised while training that the user can act on; `train.py` prints them as one line."""


class StepAccountingError(RuntimeError):
    """The run did something other than what the plan said."""


class NonFiniteUpdatesError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


class DynamicSamplingShortfallError(RuntimeError):
    """Dynamic sampling found too few prompt groups with differing rewards (ppo.dynamic_sampling.on_shortfall=stop)."""


class RolloutMismatchError(RuntimeError):
    """The trainer's log-probs of the sampled tokens are far from the sampler's: it trains on other data than it thinks."""
