"""The vLLM engine that lives in the training process: generation and in-place weight sync."""

from __future__ import annotations

import functools
import gc
import hashlib
import logging
import os
import threading
import time
import weakref
from typing import Iterable

import torch

from lit_ppo.console import quiet_stderr
from lit_ppo.contract import CountedTensors, GenerateRequest, Generation, WeightUpdate
from lit_ppo.rollout.weight_transfer.plugin import warn_if_stale

log = logging.getLogger(__name__)


def sampling_seeds(seed: int, purpose: str, positions: Iterable[int], n: int) -> list[int]:
    """One vLLM seed per prompt, from the run's seed, what is being generated (e.g. `rollout_step=3`, `eval`)
    and the prompt's position in the GLOBAL batch: a sample's randomness is then the same however the batch
    is split over data-parallel ranks. vLLM seeds a prompt's n samples seed, seed + 1, ..., seed + n - 1,
    hence prompts n apart; the base is a hash below 2**56, so seeds stay below 2**63."""
    base = int.from_bytes(hashlib.sha256(f"{seed}/{purpose}".encode()).digest()[:7], "little")
    return [base + position * n for position in positions]


def configure_vllm_environment(kv_cache_gib: float) -> None:
    """Settings vLLM needs to run inside this process (docs/reference.md section 4)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(kv_cache_gib))))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def adapter_host_copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter as vLLM's LoRA loader takes it: host copies. vLLM folds alpha / r into lora_B in place
    (LoRALayerWeights.optimize): it must get copies, never the trainer's tensors (which it would scale under the
    optimizer's feet). Copies also free FSDP's gathers."""
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in tensors.items()}


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class VLLMEngine:
    """A vLLM `LLM` colocated with the trainer.

    The engine loads the initial weights from `model_dir` once; afterwards `sync_weights`
    pushes the actor's tensors into it in place, without touching the disk."""

    def __init__(
        self,
        model_dir: str,
        *,
        dtype: str = "float32",
        max_model_len: int = 128,
        gpu_memory_utilization: float = 0.3,
        kv_cache_gib: float = 1,
        seed: int = 0,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = True,
        distributed: bool = False,
        enable_sleep_mode: bool = False,
        max_lora_rank: int | None = None,
        weight_transfer: bool = False,
    ):
        configure_vllm_environment(kv_cache_gib)
        warn_if_stale()  # an install whose plugin entry point names a module that moved: vLLM will log a traceback
        from vllm.platforms import current_platform

        kwargs = {}
        if distributed:
            kwargs["distributed_executor_backend"] = "external_launcher"
        if current_platform.is_cpu():
            # Seeded sampling must never rewind a request's generator. vLLM rewinds it (Generator.set_offset) after a
            # step that ran only part of a request's prefill, since that step samples a token it then discards; the
            # CPU generator has no offset and raises ("CPU Generator does not use offset") as soon as the waiting
            # prefills of one generate() call exceed the step's token budget (4,096 tokens on CPU: 32 prompts of
            # 130 tokens). Without chunked prefill the scheduler runs each prefill whole in one step or waits for the
            # next, so no discarded sample is ever drawn. Alternatives: dropping the seeds would make samples depend
            # on the number of ranks and on scheduling; submitting in waves whose prefills fit one step would tie
            # this code to the scheduler's budget and prefix-cache accounting. vLLM then sizes the step budget at
            # max(max_model_len, 4096) tokens, so any single prompt fits. GPUs keep chunked prefill: CUDA
            # generators rewind.
            kwargs["enable_chunked_prefill"] = False
        if max_lora_rank is not None:
            # LoRA runs: the base stays as loaded and one adapter at a time serves every request (`sync_adapter`).
            kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
        if weight_transfer:
            # A rollout worker's engine: pushes arrive through vLLM's weight-transfer interface, lit-ppo's gloo backend
            # (rollout/weight_transfer/backend.py), registered with vLLM's factory in this process.
            from lit_ppo.rollout.weight_transfer.backend import BACKEND

            kwargs["weight_transfer_config"] = {"backend": BACKEND}
        self.lora_request = None  # the adapter version every generate call uses (LoRA runs)
        with quiet_stderr():  # vLLM's C++ warnings and loading bars on fd 2 go to run.log, not the console
            from vllm import LLM  # imported late: heavy, and not needed by `mode=plan`

            self.llm = LLM(
                model=model_dir,
                dtype=dtype,
                max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization,
                seed=seed,
                tensor_parallel_size=tensor_parallel_size,
                enforce_eager=enforce_eager,
                enable_sleep_mode=enable_sleep_mode,
                # Log-probs of the distribution sampled from (after temperature, top-p), not of the raw logits:
                # the trainer compares them with its own to catch a weight sync or a precision that went wrong.
                logprobs_mode="processed_logprobs",
                # Multi-turn episodes send each turn's prompt as the previous turn's prompt + output + observation:
                # the prefix cache computes only the new tokens (vLLM V1's default, stated here because they rely on it).
                enable_prefix_caching=True,
                **kwargs,
            )
        self._release = _own_shutdown(self.llm)
        self._warm_up()
        self.sleep_supported = enable_sleep_mode and torch.cuda.is_available()
        if enable_sleep_mode and not self.sleep_supported:
            log.info("vLLM sleep mode is not supported on this device; the engine stays resident")

    def _warm_up(self) -> None:
        """One greedy token with its log-prob, so that the first rollout step does not pay vLLM's one-time cost.

        vLLM ranks each sampled token's log-prob with a function it compiles with torch.compile on first use (Inductor
        on CPU: 2-2.6 s on the project's CPU machines, more than ten later rollout steps of the default experiment);
        the JIT warm-up vLLM runs at start-up for such kernels is off under enforce_eager. Greedy, so no random
        generator moves; the prefix cache is reset after it. Measured in BENCHMARKS.md (race, third machine);
        tests/training/test_speed.py checks that a rollout batch right after start-up compiles nothing."""
        from vllm import SamplingParams

        started = time.perf_counter()
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)
        self.llm.generate([{"prompt_token_ids": [0]}], params, use_tqdm=False)
        self.llm.reset_prefix_cache()
        log.info("vLLM warm-up (its log-prob kernel's compilation): %.1f s", time.perf_counter() - started)

    def generate(self, request: GenerateRequest) -> list[Generation]:
        """n responses per prompt, grouped: all samples of prompt 0 first, then prompt 1, ...

        `request.seeds`: one per prompt (see `sampling_seeds`), or None for unseeded sampling."""
        from vllm import SamplingParams

        limits = request.limits
        params = [
            SamplingParams(
                n=request.n,
                temperature=request.temperature,
                top_p=request.top_p,
                max_tokens=limits[i],
                logprobs=0,
                seed=None if request.seeds is None else request.seeds[i],
                stop_token_ids=list(request.stop_token_ids) or None,
                stop=list(request.stop) or None,
            )
            for i in range(request.prompt_count)
        ]
        prompts = [{"prompt_token_ids": ids} for ids in request.prompt_token_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        version = self.adapter_version
        generations = []
        for i, request in enumerate(outputs):
            for completion in request.outputs:
                generations.append(
                    Generation(
                        prompt_index=i,
                        token_ids=list(completion.token_ids),
                        truncated=completion.finish_reason == "length",
                        text=completion.text,
                        # logprobs=0 asks for the sampled token's entry only (per position {token_id: Logprob}).
                        logprobs=[
                            position[token].logprob
                            for position, token in zip(completion.logprobs, completion.token_ids)
                        ],
                        adapter_version=version,
                    )
                )
        return generations

    def update_weights(self, update: WeightUpdate) -> int:
        """The contract's update: the adapter as a new adapter version (`sync_adapter`), or every tensor streamed into
        the running engine (`sync_weights`); returns the bytes moved."""
        if update.adapter is not None:
            a = update.adapter
            return self.sync_adapter(a.tensors, a.peft_config, a.adapter_version)
        counted = CountedTensors(update.tensors)
        self.sync_weights(counted)
        return counted.bytes

    @torch.no_grad()
    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the given Hugging Face-named tensors into the running engine, then drop stale cache.

        Streamed: vLLM pulls each tensor from the iterator when it loads it (the engine runs in this process), so a
        gathered FSDP tensor is freed once copied; vLLM buffers at most the decoder layer it is completing (its
        layerwise reload processes a layer when all of its tensors arrived). A list would hold a full copy of the
        model's gathered weights at once."""
        weights = ((name, tensor.detach()) for name, tensor in named_tensors)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()

    # ------------------------------------------------------------ a rollout worker's end of the weight transfer

    def open_weight_transfer(self, init_info: dict) -> None:
        """Join the trainer's weight-transfer group (vLLM's `init_weight_transfer_engine`: the engine built from
        `weight_transfer=True` starts receiving every push as it is sent)."""
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def apply_weight_transfer(self, update_infos: list[dict], version: int) -> None:
        """Load a received push as policy `version`, through vLLM's RL API: `start_weight_update`, one
        `update_weights` per bucket, `finish_weight_update(version)` (vLLM's weight version); then drop stale cache."""
        self.llm.start_weight_update()
        for info in update_infos:
            self.llm.update_weights({"update_info": info})
        self.llm.finish_weight_update(str(version))
        self.llm.reset_prefix_cache()

    def close_weight_transfer(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    @property
    def weight_transfer_name(self) -> str:
        """Which transfer engine vLLM built from `weight_transfer_config` (the worker logs it), in each process."""
        names = sorted(set(self.llm.collective_rpc(_weight_transfer_engine_name)))
        return f"vLLM's weight-transfer interface ({', '.join(names)})"

    @property
    def weight_version(self) -> int:
        """The policy version vLLM committed last (`finish_weight_update` / `set_weight_version`); 0: as loaded
        (vLLM's "default")."""
        committed = self.llm.get_weight_version()
        return 0 if committed == "default" else int(committed)

    def set_weight_version(self, version: int) -> None:
        self.llm.update_weight_version(str(version))

    @property
    def adapter_version(self) -> int:
        """The LoRA adapter version that serves generate calls; 0: none (the base, or a full-parameter run)."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @torch.no_grad()
    def sync_adapter(self, tensors: dict[str, torch.Tensor], peft_config: dict, version: int) -> int:
        """Load a LoRA adapter (peft's tensor names and adapter config) from memory as adapter `version` (>= 1), serve
        every later generate call with it, and drop every other adapter; returns the bytes pushed.

        vLLM has no public in-memory route (its LoRARequest names a directory), so the tensors go straight to the
        worker's adapter manager in this process (`_load_adapter_from_tensors`), as verl's TensorLoRARequest does
        through a patched loader; requests then name the version, which is already loaded, and nothing reads a disk.
        The check after it (`list_loras`) fails the run in one line if the engine does not serve this version."""
        copies = adapter_host_copies(tensors)
        self._serve_adapter(version, _load_adapter_from_tensors, (version, copies, peft_config))
        return tensor_bytes(copies)

    def apply_adapter_transfer(self, update_infos: list[dict], peft_config: dict, version: int) -> None:
        """A rollout worker's: the adapter of a received push loaded as adapter `version`, as `sync_adapter` loads,
        in each of the engine's processes from its own receiver (`_load_received_adapter`)."""
        self._serve_adapter(version, _load_received_adapter, (version, update_infos, peft_config))

    def _serve_adapter(self, version: int, load, args: tuple) -> None:
        if version < 1:
            raise ValueError(f"sync_adapter: adapter versions start at 1 (vLLM's LoRA ids), got {version}")
        for stale in self.llm.llm_engine.list_loras():  # the previous version, or another run's same id
            self.llm.llm_engine.remove_lora(stale)
        self.llm.collective_rpc(load, args=args)
        from vllm.lora.request import LoRARequest

        self.lora_request = LoRARequest(f"policy-v{version}", version, f"in-memory:policy-v{version}")
        served = set(self.llm.llm_engine.list_loras())
        if served != {version}:
            from lit_ppo.errors import WeightSyncError

            raise WeightSyncError(
                f"LoRA sync: vLLM serves adapter versions {sorted(served)} after loading version {version}; the "
                "rollouts would not sample from the trained policy; fix: report it with its process's log "
                "(logs/run.log, or the rollout worker's; vLLM's LoRA manager refused the adapter)"
            )
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the previous adapter

    def sequence_logprobs(self, prompt_token_ids: list[int], response_token_ids: list[int]) -> list[float]:
        """vLLM's log-probability of each response token given the prompt (teacher-forced)."""
        from vllm import SamplingParams

        ids = list(prompt_token_ids) + list(response_token_ids)
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        out = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False, lora_request=self.lora_request)[0]
        per_position = out.prompt_logprobs  # list (None for the first token) of {token_id: Logprob}
        return [per_position[j][ids[j]].logprob for j in range(len(prompt_token_ids), len(ids))]

    def sleep(self) -> None:
        if self.sleep_supported:
            self.llm.sleep(level=1)

    def wake_up(self) -> None:
        if self.sleep_supported:
            self.llm.wake_up()

    def close(self) -> None:
        """Release the engine (weights, KV cache, vLLM's distributed state) so that another can start in this
        process, as the jobs of a Hydra sweep do. Dropping the last reference is not enough: vLLM gc.freeze()s
        the heap after startup, so the engine's reference cycles are never collected until shutdown unfreezes it."""
        if self.llm is None:
            return
        self._release()
        self.llm = None
        gc.collect()


# ------------------------------------------------------------ how the registry starts it (lit_ppo/engine_registry.py)


def start_colocated(datamodule, actor=None) -> VLLMEngine:
    """rollout.mode=colocated: a vLLM engine in this process, from the run's rollout settings, within
    rollout.engine_start_timeout_s (with several ranks, each rank's: vLLM's external_launcher backend)."""
    from lit_ppo.waits import start_within

    rollout, plan = datamodule.rollout, datamodule.plan
    if datamodule.topology.distributed and not datamodule.topology.launcher_environment_exported():
        raise RuntimeError(
            "start_engine: a data-parallel engine starts in setup(), after the trainer set up "
            "the process group; call trainer.fit instead of starting it by hand"
        )
    return start_within(
        lambda: VLLMEngine(
            **engine_keywords(datamodule, plan),
            distributed=datamodule.topology.distributed,
            enable_sleep_mode=rollout.vllm.sleep_between_steps and torch.cuda.is_available(),
        ),
        rollout.engine_start_timeout_s,
    )


def engine_keywords(datamodule, plan) -> dict:
    """`VLLMEngine`'s keywords from the run's rollout settings (the shared ones and the `rollout.vllm` section), as the
    trainer's own engine, a rollout worker's and a vLLM server (`server_settings.server_arguments`) all take them."""
    rollout = datamodule.rollout
    return dict(
        model_dir=datamodule.model_dir,
        dtype=rollout.dtype or plan.models.rollout_dtype,
        max_model_len=rollout.max_model_len,
        gpu_memory_utilization=rollout.vllm.gpu_memory_utilization,
        kv_cache_gib=rollout.vllm.kv_cache_gib,
        seed=datamodule.seed,
        tensor_parallel_size=rollout.tensor_parallel_size,
        enforce_eager=rollout.vllm.enforce_eager,
        max_lora_rank=plan.lora.vllm_max_lora_rank if plan.lora else None,  # model.lora: the base, then adapters pushed
    )


def worker_settings(datamodule, plan) -> dict:
    """`VLLMEngine`'s keywords in a rollout worker (or a vLLM server): `engine_keywords`, pushes received through
    vLLM's weight-transfer interface."""
    return {**engine_keywords(datamodule, plan), "weight_transfer": True}  # (rollout/weight_transfer/backend.py)


def start_in_worker(settings: dict) -> VLLMEngine:
    """A rollout worker's engine: pushes load through vLLM's own weight-transfer API."""
    return VLLMEngine(**settings)


_LIVE_ENGINE_CORES: set[int] = set()
"""ids of the in-process vLLM engine cores not yet shut down (every VLLMEngine of this process)."""
_LIVE_LOCK = threading.RLock()
_VLLM_TEARDOWN = None  # vLLM's own cleanup_dist_env_and_memory, once _guard_teardown replaced it


def _own_shutdown(llm):
    """Route every shutdown of an in-process engine (close(), vLLM's own call, or the finalizer when the engine is
    garbage-collected) through `_shutdown_core`, so that vLLM's process-wide parallel groups outlive it while another
    engine of this process still uses them. Returns the callable that shuts it down.

    vLLM's in-process EngineCore.shutdown ends with `cleanup_dist_env_and_memory()`, which destroys the tensor- and
    pipeline-parallel groups of the whole process: a second engine in the process (a LoRA-enabled one beside the
    rollout engine, a sweep's next job while the previous engine is collected) then fails at its next step with
    "pipeline model parallel group is not initialized". The last engine to go still tears everything down, so a later
    engine starts from a clean state."""
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)
    if core is None or not isinstance(getattr(client, "_finalizer", None), weakref.finalize):
        return client.shutdown  # an engine in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1): nothing shared
    _guard_teardown()
    key = id(core)
    with _LIVE_LOCK:
        _LIVE_ENGINE_CORES.add(key)
    vllm_shutdown = core.shutdown  # the bound method vLLM's finalizer holds
    core.shutdown = functools.partial(_shutdown_core, vllm_shutdown, key)  # InprocClient.shutdown() calls this
    client._finalizer.detach()  # vLLM's own: weakref.finalize(client, core.shutdown)
    client._finalizer = weakref.finalize(client, _shutdown_core, vllm_shutdown, key)
    return client._finalizer


def _shutdown_core(vllm_shutdown, key: int) -> None:
    with _LIVE_LOCK:
        _LIVE_ENGINE_CORES.discard(key)
    vllm_shutdown()  # ends in _guarded_teardown, which looks at the engines still alive when it runs


def _guard_teardown() -> None:
    """Replace vLLM's teardown, once per process, by one that decides when it is called: free this engine's memory
    while other engines live (a collection inside one shutdown may finalize another engine), everything otherwise."""
    global _VLLM_TEARDOWN
    import vllm.v1.engine.core as core_module

    with _LIVE_LOCK:
        if _VLLM_TEARDOWN is None:
            _VLLM_TEARDOWN = core_module.cleanup_dist_env_and_memory
            core_module.cleanup_dist_env_and_memory = _guarded_teardown


def _guarded_teardown(*args, **kwargs) -> None:
    with _LIVE_LOCK:
        others = bool(_LIVE_ENGINE_CORES)
    if others:
        _free_memory_only()
    else:
        _VLLM_TEARDOWN(*args, **kwargs)


def _free_memory_only() -> None:
    """What vLLM's teardown does besides destroying the parallel groups: collect the engine's heap and free the
    device's cached memory."""
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _load_received_adapter(worker, version: int, update_infos: list[dict], peft_config: dict) -> None:
    """Runs in each vLLM worker process: the adapter its weight-transfer engine received (weight_transfer/backend.py), loaded
    as `_load_adapter_from_tensors` loads."""
    tensors = dict(worker.weight_transfer_engine.receiver.take_all(update_infos))
    _load_adapter_from_tensors(worker, version, adapter_host_copies(tensors), peft_config)


def _weight_transfer_engine_name(worker) -> str:
    return type(worker.weight_transfer_engine).__name__


def _load_adapter_from_tensors(worker, version: int, tensors: dict[str, torch.Tensor], peft_config: dict) -> None:
    """Runs on the vLLM worker (in this process): build the LoRA model from `tensors` the way vLLM's own loader does
    from a directory (same validation of the config against the engine's LoRA settings, same name mapping), then
    add it to the adapter manager and activate it."""
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    helper = PEFTHelper.from_dict({**peft_config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    adapter = manager._lora_model_cls.from_lora_tensors(
        version,
        tensors,
        helper,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    manager._adapter_manager.add_adapter(adapter)
    manager._adapter_manager.activate_adapter(version)
