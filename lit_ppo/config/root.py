"""The root of the config: `RunConfig`, which holds every section and checks them against each other (`__post_init__`,
calling each section's module), and its road from Hydra (`from_hydra`: the keys of the last release moved to their new
places, `move_keys` and `moved_overrides`, then every section parsed by `parse_section`)."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Collection, Mapping

from lit_ppo.config.data import DataConfig
from lit_ppo.config.distill import check_teacher_waits_fit_collectives, validate_distill
from lit_ppo.config.episodes import EpisodesConfig
from lit_ppo.config.hf import HFConfig
from lit_ppo.config.model import ModelConfig
from lit_ppo.config.parse import parse_section
from lit_ppo.config.partial import validate_partial_in_run
from lit_ppo.config.ppo import PPOConfig
from lit_ppo.config.reward import RewardConfig, check_overlong_buffer
from lit_ppo.config.rollout import RolloutConfig, validate_rollout_engine, validate_rollout_mode
from lit_ppo.config.strategy import StrategyConfig, validate_context_parallel
from lit_ppo.config.trainer import LoggerConfig, TrainerConfig
from lit_ppo.config.vllm import VLLMConfig
from lit_ppo.config.workers import WorkersConfig, check_worker_waits_fit_collectives, validate_launch_in_run
from lit_ppo.errors import ConfigError

MODES = ("train", "plan", "eval")


@dataclass(frozen=True)
class RunConfig:
    """The whole run's settings: conf/config.yaml's root keys and one typed section per config group."""

    mode: str = "train"
    """train; plan (print and save the step plan, load nothing); or eval (evaluate the model on the held-out prompts,
    no training: lit_ppo/run/evaluate.py)."""
    seed: int = 0
    output_dir: str | None = None
    """null: Hydra's run directory."""
    cache_dir: str = ".cache/lit_ppo"
    """The tiny model and the warm start, reused across runs."""
    verbose: bool = False
    resume: str | None = None
    """null: start fresh; auto: continue from the latest checkpoint in output_dir; or a .ckpt path."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r}; fix: use mode=train, mode=plan or mode=eval")
        validate_rollout_engine(self.rollout, self.strategy)
        validate_context_parallel(
            self.strategy,
            disaggregated=self.rollout.mode == "disaggregated",
            tensor_parallel_size=self.rollout.tensor_parallel_size,
        )
        validate_distill(
            self.ppo.distill,
            estimator=self.ppo.advantage_estimator,
            teacher=self.model.teacher,
            n_samples_per_prompt=self.ppo.n_samples_per_prompt,
            temperature=self.rollout.temperature,
            top_p=self.rollout.top_p,
        )
        check_teacher_waits_fit_collectives(
            self.model.teacher, self.strategy.devices * self.strategy.num_nodes, self.trainer.collective_timeout_s
        )
        check_overlong_buffer(self.reward.overlong_buffer_tokens, self.rollout.response_budget_tokens())
        validate_rollout_mode(self.rollout, self.ppo, self.strategy)  # before mode=null is resolved: its errors
        validate_partial_in_run(self)  # (likewise)
        if self.rollout.mode == "disaggregated":  # the rollout workers against the rest of the run
            workers, data_parallel_size = self.rollout.workers, self.strategy.data_parallel_size
            validate_launch_in_run(
                workers,
                engine=self.rollout.engine,
                tensor_parallel_size=self.rollout.tensor_parallel_size,
                environment=self.rollout.episodes.environment is not None,
                lora=self.model.lora.enabled,
                data_parallel_size=data_parallel_size,
            )
            check_worker_waits_fit_collectives(workers, data_parallel_size, self.trainer.collective_timeout_s)
        # then name what the user set (e.g. k > 0 with ppo.old_logprobs=rollout), not a tis they never wrote
        correction = self.ppo.rollout_correction
        if correction.mode is None:  # by the rollout mode: on for samples of an older policy (docs/async.md)
            resolved = dataclasses.replace(
                self.ppo, rollout_correction=correction.resolved(self.rollout.oldest_token_steps())
            )
            object.__setattr__(self, "ppo", resolved)  # replace() validated it again

    @classmethod
    def from_hydra(cls, cfg, command_line: Collection[str] = ()) -> RunConfig:
        """The typed settings of a composed Hydra config (a `DictConfig`), or ConfigError naming the first bad key.
        `command_line`: the keys the command line set (`move_keys`)."""
        from omegaconf import OmegaConf

        values = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
        values.pop("hydra", None)  # Hydra's own node, when a caller composed with return_hydra_config=True
        values = move_keys(values, command_line=command_line)  # rollout keys of the last release, announced
        return parse_section(cls, values, "")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# The rollout keys that moved into rollout.episodes, rollout.workers and each engine's own section (rollout.vllm,
# rollout.hf): old key -> new key. For one release the old
# keys still work, on the command line (train.py: `moved_override`) and in YAML (`RunConfig.from_hydra`:
# `move_keys`), each announced in one line.
MOVED_KEYS = {
    "rollout.environment": "rollout.episodes.environment",
    "rollout.max_turns": "rollout.episodes.max_turns",
    "rollout.max_episode_tokens": "rollout.episodes.max_tokens",
    "rollout.environment_timeout_s": "rollout.episodes.environment_timeout_s",
    "rollout.observation_role": "rollout.episodes.observation_role",
    "rollout.episode_reward": "rollout.episodes.reward",
    "rollout.check_token_ids": "rollout.episodes.check_token_ids",
    "rollout.workers": "rollout.workers.count",
    "rollout.devices": "rollout.workers.devices",
    "rollout.worker_launch": "rollout.workers.launch",
    "rollout.worker_port": "rollout.workers.port",
    "rollout.trainer_host": "rollout.workers.trainer_host",
    "rollout.worker_start_timeout_s": "rollout.workers.start_timeout_s",
    "rollout.worker_heartbeat_timeout_s": "rollout.workers.heartbeat_timeout_s",
    "rollout.batch_timeout_s": "rollout.workers.batch_timeout_s",
    "rollout.weight_push_timeout_s": "rollout.workers.weight_push_timeout_s",
    "rollout.weight_push_bucket_mib": "rollout.workers.weight_push_bucket_mib",
    "rollout.gpu_memory_utilization": "rollout.vllm.gpu_memory_utilization",
    "rollout.kv_cache_gib": "rollout.vllm.kv_cache_gib",
    "rollout.enforce_eager": "rollout.vllm.enforce_eager",
    "rollout.sleep_between_steps": "rollout.vllm.sleep_between_steps",
    "rollout.hf_max_batch_sequences": "rollout.hf.max_batch_sequences",
}
MOVED_SECTIONS = {"episodes": EpisodesConfig, "workers": WorkersConfig, "vllm": VLLMConfig, "hf": HFConfig}
_announced: set[str] = set()  # the moved keys already announced in this process


def announce_moved(old: str) -> None:
    """One line, once per process and key: the key moved, the old one works for this release."""
    if old not in _announced:
        _announced.add(old)
        print(
            f"warning: {old} moved to {MOVED_KEYS[old]}; the old key works for this release only (fix: write "
            f"{MOVED_KEYS[old]})",
            file=sys.stderr,
            flush=True,
        )


def moved_override(override: str) -> str:
    """A command-line override with a moved key (MOVED_KEYS) written with its new key, announced; others as they are.
    `rollout.worker_launch=external` -> `rollout.workers.launch=external`, `+rollout.environment._target_=x.Env` ->
    `+rollout.episodes.environment._target_=x.Env`."""
    sign = override[: len(override) - len(override.lstrip("+~"))]
    key, eq, value = override[len(sign) :].partition("=")
    for old, new in MOVED_KEYS.items():
        if key == old or key.startswith(old + "."):
            # rollout.workers.count is the new key itself, not the old rollout.workers with a .count under it
            if old == "rollout.workers" and key != old:
                return override
            announce_moved(old)
            return f"{sign}{new}{key[len(old) :]}{eq}{value}"
    return override


def moved_overrides(overrides: list[str]) -> list[str]:
    """The command line's overrides, each moved key written with its new key (`moved_override`). One setting given
    under its old key and its new key with two values is refused in one line: Hydra would keep the later silently."""
    rewritten = [moved_override(override) for override in overrides]
    given: dict[tuple[str, bool], tuple[str, str]] = {}  # (new key, under its old key) -> (override as given, value)
    for as_given, override in zip(overrides, rewritten):
        key, eq, value = override.lstrip("+").partition("=")
        if not eq or override.startswith(("~", "-")):
            continue
        moved = as_given != override
        given[key, moved] = (as_given, value)
        other = given.get((key, not moved))
        if other is not None and other[1] != value:
            old, new = (as_given, other[0]) if moved else (other[0], as_given)
            raise ConfigError(
                f"{old} and {new} give {key} two values ({old.lstrip('+').partition('=')[0]} is its old key); fix: "
                f"give it once, as {key}=<value>"
            )
    return rewritten


def move_keys(values: dict, announce: bool = True, command_line: Collection[str] = ()) -> dict:
    """The composed config's values with each moved key (MOVED_KEYS) in its new place, announced (`announce`: not
    for a config the run wrote itself, a checkpoint's config.yaml); a key set in both places is refused in one line.
    `command_line`: the keys the command line set (its old keys already moved, `moved_overrides`), whose values win
    over a YAML's old key as over any YAML value."""
    rollout = values.get("rollout")
    if not isinstance(rollout, Mapping):
        return values
    rollout = dict(rollout)
    for old, new in MOVED_KEYS.items():
        name = old.split(".", 1)[1]
        if name not in rollout or (name == "workers" and isinstance(rollout[name], Mapping)):
            continue
        section, new_name = new.split(".")[1:]
        value = rollout.pop(name)
        nested = dict(rollout.get(section) or {}) if name != section else {}
        default = {f.name: f.default for f in dataclasses.fields(MOVED_SECTIONS[section])}[new_name]
        if any(key == new or key.startswith(new + ".") for key in command_line):
            value = nested.get(new_name, default)  # the command line's
        elif nested.get(new_name, default) not in (default, value):  # (the new key at its default: not set)
            raise ConfigError(f"{old}={value!r} and {new}={nested[new_name]!r} are both set; fix: keep only {new}")
        if announce:
            announce_moved(old)
        rollout[section] = {**nested, new_name: value}
    return {**values, "rollout": rollout}
