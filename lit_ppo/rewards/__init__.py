"""Reward functions and the code that calls them safely.

A reward function has this signature (the `reward.fn` config entry names one by dotted path,
with `_partial_: true` so extra keyword arguments can be bound in the YAML):

    def my_reward(prompts: list[str], responses: list[str], references: list[str | None],
                  extras: list[dict]) -> list[float] | tuple[list[float], dict[str, list[float]]]

`prompts` are the prompts as the model saw them (after any chat template), `references` the
reference answers (`data.answer_key`, None without one) and `extras` the `data.extra_keys` fields of
each sample's record. It returns one finite float per response, and optionally extra per-sample
metrics that are logged as `rollout/reward_<name>` means. A callable object works too (see
`SequenceClassifierReward`): leave out `_partial_` and Hydra builds it once from its arguments.

Reward functions written for TRL, verl or OpenRLHF are called as those frameworks call them
(`reward.signature`, `auto` by default: told apart by their parameter names; see `RewardCall`).
With `reward.workers > 0` each sample is scored in a worker process under `reward.timeout_s`
(`RewardWorkers`): a verifier that hangs or kills its process costs that sample, not the run. With the default
`reward.workers=0` each call of the function in this process is cut after `reward.timeout_s` (`waits.call_with_deadline`):
a batch call that runs past it is scored again one sample at a time under the same limit, so the slow samples are
found and count as timeouts; that is serial, so for a verifier that often hangs use workers.
"""

from lit_ppo.errors import RewardError
from lit_ppo.rewards.calling import RewardCall, detect_signature
from lit_ppo.rewards.functions import SequenceClassifierReward, integer_match
from lit_ppo.rewards.math_verifier import math_reward
from lit_ppo.rewards.scorer import COUNT_METRICS, RewardScorer
from lit_ppo.rewards.workers import RewardWorkers

__all__ = [
    "COUNT_METRICS",
    "RewardCall",
    "RewardError",
    "RewardScorer",
    "RewardWorkers",
    "SequenceClassifierReward",
    "detect_signature",
    "integer_match",
    "math_reward",
]
