"""The `rollout.workers` section: the rollout worker processes of rollout.mode=disaggregated (docs/async.md), how they
start (`rollout.workers.launch`: checked in this module alone) and their timeouts."""

from __future__ import annotations

import os
import socket
import urllib.parse
from dataclasses import dataclass, field

from lit_ppo.config.parse import positive
from lit_ppo.errors import ConfigError

WORKER_LAUNCHES = ("spawn", "external", "server")  # rollout.workers.launch


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

    @property
    def spawned(self) -> bool:
        """Whether the trainer starts the workers itself, on its own node: launch=spawn, or launch=server without
        server_urls (external workers are their launcher's, given servers the user's)."""
        return self.launch != "external" and not self.server_urls


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def validate_workers(workers: WorkersConfig) -> None:
    """The workers' count, launch, port and timeouts."""
    positive("rollout.workers", count=workers.count)
    if not isinstance(workers.devices, int) or isinstance(workers.devices, bool) or workers.devices < 0:
        raise ConfigError(
            f"rollout.workers.devices={workers.devices!r} must be a whole number >= 0; fix: devices per worker after "
            "the trainer's (e.g. 1), or 0 to share the trainer's first device"
        )
    positive("rollout.workers", weight_push_bucket_mib=workers.weight_push_bucket_mib)
    validate_launch(workers)
    for key in ("start_timeout_s", "heartbeat_timeout_s", "batch_timeout_s", "weight_push_timeout_s"):
        if not getattr(workers, key) > 0:
            raise ConfigError(
                f"rollout.workers.{key}={getattr(workers, key)} must be a positive number of seconds; fix: e.g. 600"
            )


# rollout.workers.launch is checked here alone: against the workers' own settings (`validate_launch`, when the section
# is built) and against the rest of the run (`validate_launch_in_run`, when `RunConfig` is).


def validate_launch(workers: WorkersConfig) -> None:
    """The launch's name, and the settings that belong to one launch: the port (external), the servers' URLs
    (server) and the trainer's address they are told."""
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


def validate_launch_in_run(
    workers: WorkersConfig,
    *,
    engine: str,
    tensor_parallel_size: int,
    environment: bool,
    lora: bool,
    data_parallel_size: int,
) -> None:
    """With rollout.mode=disaggregated, the launch against the rest of the run, refused before any model loads:
    launch=server (vLLM servers as rollout workers, lit_ppo/rollout/workers/servers.py) where the servers' HTTP routes
    cannot do what the run asks (`environment`: rollout.episodes.environment is set; `lora`: model.lora is on), then
    rollout.workers.devices against where the workers run: 0 (share the trainer's first device) only for workers the
    trainer spawns beside one trainer device, and a vLLM worker's tensor-parallel size within its devices."""
    if workers.launch == "server":
        where = "rollout.workers.launch=server (vLLM servers as rollout workers)"
        refused = [
            (
                lora,
                "with model.lora: a server loads a LoRA adapter only from a folder (/v1/load_lora_adapter), and "
                "lit-ppo pushes each adapter version from memory",
                "model.lora.rank=0",
            ),
            (engine == "hf", "with rollout.engine=hf: the servers are vLLM's", "rollout.engine=vllm"),
            (
                environment,
                "with multi-turn episodes (rollout.episodes.environment): the servers generate single-turn responses "
                "only",
                "no environment",
            ),
            (
                tensor_parallel_size != 1,
                f"with rollout.tensor_parallel_size={tensor_parallel_size}: lit-ppo's gloo weight push reaches one "
                "worker process per server",
                "rollout.tensor_parallel_size=1",
            ),
            (
                data_parallel_size != 1,
                f"with {data_parallel_size} trainer ranks: only one trainer rank driving the servers is built",
                "one trainer device",
            ),
        ]
        for cannot, why, other in refused:
            if cannot:
                raise ConfigError(f"{where} {why}; fix: rollout.workers.launch=spawn, or {other}")
    if workers.devices == 0:
        where = "rollout.workers.devices=0 (the workers share the trainer's first device)"
        if not workers.spawned:
            how = "launch=external" if workers.launch == "external" else "rollout.workers.server_urls"
            raise ConfigError(
                f"{where} with {how}: those workers run where their launcher or server put them; fix: "
                "rollout.workers.devices=1 (it applies to spawned workers only), or launch=spawn"
            )
        if data_parallel_size != 1:
            raise ConfigError(
                f"{where} with {data_parallel_size} trainer ranks: every worker would load onto rank 0's "
                "device; fix: rollout.workers.devices=1 (devices after the trainers'), or one trainer device"
            )
    if workers.spawned and engine == "vllm" and tensor_parallel_size > max(workers.devices, 1):
        raise ConfigError(
            f"rollout.tensor_parallel_size={tensor_parallel_size} with rollout.workers.devices="
            f"{workers.devices}: each worker's vLLM engine splits the model over its own devices; fix: "
            f"rollout.workers.devices={tensor_parallel_size}"
        )


def check_worker_waits_fit_collectives(
    workers: WorkersConfig, data_parallel_size: int, collective_timeout_s: float
) -> None:
    """Data-parallel trainers with rollout workers (rollout.mode=disaggregated): while rank 0 waits for the workers
    (their start, a batch), the other ranks wait for it in a collective; that wait must outlast rank 0's, so that every
    rank stops with rank 0's line naming the worker rather than a collective's timeout
    (lit_ppo/rollout/workers/ranks.py)."""
    if data_parallel_size == 1:
        return
    setting, longest = max(
        [
            ("rollout.workers.start_timeout_s", workers.start_timeout_s),
            ("rollout.workers.batch_timeout_s", workers.batch_timeout_s),
        ],
        key=lambda item: item[1],
    )
    if collective_timeout_s <= longest:
        raise ConfigError(
            f"trainer.collective_timeout_s={collective_timeout_s:g} with {data_parallel_size} trainer ranks and "
            f"rollout workers: ranks 1.. wait for rank 0 in a collective while it waits up to {setting}={longest:g} s "
            f"for the workers, and would stop on their own timeout without naming the worker; fix: "
            f"trainer.collective_timeout_s above {longest:g}, or lower {setting}"
        )
