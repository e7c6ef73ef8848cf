"""The trainer's side of the rollout workers (rollout.mode=disaggregated): `RolloutWorkers`, an engine of the contract
that hosts the channel (`transport`), starts or awaits the workers (`launch`), queues their ordered commands, pushes
weights (through vLLM's weight-transfer interface: `weight_transfer`; `RolloutWorkers` is the trainer engine's
`VLLMWeightSyncClient`) and collects results.

No hang, no orphan: every wait of the trainer has a timeout and checks that the workers are alive, failing with one
line naming the side, the worker and its log (RolloutWorkerError); `close` stops them (see `launch` for how, per
rollout.workers.launch).
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lit_ppo.contract import GenerateRequest, Generation, WeightUpdate
from lit_ppo.engine_registry import ENGINES
from lit_ppo.errors import RolloutWorkerError
from lit_ppo.rollout.episodes import EpisodeRequest, EpisodeSpec
from lit_ppo.rollout.weight_transfer.transport import POLL_S, PushAnnouncer, host_store
from lit_ppo.rollout.workers.client_settings import ClientSettings
from lit_ppo.rollout.workers.launch import ExternalLaunch, Launch, SpawnedLaunch
from lit_ppo.rollout.workers.messages import ApplyWeights, Generate, InitWeightTransfer, Result, Stop, WorkerSpec


@dataclass(frozen=True)
class Ticket:
    """One worker's share of a submitted request: which worker, its ticket, and the share's first prompt."""

    worker: int
    ticket: int
    offset: int


class WorkerSyncClient:
    """vLLM's `VLLMWeightSyncClient` for the trainer's weight-transfer engine (`weight_transfer`), over the workers'
    store: the engine's init becomes each worker's first command; each bucket's update info is announced under its
    key, where the workers' receivers wait for it before its broadcast, and kept for the "apply" command that
    `RolloutWorkers.update_weights` queues after the push (the workers load it when their queues reach it)."""

    def __init__(self, workers: "RolloutWorkers"):
        self.workers = workers
        self.announcer = PushAnnouncer(workers.store)
        self.updates: list[dict] = []  # the push in flight's (or the last push's) bucket infos

    def check_alive(self) -> None:
        """Between the rendezvous' polls: a worker that died before joining is named at once."""
        self.workers.launch.check_alive("the weight push's rendezvous")

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        for worker in range(self.workers.workers):
            self.workers._send(worker, InitWeightTransfer(init_info))

    def start_weight_update(self) -> None:
        self.workers.launch.check_alive("the weight push")
        self.updates = []

    def update_weights(self, update_info: dict) -> None:
        self.announcer.bucket(update_info)
        self.updates.append(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.announcer.end()


class RolloutWorkers:
    """Starts `workers` worker processes, sends them requests in order, pushes weights (or a LoRA adapter), collects
    results. An engine of the contract (`lit_ppo.contract.RolloutEngine`: `generate`, `update_weights`, `wake_up`,
    `sleep`, `close`) so that evaluation runs through it unchanged; rollouts use `submit` and `collect` to generate
    ahead (lit_ppo/rollout/schedule.py)."""

    def __init__(
        self,
        *,
        engine_kwargs: dict,
        settings: ClientSettings,
        launch: str = "spawn",
        port: int = 0,
        heartbeat_timeout_s: float = 60.0,
        engine_name: str = "vllm",
        episodes: EpisodeSpec | None = None,
    ):
        workers, start_timeout_s, push_timeout_s = settings.workers, settings.start_timeout_s, settings.push_timeout_s
        self.workers = workers
        self.batch_timeout_s = settings.batch_timeout_s
        self.push_timeout_s = push_timeout_s
        self.bucket_bytes = settings.bucket_mib * 2**20
        log_dir = Path(settings.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.host = settings.host or os.environ.get("LIT_PPO_ROLLOUT_HOST", "127.0.0.1")
        self.store = host_store(self.host, port, start_timeout_s)
        self.address = f"{self.host}:{self.store.port}"
        processes = ENGINES[engine_name].processes_per_worker(engine_kwargs)
        spec = WorkerSpec(
            engine_kwargs, push_timeout_s, settings.max_logprob_abs_diff, workers, engine_name, episodes, processes
        )
        self.store.set("spec", pickle.dumps(spec))
        self.launch: Launch = (
            ExternalLaunch(
                store=self.store, address=self.address, workers=workers, heartbeat_timeout_s=heartbeat_timeout_s
            )
            if launch == "external"
            else SpawnedLaunch(
                store=self.store,
                host=self.host,
                workers=workers,
                log_dir=log_dir,
                devices_per_worker=settings.devices_per_worker,
                trainer_devices=settings.trainer_devices,
            )
        )
        self.commands = [0] * workers  # commands sent to each worker
        self.tickets = 0
        self.version: int | None = None  # the last version pushed
        self.pushed_adapter_version = 0  # model.lora: the adapter version of the last push
        self.transfer = None  # the trainer's weight-transfer engine (lit_ppo_gloo), once the workers are ready
        started = time.perf_counter()
        try:
            self.launch.start(start_timeout_s)
            for i in range(workers):
                self._wait(f"ready/{i}", start_timeout_s, "its engine's start", "rollout.workers.start_timeout_s", i)
            from lit_ppo.rollout.weight_transfer.backend import start_trainer_transfer

            self.sync_client = WorkerSyncClient(self)
            self.transfer = start_trainer_transfer(
                host=self.host,
                port=self.store.port,
                world_size=1 + workers * processes,
                bucket_bytes=self.bucket_bytes,
                timeout_s=push_timeout_s,
                client=self.sync_client,
            )
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.perf_counter() - started

    @property
    def procs(self) -> list:
        """Spawned workers' processes (none when a launcher started them)."""
        return self.launch.procs

    @property
    def exit_codes(self) -> list[int | None]:
        """Spawned workers' exit codes once `close` has stopped them."""
        return self.launch.exit_codes

    # ------------------------------------------------------------ the store

    def _wait(self, key: str, timeout_s: float, what: str, setting: str, worker: int) -> bytes:
        """The value of `key` once a worker sets it; RolloutWorkerError when a worker dies or `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        while not self.store.check([key]):
            self.launch.check_alive(what)
            if time.monotonic() > deadline:
                self.launch.failed = True
                raise RolloutWorkerError(
                    f"trainer: rollout worker {worker} ({self.launch.where(worker)}) gave no {what} within "
                    f"{setting}={timeout_s:g} s; {self.launch.log(worker)}; fix: raise {setting} if it is only slow"
                )
            time.sleep(POLL_S)
        value = self.store.get(key)
        self.store.delete_key(key)
        return value

    def _send(self, worker: int, command: Generate | ApplyWeights | InitWeightTransfer | Stop) -> None:
        self.store.set(f"cmd/{worker}/{self.commands[worker]}", pickle.dumps(command))
        self.commands[worker] += 1

    # ------------------------------------------------------------ generation

    def submit(self, request: GenerateRequest | EpisodeRequest) -> list[Ticket]:
        """Queue the request (contiguous shares of its prompts over the workers, behind what each has queued): a
        `GenerateRequest`, or multi-turn episodes (`EpisodeRequest`, run by each worker's `EpisodeRunner`); returns the
        tickets to `collect`."""
        n_prompts = request.prompt_count
        tickets = []
        for worker in range(self.workers):
            start, stop = worker * n_prompts // self.workers, (worker + 1) * n_prompts // self.workers
            self.tickets += 1
            self._send(worker, Generate(self.tickets, request.share(start, stop)))
            tickets.append(Ticket(worker, self.tickets, start))
        return tickets

    def collect(self, ticket: list[Ticket]) -> tuple[list[Generation], list[int], float]:
        """The generations of `submit`'s ticket (one per worker) in prompt order, each one's policy version, and the
        workers' longest generation time (s)."""
        generations, versions, seconds = [], [], 0.0
        for t in ticket:
            result: Result = pickle.loads(
                self._wait(
                    f"result/{t.worker}/{t.ticket}",
                    self.batch_timeout_s,
                    "rollout batch",
                    "rollout.workers.batch_timeout_s",
                    t.worker,
                )
            )
            for warning in result.warnings:  # e.g. episodes scored 0 after environment errors, as colocated runs say
                logging.getLogger("lit_ppo").warning("rollout worker %d: %s", t.worker, warning)
            for g in result.generations:
                g.prompt_index += t.offset
            generations += result.generations
            versions += [result.policy_version] * len(result.generations)
            seconds = max(seconds, result.seconds)
        return generations, versions, seconds

    def generate(self, request: GenerateRequest | EpisodeRequest) -> list[Generation]:
        """The request generated on the workers, behind what they have queued (evaluation)."""
        return self.collect(self.submit(request))[0]

    # ------------------------------------------------------------ weights

    @property
    def adapter_version(self) -> int:
        """The adapter version of the last push (model.lora); 0 before one, or with full weights."""
        return self.pushed_adapter_version

    @torch.no_grad()
    def update_weights(self, update: WeightUpdate) -> int:
        """Push the update's tensors (with model.lora the adapter alone) to every worker through the trainer's
        weight-transfer engine (`weight_transfer`: buckets broadcast now, received by each worker while it generates),
        then queue "apply `update.policy_version`" behind each one's queued requests: those generate with the version
        they were queued after. With the apply goes the update's probe (a sequence and the trainer's log-probs of it at
        temperature 1), which each worker compares with its engine's once it applied the version; a worker whose
        weights differ stops with the reason (reported at the trainer's next wait). An adapter is loaded by each worker
        as adapter `adapter_version` of its engine from memory (`VLLMEngine.sync_adapter`), removing the previous one;
        a worker whose engine then does not serve exactly that adapter (vLLM's list_loras) stops with the reason.
        Every generation records the policy version (and adapter version) that sampled it, as its engine committed it
        (vLLM's weight version). Returns the bytes pushed."""
        from lit_ppo.rollout.weight_transfer.backend import BucketBroadcastError, ParamMeta, TensorSource

        version, probe = update.policy_version, update.probe() if update.probe is not None else None
        if update.adapter is not None:
            source = TensorSource.of_dict(update.adapter.tensors)
        else:
            if update.metadata is None:
                raise ValueError(
                    "RolloutWorkers.update_weights: full weights need their metadata (WeightUpdate.metadata)"
                )
            source = TensorSource(update.tensors, [ParamMeta(*m) for m in update.metadata])
        try:
            self.transfer.send_weights(source, weight_version=str(version))
        except BucketBroadcastError as e:
            self.launch.check_alive("the weight push")  # a dead worker is the better message
            deadline = time.monotonic() + self.launch.settle_s()
            while time.monotonic() < deadline:
                self.launch.check_alive("the weight push")
                time.sleep(POLL_S)
            self.launch.failed = True
            raise RolloutWorkerError(
                f"trainer: the weight push of version {version} (bucket {e.bucket}, {e.nbytes / 2**20:.1f} MiB) did "
                f"not complete within rollout.workers.weight_push_timeout_s={self.push_timeout_s:g} s "
                f"({e.seconds:.1f} s, {e.cause_name}); a rollout "
                f"worker is stuck: {self.launch.logs()}"
            ) from None
        updates = tuple(self.sync_client.updates)
        if update.adapter is not None:
            a = update.adapter
            message = ApplyWeights(updates, version, probe, a.peft_config, a.adapter_version)
            self.pushed_adapter_version = a.adapter_version
        else:
            message = ApplyWeights(updates, version, probe)
        for worker in range(self.workers):
            self._send(worker, message)
        self.version = version
        return source.bytes

    def wake_up(self) -> None:  # the workers' engines never sleep: they generate while the trainer trains
        pass

    def sleep(self) -> None:
        pass

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the workers (their launch's way: at once after a failure, where a stuck worker never reads its queue),
        then close the store, which ends any worker still running."""
        if self.store is None:
            return
        try:
            self.launch.stop(self._send, 0.0 if self.launch.failed else timeout_s)
        finally:
            # Dropping the store (the gloo group and the launch hold it too) stops its server: a worker still running
            # sees it gone.
            if self.transfer is not None:
                self.transfer.shutdown()
            self.transfer = self.launch.store = self.store = None
