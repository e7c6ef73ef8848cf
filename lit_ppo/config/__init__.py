"""The typed settings of a run: one frozen dataclass per config section, each in its own module with its checks
beside it, and `RunConfig` (root.py), which holds them all.

`RunConfig.from_hydra` is the only road from Hydra into the code: it parses every section of the composed config,
refuses unknown keys in one line (`parse_section`, parse.py), reads every value as its field's type and checks it
against the range beside the field (`lit_ppo/config_fields.py`: `ppo.packing=off` is false,
`rollout.max_response_tokens=8.5` is refused), and each dataclass validates itself in `__post_init__`, so a
`RunConfig` that exists is a valid one. Below the entry point nothing reads a `DictConfig`; the `_target_` nodes that
Hydra instantiates (`reward.fn`, `strategy.lightning`, `logger.extra`, `rollout.episodes.environment`) travel as plain
dicts. The dataclasses' defaults equal the default YAML files in conf/ (tests/test_config.py checks it). `compute_plan`
(lit_ppo/plan/) turns a `RunConfig` into the step plan; this package imports nothing of the plan.

The modules, each section's dataclass beside its checks: parse.py (reading a section, `positive`), ppo.py, rollout.py
with its sub-sections episodes.py, workers.py (`rollout.workers.launch` is checked there alone) and each engine's own
settings (vllm.py, hf.py: `rollout.vllm`, `rollout.hf`, the sections the engine registry's rows name), model.py, data.py,
reward.py, distill.py (`model.teacher`, `ppo.distill`), strategy.py, trainer.py (and `logger`), root.py (`RunConfig`, the checks between sections, the keys of the
last release moved to their new places), prompt_files.py (a prompt file's records counted for `mode=plan`). Importers
take every name from `lit_ppo.config`; the modules import each other, never this package.
"""

from __future__ import annotations

from lit_ppo.config.data import DataConfig
from lit_ppo.config.distill import (
    DISTILL_REWARD_ESTIMATORS,
    TEACHER_DTYPES,
    DistillConfig,
    TeacherConfig,
    check_teacher_tokenizer,
    tokenizer_mismatch,
    validate_distill,
)
from lit_ppo.config.episodes import EpisodesConfig, validate_episodes
from lit_ppo.config.hf import HFConfig
from lit_ppo.config.model import (
    ATTN_IMPLEMENTATIONS,
    LORA_INITS,
    VLLM_LORA_RANKS,
    LoraConfig,
    ModelConfig,
    TinyModelConfig,
    WarmStartConfig,
    validate_lora,
)
from lit_ppo.config.parse import MISSING, _dataclass_of, _first_missing, close_match_hints, parse_section, positive
from lit_ppo.config.ppo import OLD_LOGPROBS, DynamicSamplingConfig, PPOConfig, RolloutCorrectionConfig, validate_ppo
from lit_ppo.config.prompt_files import count_records, planned_dataset_size
from lit_ppo.config.reward import ON_ERROR, OnError, RewardConfig, check_overlong_buffer
from lit_ppo.config.rollout import (
    ROLLOUT_ENGINES,
    ROLLOUT_MODES,
    SAMPLING_TEMPERATURES,
    RolloutConfig,
    other_engines_settings_set,
    validate_rollout,
    validate_rollout_engine,
    validate_rollout_mode,
)
from lit_ppo.config.root import (
    MODES,
    MOVED_KEYS,
    MOVED_SECTIONS,
    RunConfig,
    announce_moved,
    move_keys,
    moved_override,
    moved_overrides,
)
from lit_ppo.config.strategy import StrategyConfig
from lit_ppo.config.trainer import LoggerConfig, TrainerConfig
from lit_ppo.config.vllm import VLLMConfig
from lit_ppo.config.workers import (
    LOOPBACK_HOSTS,
    WORKER_LAUNCHES,
    WorkersConfig,
    check_worker_waits_fit_collectives,
    validate_launch,
    validate_launch_in_run,
    validate_workers,
)

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "DISTILL_REWARD_ESTIMATORS",
    "DataConfig",
    "DistillConfig",
    "DynamicSamplingConfig",
    "EpisodesConfig",
    "HFConfig",
    "LOOPBACK_HOSTS",
    "LORA_INITS",
    "LoggerConfig",
    "LoraConfig",
    "MISSING",
    "MODES",
    "MOVED_KEYS",
    "MOVED_SECTIONS",
    "ModelConfig",
    "OLD_LOGPROBS",
    "ON_ERROR",
    "OnError",
    "PPOConfig",
    "ROLLOUT_ENGINES",
    "ROLLOUT_MODES",
    "RewardConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "RunConfig",
    "SAMPLING_TEMPERATURES",
    "StrategyConfig",
    "TEACHER_DTYPES",
    "TeacherConfig",
    "TinyModelConfig",
    "TrainerConfig",
    "VLLM_LORA_RANKS",
    "VLLMConfig",
    "WORKER_LAUNCHES",
    "WarmStartConfig",
    "WorkersConfig",
    "_dataclass_of",
    "_first_missing",
    "announce_moved",
    "check_teacher_tokenizer",
    "check_overlong_buffer",
    "check_worker_waits_fit_collectives",
    "close_match_hints",
    "count_records",
    "move_keys",
    "moved_override",
    "moved_overrides",
    "other_engines_settings_set",
    "parse_section",
    "planned_dataset_size",
    "positive",
    "tokenizer_mismatch",
    "validate_distill",
    "validate_episodes",
    "validate_launch",
    "validate_launch_in_run",
    "validate_lora",
    "validate_ppo",
    "validate_rollout",
    "validate_rollout_engine",
    "validate_rollout_mode",
    "validate_workers",
]
