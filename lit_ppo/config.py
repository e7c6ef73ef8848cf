"""The typed settings of a run: one frozen dataclass per config section, and `RunConfig`, which holds them all.

`RunConfig.from_hydra` is the only road from Hydra into the code: it parses every section of the composed config,
refuses unknown keys in one line (`parse_section`), reads every value as its field's type and checks it against the
range beside the field (`lit_ppo/config_fields.py`: `ppo.packing=off` is false, `rollout.max_response_tokens=8.5` is
refused), and each dataclass validates itself in `__post_init__`, so a `RunConfig` that exists is a valid one. Below the entry point nothing reads a `DictConfig`; the `_target_` nodes that
Hydra instantiates (`reward.fn`, `strategy.lightning`, `logger.extra`, `rollout.episodes.environment`) travel as plain dicts.
The dataclasses' defaults equal the default YAML files in conf/ (tests/test_config.py checks it). `compute_plan`
(lit_ppo/plan.py) turns a `RunConfig` into the step plan; this module imports nothing of the plan.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import typing
import urllib.parse
from dataclasses import dataclass, field
from difflib import get_close_matches
from pathlib import Path
from typing import Any, Collection, Literal, Mapping

from lit_ppo.algorithms import (
    ADVANTAGE_ESTIMATORS,
    GROUP_ESTIMATORS,
    KL_ESTIMATORS,
    KL_IN_REWARD_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    ROLLOUT_CORRECTION_LEVELS,
    ROLLOUT_CORRECTION_MODES,
)
from lit_ppo.config_fields import above, at_least, read_field, within
from lit_ppo.errors import ConfigError
from lit_ppo.memory import ModelShape

OLD_LOGPROBS = ("auto", "recompute", "rollout")  # ppo.old_logprobs
SAMPLING_TEMPERATURES = (
    "vLLM samples at most at 2, and below 0.01, greedy 0 included, at another temperature than the trainer divides "
    "the logits by"
)
MISSING = "???"  # Hydra's mark of a value the user must set


def positive(section: str, **values: Any) -> None:
    """Refuse anything but a positive integer, naming the key."""
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(
                f"{section}.{key}={value!r} must be a positive integer; fix: set {section}.{key} to 1 or more"
            )


_positive = positive


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """`ppo.rollout_correction`: weights on the policy loss for the mismatch between vLLM's sampling log-probs and
    the trainer's old log-probs (docs/algorithms.md)."""

    mode: str | None = None
    """none, tis (weight min(rho, tis_cap)) or mis (drop where rho leaves [mis_low, mis_high], else weight rho); null:
    tis where the samples are of an older policy (rollout.mode=disaggregated with max_staleness > 0), none elsewhere
    (`RunConfig` resolves it; a PPOConfig used alone treats null as none)."""

    def active(self) -> bool:
        """Whether the loss is weighted (a mode other than none; null counts as none until resolved)."""
        return self.mode not in (None, "none")

    def resolved(self, staleness_steps: int) -> RolloutCorrectionConfig:
        """mode=null made explicit for a run whose samples are up to `staleness_steps` rollout steps old."""
        if self.mode is not None:
            return self
        return dataclasses.replace(self, mode="tis" if staleness_steps > 0 else "none")

    level: str = "token"
    """token: rho per token; sequence: the geometric mean of the sequence's token ratios, for all its tokens."""
    tis_cap: float = 2.0
    """TIS: the largest weight."""
    mis_low: float = 0.5
    """MIS: tokens (sequences) with rho below this are dropped from the loss."""
    mis_high: float = 2.0
    """MIS: tokens (sequences) with rho above this are dropped from the loss."""


@dataclass(frozen=True)
class DynamicSamplingConfig:
    """`ppo.dynamic_sampling` (DAPO): train only on prompt groups whose rewards differ, generating more rounds of
    prompts until `rollout_batch_size` of them are collected."""

    enabled: bool = False
    max_generation_rounds: int = 3
    """Generation rounds per rollout step at most (the first one included)."""
    prompts_per_round: int | None = None
    """Prompts each round draws from the data (global); null: rollout_batch_size."""
    on_shortfall: Literal["fill", "stop"] = "fill"
    """After max_generation_rounds with fewer informative groups: fill (complete the batch with dropped groups, in
    the order drawn, so the optimizer steps stay as planned) or stop (save a checkpoint and end with a message)."""
    expected_informative_fraction: float = field(default=0.5, metadata=within(0, 1, low_open=True))
    """The share of prompt groups expected to have differing rewards: the plan's expected generation rounds rest on it,
    and under rollout.mode=disaggregated each rollout step is requested ahead with the rounds it then needs
    (ceil(rollout_batch_size / (prompts_per_round x this)), at most max_generation_rounds); more are generated after
    the step's rewards (refill), fewer are given back to the prompt stream."""


@dataclass(frozen=True)
class PPOConfig:
    """The `ppo` config group. Batch sizes carry their unit in the docstring."""

    rollout_batch_size: int = 32
    """Prompts per rollout step (global, over all data-parallel ranks)."""
    n_samples_per_prompt: int = 4
    """Responses generated per prompt."""
    ppo_epochs: int = 1
    """Passes over one rollout batch; each pass reshuffles the mini-batches."""
    train_batch_size: int = 64
    """Samples (responses) per optimizer step (global)."""
    micro_train_batch_size: int = 32
    """Samples per forward/backward on one device."""
    micro_train_max_tokens: int | None = None
    """Padded tokens (prompt + response columns x rows) per forward/backward on one device: each mini-batch is sorted
    by length and cut into micro-batches under this budget (verl's dynamic batch size, OpenRLHF's max_tokens_per_gpu),
    so short samples are not padded to the longest of a fixed-size micro-batch; micro_train_batch_size is then unused
    for splitting. Loss denominators and optimizer steps are unchanged. null: fixed micro_train_batch_size."""
    packing: bool | None = None
    """Padding-free micro-batches: whole samples (prompt + response) laid end to end, position ids restarting at each,
    attention kept within each sample by the model library (transformers' block-diagonal mask from packed position ids,
    flash-attention's varlen kernel), the LM head only where a response token is predicted; micro_train_max_tokens then
    counts real tokens. null: on wherever the model's attention supports packed position ids (the pre-flight reads
    config.json; the plan says which); true: refused where it does not; false: padded rows."""
    shared_prefix: bool | None = None
    """Packed micro-batches with each prompt once: a prompt group's samples in one micro-batch share their prompt's
    tokens (a multi-turn episode's first prompt), each response attending to the prompt and to itself only (a 4-D
    mask; flex attention: a block mask), its position ids going on from the prompt's; log-probs, values and gradients
    are the flat packed layout's (lit_ppo/training/shared_prefix.py). Under data parallelism a group's samples train on
    one rank. null: on where that is exact (packing on, n_samples_per_prompt >= 2, sdpa, eager or flex_attention, no
    sliding window); true: refused where it is not; false: every sample's prompt laid out."""
    old_logprobs: str = "auto"
    """Where the PPO ratio's old log-probs come from. recompute: an experience forward of the actor before the updates;
    auto: skip that forward when the update is exactly on-policy (ppo_epochs=1, one mini-batch per rollout step, no KL
    in the reward, rollout_correction none), where old log-probs equal the training forward's own (ratio 1, the same
    gradient), else recompute; rollout: vLLM's sampling log-probs, never a forward (the ratio is then against the
    sampler, which the clip bounds; rollout_correction must be none)."""
    advantage_estimator: str = "gae"
    """One of gae, reinforce_pp, reinforce_pp_baseline, grpo, dr_grpo, rloo."""
    gamma: float = field(default=1.0, metadata=within(0, 1))
    """Discount per token."""
    lam: float = field(default=0.95, metadata=within(0, 1))
    """GAE lambda."""
    normalize_advantages: bool = True
    """Whiten GAE advantages over the whole rollout batch (global statistics)."""
    clip_ratio_low: float = 0.2
    """Policy ratio may fall to 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """Policy ratio may rise to 1 + clip_ratio_high (DAPO clip-higher when > low)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative advantages; null disables."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus in the actor loss."""
    value_clip: float | None = field(default=0.2, metadata=above(0))
    """Clip range of the new value around the old one; null disables."""
    value_loss_coef: float = field(default=0.5, metadata=at_least(0))
    """Weight of the value loss (the critic has its own optimizer, so this scales its LR)."""
    kl_coef: float = 0.01
    """KL coefficient; 0 removes the reference model."""
    kl_estimator: str = "k1"
    """k1, k2 or k3."""
    kl_mode: str = "reward"
    """reward: subtract kl_coef * KL from each token's reward; loss: add kl_coef * KL to the actor loss."""
    adaptive_kl_target: float | None = field(default=None, metadata=above(0))
    """Target KL per sequence for the adaptive controller; null keeps kl_coef fixed."""
    adaptive_kl_horizon: int = field(default=10000, metadata=at_least(1))
    """Horizon (samples) of the adaptive KL controller."""
    loss_agg_mode: str = "token-mean"
    """token-mean, seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm."""
    actor_lr: float = 2e-4
    """Peak learning rate of the actor."""
    critic_lr: float = 5e-4
    """Peak learning rate of the critic."""
    lr_warmup_ratio: float = 0.0
    """Share of the total optimizer steps spent warming up the LR linearly."""
    lr_schedule: str = "constant"
    """constant or cosine (after warm-up), stepped once per optimizer step."""
    weight_decay: float = field(default=0.0, metadata=at_least(0))
    """AdamW weight decay."""
    max_grad_norm: float = field(default=1.0, metadata=above(0))
    """Gradient clipping by total norm, per optimizer step."""
    shuffle_seed: int = 0
    """Seed of the mini-batch order (reshuffled every PPO epoch)."""
    policy_loss: str = "ppo"
    """ppo (clipped surrogate), gspo (one clipped ratio per sequence) or cispo (clipped IS weight on REINFORCE)."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)

    def __post_init__(self) -> None:
        validate_ppo(self)


ROLLOUT_ENGINES = ("vllm", "hf")  # rollout.engine
ROLLOUT_MODES = ("colocated", "disaggregated")  # rollout.mode
WORKER_LAUNCHES = ("spawn", "external", "server")  # rollout.workers.launch
VLLM_ONLY_SETTINGS = ("gpu_memory_utilization", "kv_cache_gib", "enforce_eager", "sleep_between_steps")
"""rollout.* settings of the vLLM engine alone: rollout.engine=hf runs without them, and the plan names any that a run
set (`vllm_only_settings_set`)."""


@dataclass(frozen=True)
class EpisodesConfig:
    """`rollout.episodes`: multi-turn episodes (docs/environments.md); without an environment, single-turn responses."""

    environment: dict | str | None = None
    """The environment (`_target_`: a class by dotted path, and its arguments), one built per episode
    (lit_ppo/environments.py, docs/environments.md); a dotted path alone is `{_target_: path}` (a class built without
    arguments); null: single-turn responses."""
    max_turns: int = 1
    """With an environment: policy turns per episode at most (a turn is up to rollout.max_response_tokens tokens)."""
    max_tokens: int | None = None
    """With an environment: tokens per episode response (turns and observations) at most; null: max_turns x
    rollout.max_response_tokens."""
    environment_timeout_s: float | None = 60.0
    """With an environment: seconds one reset/step call may take; longer is a failure handled by reward.on_error."""
    observation_role: str = "tool"
    """With data.chat_template=true: the chat role whose turn separators wrap an observation."""
    reward: str = "environment"
    """environment: the sum of the environment's step rewards; reward: reward.fn scores the episode's whole response."""
    check_token_ids: bool = True
    """With an environment: check that the ids the trainer packs are the ids vLLM was given and produced."""

    def __post_init__(self) -> None:
        if isinstance(self.environment, str):  # `rollout.episodes.environment=my_tools.Calculator`: no arguments
            object.__setattr__(self, "environment", {"_target_": self.environment})
        validate_episodes(self)


def validate_episodes(episodes: EpisodesConfig) -> None:
    """The episode budgets and the reward's source."""
    _positive("rollout.episodes", max_turns=episodes.max_turns)
    if episodes.max_tokens is not None:
        _positive("rollout.episodes", max_tokens=episodes.max_tokens)
    if episodes.environment_timeout_s is not None and episodes.environment_timeout_s <= 0:
        raise ConfigError(
            f"rollout.episodes.environment_timeout_s={episodes.environment_timeout_s}; fix: a positive number of "
            "seconds, or null for no limit"
        )
    if episodes.reward not in ("environment", "reward"):
        raise ConfigError(f"rollout.episodes.reward={episodes.reward!r}; fix: use environment or reward")
    if episodes.environment is None and episodes.max_turns > 1:
        raise ConfigError(
            f"rollout.episodes.max_turns={episodes.max_turns} without rollout.episodes.environment: nothing answers the "
            "policy between turns; fix: set rollout.episodes.environment._target_ (docs/environments.md) or max_turns=1"
        )


@dataclass(frozen=True)
class WorkersConfig:
    """`rollout.workers`: the rollout worker processes of rollout.mode=disaggregated (docs/async.md)."""

    count: int = 1
    """Rollout worker processes; each generates a contiguous share of every batch."""
    devices: int = 1
    """On GPUs: devices per rollout worker, the ones after the trainer's (CUDA_VISIBLE_DEVICES); 0: the workers share
    the trainer's first device (one GPU for both: the worker's model and generation then count on the trainer's
    device in `mode=plan`'s estimate)."""
    launch: str = "spawn"
    """spawn: the trainer starts its workers itself, on its own node; external: the user's launcher starts them, on
    any node (`python -m lit_ppo.rollout.workers --connect HOST:PORT`, docs/async.md), and the trainer waits for
    them to connect; server: the workers are vLLM servers (`vllm serve`), given by `server_urls` or spawned by the
    trainer (lit_ppo/rollout/workers/servers.py)."""
    server_urls: list[str] = field(default_factory=list)
    """With launch=server: the servers' URLs (http://host:port), started outside the trainer as docs/async.md says;
    empty: the trainer spawns `count` servers on free ports of its node."""
    port: int = 29600
    """With launch=external: the TCP port of the trainer's store that the workers connect to (spawn: any free port)."""
    trainer_host: str | None = None
    """The trainer's address that the workers connect to (and that its end of the weight push binds); null:
    LIT_PPO_ROLLOUT_HOST, else 127.0.0.1 with launch=spawn and this node's hostname with external."""
    start_timeout_s: float = 600.0
    """Seconds a rollout worker may take to start its engine (external: to connect too)."""
    heartbeat_timeout_s: float = 60.0
    """With launch=external: a worker whose heartbeat (one a second, through the store) stops for this long is dead
    (spawned workers are watched as processes)."""
    batch_timeout_s: float = 600.0
    """Seconds the trainer waits for a rollout worker's batch beyond the worker's own queue."""
    weight_push_timeout_s: float = 300.0
    """Seconds one bucket of the weight push may take."""
    weight_push_bucket_mib: int = 256
    """The weight push is streamed in buckets of at most this many MiB (one larger tensor is a bucket of its own)."""

    def __post_init__(self) -> None:
        validate_workers(self)

    def trainer_address_host(self) -> str:
        """The host part of the address the rollout workers connect to: `trainer_host`, else LIT_PPO_ROLLOUT_HOST,
        else 127.0.0.1 (spawn: the workers are on this node) or this node's hostname (external)."""
        if self.trainer_host:
            return self.trainer_host
        if os.environ.get("LIT_PPO_ROLLOUT_HOST"):
            return os.environ["LIT_PPO_ROLLOUT_HOST"]
        return socket.gethostname() if self.launch == "external" else "127.0.0.1"


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def validate_workers(workers: WorkersConfig) -> None:
    """The workers' count, launch, port and timeouts."""
    _positive("rollout.workers", count=workers.count)
    if not isinstance(workers.devices, int) or isinstance(workers.devices, bool) or workers.devices < 0:
        raise ConfigError(
            f"rollout.workers.devices={workers.devices!r} must be a whole number >= 0; fix: devices per worker after "
            "the trainer's (e.g. 1), or 0 to share the trainer's first device"
        )
    _positive("rollout.workers", weight_push_bucket_mib=workers.weight_push_bucket_mib)
    if workers.launch not in WORKER_LAUNCHES:
        raise ConfigError(
            f"rollout.workers.launch={workers.launch!r} is unknown; fix: use one of {', '.join(WORKER_LAUNCHES)}"
        )
    port = workers.port
    if workers.launch == "external" and (not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536):
        raise ConfigError(
            f"rollout.workers.port={port!r} with rollout.workers.launch=external must be a TCP port (1..65535) that "
            "the workers connect to; fix: e.g. rollout.workers.port=29600"
        )
    urls = list(workers.server_urls or [])
    if urls and workers.launch != "server":
        raise ConfigError(
            f"rollout.workers.server_urls={urls} with rollout.workers.launch={workers.launch}: only vLLM servers are "
            "given by URL; fix: rollout.workers.launch=server, or rollout.workers.server_urls=[]"
        )
    bad = [url for url in urls if not isinstance(url, str) or not url.startswith(("http://", "https://"))]
    if bad:
        raise ConfigError(f"rollout.workers.server_urls: {bad[0]!r} is not a server's URL; fix: e.g. http://node1:8000")
    if len(set(urls)) != len(urls):
        twice = next(url for url in urls if urls.count(url) > 1)
        raise ConfigError(
            f"rollout.workers.server_urls lists {twice} twice: one server would join the weight push twice; fix: list "
            "each server once"
        )
    if urls and workers.count != len(urls):
        raise ConfigError(
            f"rollout.workers.count={workers.count} with {len(urls)} rollout.workers.server_urls: each server is one "
            f"rollout worker; fix: rollout.workers.count={len(urls)}"
        )
    remote = [url for url in urls if urllib.parse.urlsplit(url).hostname not in LOOPBACK_HOSTS]
    if remote and workers.trainer_address_host() in LOOPBACK_HOSTS:
        raise ConfigError(
            f"rollout.workers.server_urls has {remote[0]}, on another node, but the trainer's address it would be told "
            f"is {workers.trainer_address_host()}; fix: rollout.workers.trainer_host=<this node's name or address>"
        )
    for key in ("start_timeout_s", "heartbeat_timeout_s", "batch_timeout_s", "weight_push_timeout_s"):
        if not getattr(workers, key) > 0:
            raise ConfigError(
                f"rollout.workers.{key}={getattr(workers, key)} must be a positive number of seconds; fix: e.g. 600"
            )


# The rollout keys that moved into rollout.episodes and rollout.workers: old key -> new key. For one release the old
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
}
MOVED_SECTIONS = {"episodes": EpisodesConfig, "workers": WorkersConfig}
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


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = "vllm"
    """vllm: a vLLM engine in this process, the actor's weights synced into it after each rollout step; hf: the actor
    itself generates through Hugging Face generate (lit_ppo/rollout/hf_engine.py: no vLLM, no copy, no sync; not with FSDP)."""
    hf_max_batch_sequences: int | None = None
    """With engine=hf: sequences per generate call at most (a batch's KV cache and logits); null: a call's all."""
    max_response_tokens: int = field(default=8, metadata=at_least(1, "vLLM generates at least one token"))
    """Tokens generated per response at most."""
    temperature: float = field(default=1.0, metadata=within(0.01, 2, why=SAMPLING_TEMPERATURES))
    """vLLM's sampling temperature; the trainer's log-probs (old, reference, new, entropy) use logits / temperature."""
    top_p: float = field(default=1.0, metadata=within(0, 1, low_open=True))
    """< 1: the trainer's log-probs are of the untruncated distribution (the plan warns)."""
    max_logprob_abs_diff: float | None = field(default=0.5, metadata=above(0))
    """Stop the run when the mean |trainer old log-prob - vLLM log-prob| over a rollout step's response tokens
    exceeds this (nats per token): vLLM is not sampling from the actor (a weight sync that failed). Measured
    on the tiny model: ~1e-7 in float32, ~1e-3 in bf16; null disables."""
    dtype: str | None = None
    """vLLM's dtype; None: bfloat16 when strategy.precision computes in bf16, else float32 (`StepPlan.models.rollout_dtype`)."""
    gpu_memory_utilization: float = field(default=0.3, metadata=within(0, 1, low_open=True))
    kv_cache_gib: float = field(default=1, metadata=above(0))
    max_model_len: int = field(default=128, metadata=at_least(2))
    tensor_parallel_size: int = field(default=1, metadata=at_least(1))
    enforce_eager: bool = True
    sleep_between_steps: bool = True
    """Free vLLM's memory while training (GPU only)."""
    eval_samples_per_prompt: int = field(default=4, metadata=at_least(1))
    """k of pass@k in evaluation."""
    eval_temperature: float = field(default=1.0, metadata=within(0.01, 2, why=SAMPLING_TEMPERATURES))
    """Temperature of the pass@k samples (greedy accuracy always uses temperature 0)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a response (kept as its last token, like EOS)."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a response (cut from its text)."""
    stop_at_end_of_turn: bool = True
    """With data.chat_template=true, also stop at the template's end-of-turn token (`end_of_turn_token_ids`)."""
    engine_start_timeout_s: float | None = 1800.0
    """Seconds the vLLM engine's start may take (loading the weights, profiling memory, compiling); past it the run
    stops naming the wait (lit_ppo/waits.py); null: no limit."""
    # Asynchronous rollouts (docs/async.md): rollout workers with their own engines generate while the trainer trains.
    mode: str = "colocated"
    """colocated: vLLM in the trainer's process, generation and training take turns; disaggregated: `workers` rollout
    worker processes, each with its own vLLM engine on its own devices, generate while the trainer trains."""
    max_staleness: int | None = None
    """k: rollout step s is generated by the policy after max(0, s - k) rollout steps (k = 0: the synchronous
    schedule); null: 1 with mode=disaggregated, 0 with colocated."""
    episodes: EpisodesConfig = field(default_factory=EpisodesConfig)
    """Multi-turn episodes (`rollout.episodes.*`): the environment and its budgets."""
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    """With mode=disaggregated, the rollout workers (`rollout.workers.*`): how many, where, their timeouts."""

    def __post_init__(self) -> None:
        validate_rollout(self)

    def staleness(self) -> int:
        """k resolved: `max_staleness`, or its default for the mode (1 disaggregated, 0 colocated)."""
        if self.max_staleness is not None:
            return self.max_staleness
        return 1 if self.mode == "disaggregated" else 0

    def response_budget_tokens(self) -> int:
        """The most tokens one sample's response can have: `max_response_tokens` for a single-turn response, which is
        one turn's budget in an episode, whose whole response (turns and observations) is `episode_tokens()`."""
        return self.episode_tokens() or self.max_response_tokens

    def episode_tokens(self) -> int:
        """The token budget of one episode's response (turns and observations); 0 without an environment."""
        episodes = self.episodes
        if episodes.environment is None:
            return 0
        return episodes.max_tokens or episodes.max_turns * self.max_response_tokens


def validate_rollout(rollout: RolloutConfig) -> None:
    """The engine's name, the rollout mode and its staleness (the episodes' and workers' settings are checked by
    their own dataclasses; the others where they are used)."""
    if rollout.engine not in ROLLOUT_ENGINES:
        raise ConfigError(f"rollout.engine={rollout.engine!r} is unknown; fix: use one of {', '.join(ROLLOUT_ENGINES)}")
    if rollout.hf_max_batch_sequences is not None:
        _positive("rollout", hf_max_batch_sequences=rollout.hf_max_batch_sequences)
    if rollout.engine_start_timeout_s is not None and rollout.engine_start_timeout_s <= 0:
        raise ConfigError(
            f"rollout.engine_start_timeout_s={rollout.engine_start_timeout_s}; fix: a positive number of seconds, "
            "or null for no limit"
        )
    if rollout.mode not in ROLLOUT_MODES:
        raise ConfigError(f"rollout.mode={rollout.mode!r} is unknown; fix: use one of {', '.join(ROLLOUT_MODES)}")
    if rollout.max_staleness is not None and (
        not isinstance(rollout.max_staleness, int)
        or isinstance(rollout.max_staleness, bool)
        or rollout.max_staleness < 0
    ):
        raise ConfigError(
            f"rollout.max_staleness={rollout.max_staleness!r} must be an integer >= 0 (0: synchronous); fix: e.g. 1"
        )
    if rollout.mode == "colocated" and rollout.staleness() > 0:
        raise ConfigError(
            f"rollout.max_staleness={rollout.max_staleness} with rollout.mode=colocated: the engine in the trainer's "
            "process always generates with the newest weights; fix: rollout.mode=disaggregated, or max_staleness=0"
        )


def vllm_only_settings_set(rollout: RolloutConfig) -> list[str]:
    """`key=value` of each vLLM-only setting (VLLM_ONLY_SETTINGS) that differs from its default."""
    defaults = {f.name: f.default for f in dataclasses.fields(RolloutConfig)}
    return [
        f"rollout.{name}={getattr(rollout, name)}"
        for name in VLLM_ONLY_SETTINGS
        if getattr(rollout, name) != defaults[name]
    ]


def close_match_hints(wrong: list[str], names: list[str], prefix: str = "") -> list[str]:
    """`<prefix><wrong> (did you mean <prefix><name>?)` for each wrong name with a close match among `names`."""
    return [
        f"{prefix}{w} (did you mean {prefix}{close[0]}?)"
        for w in wrong
        for close in [get_close_matches(w, names, 1)]
        if close
    ]


def parse_section(cls: type, values: Mapping[str, Any], section: str):
    """Build a config dataclass from a section's values, refusing unknown keys, unset (`???`) values and values that
    their field's type or range does not accept (`config_fields.read_field`: `ppo.packing=maybe`,
    `rollout.max_response_tokens=8.5`) with a one-line message; nested sections (`ppo.rollout_correction`,
    `model.tiny`, ...) are dataclasses too."""
    prefix = f"{section}." if section else ""
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        hints = close_match_hints(unknown, names, prefix)
        raise ConfigError(
            f"{section or 'config'}: unknown key(s) {', '.join(prefix + k for k in unknown)}; fix: remove them"
            + (f" or correct {', '.join(hints)}" if hints else "")
            + f" (the keys of {section or 'the root'}: {', '.join(names)})"
        )
    types = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = dict(values)
    for name, value in values.items():
        missing = _first_missing(value, f"{prefix}{name}")
        if missing:
            raise ConfigError(
                f"{missing} is not set (???); fix: set {missing}=<value> on the command line or in the config"
            )
        nested = _dataclass_of(types[name])
        if nested is not None and isinstance(value, Mapping):
            values[name] = parse_section(nested, value, f"{prefix}{name}")
        else:  # by the field's type and range, so that `__post_init__` sees values of their types
            values[name] = read_field(f"{prefix}{name}", value, types[name], fields[name])
    return cls(**values)


def _dataclass_of(hint) -> type | None:
    """The dataclass of a field's type hint (`X` or `X | None`), else None."""
    if dataclasses.is_dataclass(hint):
        return hint
    candidates = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
    return candidates[0] if len(candidates) == 1 else None


def _first_missing(value, key: str) -> str | None:
    """The first key under `value` still holding Hydra's `???`, else None."""
    if isinstance(value, str) and value == MISSING:
        return key
    if isinstance(value, Mapping):
        for k, v in value.items():
            found = _first_missing(v, f"{key}.{k}")
            if found:
                return found
    return None


def validate_ppo(ppo: PPOConfig) -> None:
    """Checks that do not need the dataset size."""
    _positive(
        "ppo",
        rollout_batch_size=ppo.rollout_batch_size,
        n_samples_per_prompt=ppo.n_samples_per_prompt,
        ppo_epochs=ppo.ppo_epochs,
        train_batch_size=ppo.train_batch_size,
        micro_train_batch_size=ppo.micro_train_batch_size,
    )
    if ppo.advantage_estimator not in ADVANTAGE_ESTIMATORS:
        raise ConfigError(
            f"ppo.advantage_estimator={ppo.advantage_estimator!r} is unknown; fix: use one of {', '.join(ADVANTAGE_ESTIMATORS)}"
        )
    if ppo.advantage_estimator in GROUP_ESTIMATORS and ppo.n_samples_per_prompt < 2:
        raise ConfigError(
            f"ppo.advantage_estimator={ppo.advantage_estimator} compares samples of one prompt but "
            f"ppo.n_samples_per_prompt={ppo.n_samples_per_prompt}; fix: set ppo.n_samples_per_prompt to 2 or more"
        )
    if ppo.kl_estimator not in KL_ESTIMATORS:
        raise ConfigError(
            f"ppo.kl_estimator={ppo.kl_estimator!r} is unknown; fix: use one of {', '.join(KL_ESTIMATORS)}"
        )
    if ppo.kl_mode not in ("reward", "loss"):
        raise ConfigError(f"ppo.kl_mode={ppo.kl_mode!r} is unknown; fix: use 'reward' or 'loss'")
    if ppo.kl_coef < 0:
        raise ConfigError(f"ppo.kl_coef={ppo.kl_coef} is negative; fix: use 0 (no KL) or a positive value")
    if ppo.kl_mode == "reward" and ppo.kl_coef > 0 and ppo.advantage_estimator not in KL_IN_REWARD_ESTIMATORS:
        raise ConfigError(
            f"ppo.advantage_estimator={ppo.advantage_estimator} with ppo.kl_mode=reward: a KL penalty in the reward would "
            "give groups of equal rewards non-zero advantages; fix: set ppo.kl_mode=loss (with ppo.kl_estimator=k3, as "
            "GRPO does) or ppo.kl_coef=0"
        )
    if ppo.loss_agg_mode not in LOSS_AGG_MODES:
        raise ConfigError(
            f"ppo.loss_agg_mode={ppo.loss_agg_mode!r} is unknown; fix: use one of {', '.join(LOSS_AGG_MODES)}"
        )
    if ppo.policy_loss not in POLICY_LOSSES:
        raise ConfigError(f"ppo.policy_loss={ppo.policy_loss!r} is unknown; fix: use one of {', '.join(POLICY_LOSSES)}")
    # CISPO may leave the weight's low side open (low = 1: weight >= 0), as MiniMax-M1 does.
    low_ok = 0 < ppo.clip_ratio_low <= 1 if ppo.policy_loss == "cispo" else 0 < ppo.clip_ratio_low < 1
    if not low_ok or ppo.clip_ratio_high <= 0:
        raise ConfigError(
            f"ppo.clip_ratio_low={ppo.clip_ratio_low}, ppo.clip_ratio_high={ppo.clip_ratio_high}: need 0 < low < 1 "
            "(<= 1 for cispo) and high > 0; fix: e.g. clip_ratio_low=0.2 clip_ratio_high=0.28"
        )
    if ppo.dual_clip is not None and ppo.dual_clip <= 1:
        raise ConfigError(f"ppo.dual_clip={ppo.dual_clip} must be > 1 (e.g. 3.0); fix: set it above 1 or to null")
    if ppo.dual_clip is not None and ppo.policy_loss != "ppo":
        raise ConfigError(
            f"ppo.dual_clip={ppo.dual_clip} bounds the clipped surrogate of policy_loss=ppo, not "
            f"ppo.policy_loss={ppo.policy_loss}; fix: set ppo.dual_clip=null"
        )
    rc = ppo.rollout_correction
    if (rc.mode is not None and rc.mode not in ROLLOUT_CORRECTION_MODES) or rc.level not in ROLLOUT_CORRECTION_LEVELS:
        raise ConfigError(
            f"ppo.rollout_correction.mode={rc.mode!r}, level={rc.level!r}; fix: mode one of "
            f"{', '.join(ROLLOUT_CORRECTION_MODES)} (or null: by rollout.mode), level one of {', '.join(ROLLOUT_CORRECTION_LEVELS)}"
        )
    if rc.mode == "tis" and rc.tis_cap <= 0:
        raise ConfigError(f"ppo.rollout_correction.tis_cap={rc.tis_cap} must be positive; fix: e.g. 2.0")
    if rc.mode == "mis" and not 0 <= rc.mis_low < 1 < rc.mis_high:
        raise ConfigError(
            f"ppo.rollout_correction.mis_low={rc.mis_low}, mis_high={rc.mis_high}: need 0 <= low < 1 < high; "
            "fix: e.g. mis_low=0.5 mis_high=2.0"
        )
    if ppo.old_logprobs not in OLD_LOGPROBS:
        raise ConfigError(
            f"ppo.old_logprobs={ppo.old_logprobs!r} is unknown; fix: use one of {', '.join(OLD_LOGPROBS)}"
        )
    if ppo.old_logprobs == "rollout" and rc.active():
        raise ConfigError(
            f"ppo.old_logprobs=rollout takes vLLM's log-probs as the old ones, so "
            f"ppo.rollout_correction.mode={rc.mode} has no mismatch left to weight (its ratio is 1); fix: set "
            "ppo.rollout_correction.mode=none, or ppo.old_logprobs=recompute to keep the correction"
        )
    if ppo.micro_train_max_tokens is not None:
        _positive("ppo", micro_train_max_tokens=ppo.micro_train_max_tokens)
    ds = ppo.dynamic_sampling
    if ds.enabled:
        if ppo.n_samples_per_prompt < 2:
            raise ConfigError(
                f"ppo.dynamic_sampling.enabled=true drops groups whose rewards are all equal, but "
                f"ppo.n_samples_per_prompt={ppo.n_samples_per_prompt}; fix: set it to 2 or more"
            )
        _positive("ppo.dynamic_sampling", max_generation_rounds=ds.max_generation_rounds)
        if ds.prompts_per_round is not None:
            _positive("ppo.dynamic_sampling", prompts_per_round=ds.prompts_per_round)
        if ds.on_shortfall not in ("fill", "stop"):
            raise ConfigError(f"ppo.dynamic_sampling.on_shortfall={ds.on_shortfall!r}; fix: use 'fill' or 'stop'")
    if ppo.lr_schedule not in ("constant", "cosine"):
        raise ConfigError(f"ppo.lr_schedule={ppo.lr_schedule!r} is unknown; fix: use 'constant' or 'cosine'")
    if not 0 <= ppo.lr_warmup_ratio < 1:
        raise ConfigError(f"ppo.lr_warmup_ratio={ppo.lr_warmup_ratio} must be in [0, 1); fix: e.g. 0.03")
    if ppo.actor_lr <= 0 or ppo.critic_lr <= 0:
        raise ConfigError(
            f"ppo.actor_lr={ppo.actor_lr}, ppo.critic_lr={ppo.critic_lr} must be positive; fix: e.g. 1e-6"
        )


@dataclass(frozen=True)
class TrainerConfig:
    """The `trainer` section: how long the run is (exactly one of the two lengths is set) and what it does on the way."""

    total_rollout_steps: int | None = 30
    """Run length in rollout steps ..."""
    data_epochs: float | None = None
    """... or in passes over the prompts."""
    eval_every: int = field(default=10, metadata=at_least(0))
    """Rollout steps between evaluations (also at the start and the end); 0: none during the run."""
    checkpoint_every: int = field(default=10, metadata=at_least(0))
    """Rollout steps between checkpoints (also at the end); 0: only at the end."""
    keep_checkpoints: int = field(default=2, metadata=at_least(1))
    """The last K checkpoints are kept."""
    max_consecutive_skipped_updates: int = field(default=3, metadata=at_least(1))
    """Non-finite loss or gradient: the update is skipped; the run stops after this many in a row."""
    collective_timeout_s: float = 1800.0
    """Seconds a rank waits for the others in one collective (an all-reduce, the weight sync's gathers, a checkpoint's
    barrier, the process group's start) before the run stops naming the phase it waited in (lit_ppo/waits.py); the
    torch.distributed process group's timeout. Lightning's default; raise it when ranks legitimately drift further
    apart (long evaluations, very uneven generation)."""

    def __post_init__(self) -> None:
        if not isinstance(self.collective_timeout_s, (int, float)) or self.collective_timeout_s <= 0:
            raise ConfigError(
                f"trainer.collective_timeout_s={self.collective_timeout_s!r}; fix: a positive number of seconds"
            )


@dataclass(frozen=True)
class TinyModelConfig:
    """`model.tiny`: the shape of the locally built Qwen2-architecture model (lit_ppo/demo/tiny.py)."""

    hidden_size: int = field(default=128, metadata=at_least(1))
    num_layers: int = field(default=4, metadata=at_least(1))
    num_heads: int = field(default=4, metadata=at_least(1))
    num_kv_heads: int = field(default=2, metadata=at_least(1))
    intermediate_size: int = field(default=384, metadata=at_least(1))
    max_position_embeddings: int = field(default=128, metadata=at_least(2))


@dataclass(frozen=True)
class WarmStartConfig:
    """`model.warm_start`: supervised training of the tiny model on demonstrations before RL (lit_ppo/demo/warmstart.py)."""

    enabled: bool = True
    steps: int = field(default=1500, metadata=at_least(0))
    """Optimizer steps of supervised training."""
    batch_size: int = field(default=64, metadata=at_least(1))
    """Demonstrations per step."""
    lr: float = field(default=1.0e-3, metadata=above(0))
    teacher_accuracy: float = field(default=0.35, metadata=within(0, 1))
    """Share of demonstrations with the right answer; the rest are one too high."""
    tool_call_rate: float | None = field(default=None, metadata=within(0, 1))
    """With an environment: the teacher calls the tool this often and guesses otherwise; null: no tool calls."""
    tool_use_practice: float = field(default=0.0, metadata=at_least(0))
    """With tool_call_rate: further demonstrations of using a call once made."""


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values (vllm/config/lora.py)
LORA_INITS = ("default", "gaussian")  # peft init_lora_weights that leave the base weights untouched


@dataclass(frozen=True)
class LoraConfig:
    """`model.lora`: a PEFT LoRA on the actor (and the critic's body, whose value head stays fully trainable); the base
    weights frozen, the reference model is the actor with its adapter disabled, and only the adapter is synced into
    vLLM (docs/lora.md). Settings vLLM cannot serve are refused here, before any model loads."""

    rank: int = 0
    """The LoRA rank r; 0: no LoRA (full-parameter training)."""
    alpha: float = 16.0
    """The LoRA scaling numerator: the update is (alpha / rank) B A."""
    target_modules: str | list[str] = "all-linear"
    """Linear module names to adapt (e.g. [q_proj, v_proj]; each matches the modules whose name ends with it, as peft
    matches them), or all-linear: every linear layer but the LM head. The pre-flight matches them against the model's
    modules, built from its config.json on the meta device (`preflight.lora_targets`), before any model loads."""
    dropout: float = 0.0
    """Must be 0: the PPO ratio and the comparison with vLLM's log-probs assume a deterministic policy."""
    init: str = "default"
    """peft's init_lora_weights: default (A Kaiming-uniform, B zero) or gaussian; both leave the base untouched."""
    use_dora: bool = False
    """Refused when true: vLLM does not serve DoRA adapters."""
    bias: str = "none"
    """Refused unless none: vLLM does not serve adapter biases."""
    modules_to_save: list[str] = field(default_factory=list)
    """Refused when set: vLLM serves modules_to_save only for classification heads, not on a causal LM."""
    save_merged: bool = False
    """Also save the final policy merged into the base weights as a Hugging Face model (actor_merged/)."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def vllm_max_lora_rank(self) -> int:
        """The smallest max_lora_rank vLLM allows that holds this rank."""
        return next(r for r in VLLM_LORA_RANKS if r >= self.rank)

    def __post_init__(self) -> None:
        validate_lora(self)


def validate_lora(lora: LoraConfig) -> None:
    """Refuse, naming the key, what the adapter-only sync into vLLM cannot serve."""
    if not isinstance(lora.rank, int) or isinstance(lora.rank, bool) or lora.rank < 0:
        raise ConfigError(f"model.lora.rank={lora.rank!r} must be 0 (no LoRA) or a positive integer; fix: e.g. 16")
    if lora.rank > VLLM_LORA_RANKS[-1]:
        raise ConfigError(
            f"model.lora.rank={lora.rank} is above vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]}); "
            f"fix: model.lora.rank={VLLM_LORA_RANKS[-1]} or less"
        )
    if not lora.enabled:
        return
    if lora.alpha <= 0:
        raise ConfigError(f"model.lora.alpha={lora.alpha} must be positive; fix: e.g. model.lora.alpha=2*rank")
    if lora.dropout != 0:
        raise ConfigError(
            f"model.lora.dropout={lora.dropout}: dropout makes the policy random in training but not in vLLM, so the "
            "PPO ratio and the stale-weight check compare different functions; fix: model.lora.dropout=0"
        )
    if lora.use_dora:
        raise ConfigError("model.lora.use_dora=true: vLLM cannot serve DoRA adapters; fix: model.lora.use_dora=false")
    if lora.bias != "none":
        raise ConfigError(f"model.lora.bias={lora.bias}: vLLM cannot serve adapter biases; fix: model.lora.bias=none")
    if lora.modules_to_save:
        raise ConfigError(
            f"model.lora.modules_to_save={list(lora.modules_to_save)}: vLLM serves fully trained modules only for "
            "classification heads, not on the policy; fix: model.lora.modules_to_save=[] (or full fine-tuning, rank=0)"
        )
    if lora.init not in LORA_INITS:
        raise ConfigError(
            f"model.lora.init={lora.init!r}: inits such as pissa, olora or loftq change the base weights, which vLLM "
            f"keeps as loaded; fix: use one of {', '.join(LORA_INITS)}"
        )
    if not lora.target_modules:
        raise ConfigError("model.lora.target_modules is empty; fix: e.g. model.lora.target_modules=all-linear")
    if isinstance(lora.target_modules, str) and lora.target_modules != "all-linear":
        raise ConfigError(
            f"model.lora.target_modules={lora.target_modules!r} is a string, which peft reads as a regular expression "
            "over whole module names (model.layers.0.self_attn.q_proj), not as a module name; fix: a list, "
            f"model.lora.target_modules=[{lora.target_modules}], or all-linear"
        )


@dataclass(frozen=True)
class ModelConfig:
    """The `model` group: the policy (and the critic's and reference's initial weights)."""

    path: str | None = None
    """A local directory (or hub name) of a causal LM; null builds the tiny model."""
    gradient_checkpointing: bool = False
    architecture: ModelShape | None = None
    """The shape for the memory estimate of `mode=plan` where config.json is not on this machine."""
    tiny: TinyModelConfig | None = field(default_factory=TinyModelConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    attn_implementation: str | None = None
    """The attention kernels of the trained models (transformers' `attn_implementation`): null leaves transformers'
    default (sdpa); flash_attention_2 / flash_attention_3 (the flash-attn package) train packed micro-batches in one
    row with per-sample varlen kernels, flex_attention in one row padded to a fixed token budget (the plan's
    row_tokens: compiled once) under a block-sparse mask, where sdpa/eager compute each packed row's attention under a
    block-diagonal mask (lit_ppo/training/packing.py). Checked by the pre-flight before any model loads (flex_attention:
    a GPU, where torch has no flex attention backward on a CPU)."""

    def __post_init__(self) -> None:
        if self.attn_implementation is not None and self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ConfigError(
                f"model.attn_implementation={self.attn_implementation!r} is unknown; fix: null (transformers' default) "
                f"or one of {', '.join(ATTN_IMPLEMENTATIONS)}"
            )


ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


@dataclass(frozen=True)
class DataConfig:
    """The `data` group: the training and held-out prompts (generated arithmetic problems, or the user's files)."""

    source: str = "arithmetic"
    """arithmetic (generated problems) or file."""
    seed: int = 0
    """arithmetic: the problems' seed."""
    max_operand: int = 49
    n_train: int = 2000
    n_eval: int = 200
    operation: str = "+"
    min_operand: int = 0
    path: str | None = None
    """file: the training prompts (JSONL, Parquet or a `datasets` folder)."""
    eval_path: str | None = None
    """file: the held-out prompts; null: no evaluation."""
    prompt_key: str = "prompt"
    answer_key: str | None = "answer"
    extra_keys: list[str] = field(default_factory=list)
    chat_template: bool = False
    system_prompt: str | None = None
    max_prompt_length: int = field(default=32, metadata=at_least(1))
    """Tokens (after the chat template); longer prompts follow bad_records."""
    bad_records: str = "error"
    """error: stop at the first bad record (file and line); skip: drop and count them."""
    expected_prompts: int | None = field(default=None, metadata=at_least(1))
    """mode=plan on a machine without data.path: the number of training prompts."""

    def __post_init__(self) -> None:
        if self.source not in ("arithmetic", "file"):
            raise ConfigError(f"data.source={self.source!r}; fix: use 'arithmetic' or 'file'")
        if self.source == "file" and not self.path:
            raise ConfigError(
                "data.path is not set; fix: data.path=<your prompt file> (JSONL, Parquet or a datasets folder)"
            )
        if self.bad_records not in ("error", "skip"):
            raise ConfigError(f"data.bad_records={self.bad_records!r}; fix: use 'error' or 'skip'")


OnError = Literal["raise", "zero"]  # reward.on_error
ON_ERROR = typing.get_args(OnError)


def check_overlong_buffer(buffer_tokens: int, response_budget_tokens: int) -> None:
    """DAPO's soft overlong shaping (`reward.overlong_buffer_tokens`) ends at the response budget, so it must lie
    within it."""
    if buffer_tokens and not 0 < buffer_tokens < response_budget_tokens:
        raise ConfigError(
            f"reward.overlong_buffer_tokens={buffer_tokens} must lie in (0, {response_budget_tokens}) "
            "(the response budget: rollout.max_response_tokens, or rollout.episodes.max_tokens with an environment); "
            "fix: e.g. a quarter of the budget, or 0 to turn the shaping off"
        )


@dataclass(frozen=True)
class RewardConfig:
    """The `reward` group: the reward function and how it is called (lit_ppo/rewards.py, docs/rewards.md)."""

    fn: dict = field(default_factory=lambda: {"_target_": "lit_ppo.rewards.integer_match", "_partial_": True})
    """The function or callable class by dotted path (`_target_`), built by Hydra."""
    signature: str = "auto"
    """auto | lit_ppo | trl | verl | openrlhf: how to call fn (auto: from its parameter names)."""
    on_error: OnError = "raise"
    """raise: stop naming the sample; zero: score 0 and count it."""
    workers: int = field(default=0, metadata=at_least(0))
    """0: score in this process; N: in N worker processes, one sample at a time each."""
    timeout_s: float | None = field(default=60, metadata=above(0))
    """With workers > 0: seconds per sample before its worker is killed (then on_error); with workers = 0: seconds per
    call, the batch, then each sample alone. Either way the call's rest is not scored after 2 samples in a row time
    out."""
    overlong_penalty: float = 0.0
    """Subtracted from responses that hit the response budget."""
    overlong_buffer_tokens: int = field(default=0, metadata=at_least(0))
    """DAPO soft overlong shaping: 0 off; else a linear penalty over the last N tokens before the response budget."""
    overlong_penalty_factor: float = 1.0
    """... reaching -factor at the response budget."""
    solved_threshold: float = 1.0
    """pass@k: a sample solves its prompt at this reward (a `correct` metric decides where returned)."""


@dataclass(frozen=True)
class StrategyConfig:
    """The `strategy` group: devices, nodes, precision and the Lightning strategy."""

    name: str = "single"
    accelerator: str = "auto"
    devices: int = field(default=1, metadata=at_least(1))
    num_nodes: int = field(default=1, metadata=at_least(1))
    precision: str = "auto"
    """bf16-mixed where the device computes bf16 natively, else 32-true (lit_ppo/precision.py)."""
    device_memory_gib: float | None = field(default=None, metadata=above(0))
    """Memory of one device for the plan's warning; null: detected where a GPU is present."""
    lightning: dict | None = None
    """The Lightning strategy (`_target_` and its arguments), built by Hydra; null: Lightning's choice."""

    @property
    def data_parallel_size(self) -> int:
        return self.devices * self.num_nodes


@dataclass(frozen=True)
class LoggerConfig:
    """The `logger` group: metrics.csv is always written; `extra` is a further Lightning logger (W&B, TensorBoard)."""

    name: str = "csv"
    extra: dict | None = None


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
        check_overlong_buffer(self.reward.overlong_buffer_tokens, self.rollout.response_budget_tokens())
        validate_rollout_mode(self.rollout, self.ppo, self.strategy)  # before mode=null is resolved: its errors
        validate_server_workers(self.rollout, self.model, self.strategy)
        validate_worker_devices(self.rollout, self.strategy)
        check_worker_waits_fit_collectives(self.rollout, self.strategy, self.trainer.collective_timeout_s)
        # then name what the user set (e.g. k > 0 with ppo.old_logprobs=rollout), not a tis they never wrote
        correction = self.ppo.rollout_correction
        if correction.mode is None:  # by the rollout mode: on for samples of an older policy (docs/async.md)
            resolved = dataclasses.replace(self.ppo, rollout_correction=correction.resolved(self.rollout.staleness()))
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


def count_records(path: Path) -> int:
    """Records in a prompt file without tokenizing them (for `mode=plan`)."""
    if path.suffix in (".jsonl", ".json"):
        with open(path, encoding="utf-8") as f:
            return sum(1 for line in f if line.strip())
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    import datasets

    return len(datasets.load_from_disk(str(path)))


def planned_dataset_size(data: DataConfig, prompt_stats=None) -> tuple[int, str]:
    """The number of training prompts: those the pre-flight read as the run reads them (`prompt_stats`, a
    plan.PromptStats: bad records and prompts over data.max_prompt_length left out under data.bad_records=skip),
    else the records of data.path, known before loading any model or tokenizer."""
    if data.source == "arithmetic":
        return data.n_train, "generated arithmetic problems"
    path = Path(data.path)
    if prompt_stats is not None:
        return prompt_stats.count, f"prompts in {path} as the run reads them"
    if path.exists():
        return count_records(path), f"records in {path} (before length filtering)"
    if data.expected_prompts:
        return data.expected_prompts, f"data.expected_prompts ({path} is not on this machine)"
    raise ConfigError(
        f"data.path={path} does not exist; fix: point data.path at your prompt file (or set data.expected_prompts for mode=plan)"
    )


def validate_rollout_engine(rollout: RolloutConfig, strategy: StrategyConfig) -> None:
    """rollout.engine=hf against the strategy and its precision."""
    from lit_ppo.precision import resolve_precision, resolve_rollout_dtype

    if rollout.engine != "hf":
        return
    precision = resolve_precision(strategy.precision, strategy.accelerator)
    target = str((strategy.lightning or {}).get("_target_") or "")
    sharded = strategy.name == "fsdp" or target.endswith(("ModelParallelStrategy", "FSDPStrategy"))
    if sharded and rollout.mode != "disaggregated":  # rollout workers load a whole copy of their own
        raise ConfigError(
            "rollout.engine=hf with strategy=fsdp: a sharded actor would gather every layer for every generated token, "
            "on all ranks in lock-step; fix: strategy=ddp (each rank holds the whole actor), rollout.engine=vllm, or "
            "rollout.mode=disaggregated (rollout workers load a copy of their own)"
        )
    if rollout.tensor_parallel_size != 1:
        raise ConfigError(
            f"rollout.tensor_parallel_size={rollout.tensor_parallel_size} with rollout.engine=hf: the actor generates "
            "whole on each rank (only vLLM splits a model over devices); fix: rollout.tensor_parallel_size=1 or "
            "rollout.engine=vllm"
        )
    own = resolve_rollout_dtype(precision, None)
    if rollout.dtype is not None and rollout.dtype != own:
        raise ConfigError(
            f"rollout.dtype={rollout.dtype} with rollout.engine=hf: the actor generates in the trainer's precision "
            f"(strategy.precision={precision}: {own}); fix: rollout.dtype=null"
        )


def check_worker_waits_fit_collectives(
    rollout: RolloutConfig, strategy: StrategyConfig, collective_timeout_s: float
) -> None:
    """Data-parallel trainers with rollout workers: while rank 0 waits for the workers (their start, a batch), the other
    ranks wait for it in a collective; that wait must outlast rank 0's, so that every rank stops with rank 0's line
    naming the worker rather than a collective's timeout (lit_ppo/rollout/workers/ranks.py)."""
    if rollout.mode != "disaggregated" or strategy.data_parallel_size == 1:
        return
    w = rollout.workers
    setting, longest = max(
        [
            ("rollout.workers.start_timeout_s", w.start_timeout_s),
            ("rollout.workers.batch_timeout_s", w.batch_timeout_s),
        ],
        key=lambda item: item[1],
    )
    if collective_timeout_s <= longest:
        raise ConfigError(
            f"trainer.collective_timeout_s={collective_timeout_s:g} with {strategy.data_parallel_size} trainer ranks and "
            f"rollout workers: ranks 1.. wait for rank 0 in a collective while it waits up to {setting}={longest:g} s "
            f"for the workers, and would stop on their own timeout without naming the worker; fix: "
            f"trainer.collective_timeout_s above {longest:g}, or lower {setting}"
        )


def validate_worker_devices(rollout: RolloutConfig, strategy: StrategyConfig) -> None:
    """rollout.workers.devices against where the workers run: 0 (share the trainer's first device) only for workers
    the trainer spawns beside one trainer device, and a vLLM worker's tensor-parallel size within its devices."""
    if rollout.mode != "disaggregated":
        return
    workers = rollout.workers
    if workers.devices == 0:
        where = "rollout.workers.devices=0 (the workers share the trainer's first device)"
        if workers.launch == "external" or workers.server_urls:
            how = "launch=external" if workers.launch == "external" else "rollout.workers.server_urls"
            raise ConfigError(
                f"{where} with {how}: those workers run where their launcher or server put them; fix: "
                "rollout.workers.devices=1 (it applies to spawned workers only), or launch=spawn"
            )
        if strategy.data_parallel_size != 1:
            raise ConfigError(
                f"{where} with {strategy.data_parallel_size} trainer ranks: every worker would load onto rank 0's "
                "device; fix: rollout.workers.devices=1 (devices after the trainers'), or one trainer device"
            )
    spawned = workers.launch != "external" and not workers.server_urls
    if spawned and rollout.engine == "vllm" and rollout.tensor_parallel_size > max(workers.devices, 1):
        raise ConfigError(
            f"rollout.tensor_parallel_size={rollout.tensor_parallel_size} with rollout.workers.devices="
            f"{workers.devices}: each worker's vLLM engine splits the model over its own devices; fix: "
            f"rollout.workers.devices={rollout.tensor_parallel_size}"
        )


def validate_server_workers(rollout: RolloutConfig, model: ModelConfig, strategy: StrategyConfig) -> None:
    """rollout.workers.launch=server (vLLM servers as rollout workers, lit_ppo/rollout/workers/servers.py): what the
    servers' HTTP routes cannot do, refused before any model loads."""
    if rollout.mode != "disaggregated" or rollout.workers.launch != "server":
        return
    where = "rollout.workers.launch=server (vLLM servers as rollout workers)"
    refused = [
        (
            model.lora.enabled,
            "with model.lora: a server loads a LoRA adapter only from a folder (/v1/load_lora_adapter), and lit-ppo "
            "pushes each adapter version from memory",
            "model.lora.rank=0",
        ),
        (rollout.engine == "hf", "with rollout.engine=hf: the servers are vLLM's", "rollout.engine=vllm"),
        (
            rollout.episodes.environment is not None,
            "with multi-turn episodes (rollout.episodes.environment): the servers generate single-turn responses only",
            "no environment",
        ),
        (
            rollout.tensor_parallel_size != 1,
            f"with rollout.tensor_parallel_size={rollout.tensor_parallel_size}: lit-ppo's gloo weight push reaches one "
            "worker process per server",
            "rollout.tensor_parallel_size=1",
        ),
        (
            strategy.data_parallel_size != 1,
            f"with {strategy.data_parallel_size} trainer ranks: only one trainer rank driving the servers is built",
            "one trainer device",
        ),
    ]
    for cannot, why, other in refused:
        if cannot:
            raise ConfigError(f"{where} {why}; fix: rollout.workers.launch=spawn, or {other}")


def validate_rollout_mode(rollout: RolloutConfig, ppo: PPOConfig, strategy: StrategyConfig) -> None:
    """rollout.mode=disaggregated and its staleness against the engine and the PPO settings (any number of trainer
    ranks: rank 0 drives the workers, lit_ppo/rollout/workers/ranks.py)."""
    if rollout.mode != "disaggregated":
        # (as rollout.max_staleness is, in validate_rollout: each would be planned, then ignored)
        defaults = WorkersConfig()
        given = [
            f"rollout.workers.{f.name}={getattr(rollout.workers, f.name)}"
            for f in dataclasses.fields(WorkersConfig)
            if getattr(rollout.workers, f.name) != getattr(defaults, f.name)
        ]
        if given:
            raise ConfigError(
                f"{', '.join(given)} with rollout.mode={rollout.mode}: the engine in the trainer's process generates, "
                "and no rollout worker would use them; fix: rollout.mode=disaggregated, or remove them"
            )
        return
    k = rollout.staleness()
    where = f"rollout.mode=disaggregated (rollout.max_staleness={k})"
    if k > 0 and ppo.rollout_correction.mode == "none":
        raise ConfigError(
            f"{where} trains on samples of a policy up to {k} rollout step(s) old, but "
            "ppo.rollout_correction.mode=none would weight them as if on-policy; fix: ppo.rollout_correction.mode=tis "
            "(or mis), or rollout.max_staleness=0"
        )
    if k > 0 and ppo.old_logprobs == "rollout":
        raise ConfigError(
            f"{where} with ppo.old_logprobs=rollout: the PPO ratio would be taken against the stale behaviour policy; "
            "fix: ppo.old_logprobs=auto (the old log-probs are recomputed with the weights the step starts from)"
        )
