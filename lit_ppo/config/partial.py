"""The `rollout.partial` section: partial rollouts (docs/async.md), a response generated over several rollout steps,
each step at most `step_tokens` new tokens of it, continued by the policy of the step; its checks, alone
(`validate_partial`) and against the rest of the run (`validate_partial_in_run`: what partial rollouts do not compose
with yet, refused in one line before any model loads)."""

from __future__ import annotations

from dataclasses import dataclass

from lit_ppo.config.parse import positive
from lit_ppo.errors import ConfigError

AT_MAX_AGE = ("finish", "drop")  # rollout.partial.at_max_age


@dataclass(frozen=True)
class PartialConfig:
    """`rollout.partial`: partial rollouts (docs/async.md); step_tokens null: off, every response whole in its step."""

    step_tokens: int | None = None
    """New tokens per sample and rollout step at most; a sample that has not ended is carried to the next step and
    continued there by that step's policy. null: off."""
    max_age_steps: int = 1
    """Rollout steps a prompt group may be carried after the step that started it; at that age `at_max_age`. The
    oldest token a batch holds is then at most this many rollout steps old (the plan states it, the run checks it)."""
    at_max_age: str = "finish"
    """finish: its samples that have not ended are cut there and trained as truncated, and a batch short of finished
    groups is filled with the oldest unfinished, cut; drop: the group is dropped (counted:
    rollout/partial_dropped_groups), and a group never trains cut: a shortfall is filled by continuing the oldest
    unfinished groups within the step, by its policy, until they end."""
    groups_in_flight: int | None = None
    """Prompt groups generated each step at most (the carried, topped up by fresh rounds of rollout_batch_size): a
    multiple of rollout_batch_size, above it and at most rollout_batch_size x (max_age_steps + 1); null: that most.
    The backlog (groups_in_flight - rollout_batch_size) makes a batch lag backlog / rollout_batch_size rollout steps
    behind the step that started it (in steady state, every group of it); a smaller one lags less and cuts (finish)
    or continues within the step (drop) more."""

    @property
    def enabled(self) -> bool:
        return self.step_tokens is not None

    def __post_init__(self) -> None:
        validate_partial(self)


def validate_partial(partial: PartialConfig) -> None:
    """The section's own settings."""
    if partial.step_tokens is not None:
        positive("rollout.partial", step_tokens=partial.step_tokens)
    positive("rollout.partial", max_age_steps=partial.max_age_steps)
    if partial.groups_in_flight is not None:
        positive("rollout.partial", groups_in_flight=partial.groups_in_flight)
    if partial.at_max_age not in AT_MAX_AGE:
        raise ConfigError(f"rollout.partial.at_max_age={partial.at_max_age!r}; fix: use one of {', '.join(AT_MAX_AGE)}")


def groups_in_flight(partial: PartialConfig, rollout_batch_size: int) -> int:
    """The prompt groups generated each step at most (`PartialConfig.groups_in_flight`, null resolved)."""
    most = rollout_batch_size * (partial.max_age_steps + 1)
    return most if partial.groups_in_flight is None else partial.groups_in_flight


def check_groups_in_flight(partial: PartialConfig, rollout_batch_size: int) -> None:
    """A backlog of whole fresh rounds that the carry bound's earliest-deadline schedule can train in time."""
    count, most = partial.groups_in_flight, rollout_batch_size * (partial.max_age_steps + 1)
    if count is not None and (count % rollout_batch_size or not rollout_batch_size < count <= most):
        raise ConfigError(
            f"rollout.partial.groups_in_flight={count} with ppo.rollout_batch_size={rollout_batch_size} and "
            f"max_age_steps={partial.max_age_steps}; fix: a multiple of {rollout_batch_size} from "
            f"{2 * rollout_batch_size} to {most}, or null ({most})"
        )


def response_budget(rollout) -> tuple[int, str]:
    """(a response's tokens at most, the setting that says so) of `rollout` (a RolloutConfig): with tool episodes
    the episode's (turns and observations; the cut counts the policy's tokens only, so the chunks reach it too)."""
    if rollout.episodes.environment is not None:
        return rollout.episode_tokens(), "rollout.episodes.max_tokens"
    return rollout.max_response_tokens, "rollout.max_response_tokens"


def partial_refusals(config) -> list[str]:
    """What `config` (a RunConfig, not imported here) sets that partial rollouts do not compose with yet: each
    `setting (why)`, in the order docs/async.md lists them."""
    rollout, ppo = config.rollout, config.ppo
    refused = [
        (
            rollout.mode == "disaggregated" and rollout.staleness() > 1,
            f"rollout.max_staleness={rollout.staleness()} (chunk s continues the groups step s - 1 left, known once "
            "chunk s - 1 is back: at k >= 2 the trainer would wait for it, no more overlap than k = 1; use k <= 1)",
        ),
        (
            rollout.mode == "disaggregated" and rollout.engine != "vllm",
            f"rollout.engine={rollout.engine} with rollout workers (not run; colocated, it continues a sample)",
        ),
        (
            rollout.mode == "disaggregated" and config.model.lora.enabled,
            "model.lora with rollout workers (not run; colocated, each chunk's adapter is checked)",
        ),
        (
            rollout.mode == "disaggregated" and rollout.episodes.environment is not None,
            "rollout.episodes.environment with rollout workers (a carried episode's environment lives in the trainer; "
            "colocated, it is carried)",
        ),
        (
            ppo.dynamic_sampling.enabled,
            "ppo.dynamic_sampling (a group's rewards exist once its last sample ends: its filter, refill rounds and "
            "round counts across carried groups are not built)",
        ),
        (
            config.strategy.context_parallel_size > 1,
            f"strategy.context_parallel_size={config.strategy.context_parallel_size} (not run)",
        ),
        (
            rollout.mode == "disaggregated" and config.strategy.devices * config.strategy.num_nodes > 1,
            "rollout workers with more than one trainer rank (not run; colocated, each rank generates its share)",
        ),
        (
            rollout.episodes.environment is not None and config.strategy.devices * config.strategy.num_nodes > 1,
            "rollout.episodes.environment with more than one trainer rank (not run; single-turn responses: each rank "
            "generates its share)",
        ),
        (ppo.old_logprobs == "rollout", "ppo.old_logprobs=rollout (carried tokens are of older policies)"),
        (ppo.rollout_correction.mode == "none", "ppo.rollout_correction.mode=none (carried tokens need tis or mis)"),
    ]
    return [why for on, why in refused if on]


def validate_partial_in_run(config) -> None:
    """rollout.partial against the rest of the run (a RunConfig): a cut shorter than the response budget, and nothing
    it does not compose with yet (`partial_refusals`)."""
    partial, rollout = config.rollout.partial, config.rollout
    if not partial.enabled:
        return
    budget, name = response_budget(rollout)
    if partial.step_tokens >= budget:
        raise ConfigError(
            f"rollout.partial.step_tokens={partial.step_tokens} >= {name}={budget}: no response is ever cut; fix: a "
            "smaller step_tokens, or null (off)"
        )
    chunks = partial.max_age_steps + 1
    if partial.step_tokens * chunks < budget:
        raise ConfigError(
            f"rollout.partial.step_tokens={partial.step_tokens} x (max_age_steps={partial.max_age_steps} + 1) < "
            f"{name}={budget}: every response would be capped at {partial.step_tokens * chunks} tokens; fix: "
            f"rollout.partial.step_tokens>={-(-budget // chunks)} or rollout.partial.max_age_steps>="
            f"{-(-budget // partial.step_tokens) - 1}"
        )
    check_groups_in_flight(partial, config.ppo.rollout_batch_size)
    refused = partial_refusals(config)
    if refused:
        raise ConfigError(
            f"rollout.partial.step_tokens={partial.step_tokens} does not compose yet with {'; '.join(refused)}; fix: "
            "remove those settings, or rollout.partial.step_tokens=null (docs/async.md, partial rollouts)"
        )
