"""A per-device memory estimate of a run, before anything is loaded (`mode=plan` prints it).

Pure arithmetic on the model's shape (config.json, or `model.architecture` in the experiment) and the run's
settings; `estimate_memory` is the only place the formulas live. Per device, in bytes:

- weights: actor, critic and reference (and on-policy distillation's teacher, frozen, in its dtype); gradients and AdamW's two states for the trained ones, in the storage
  dtype of the resolved precision (32-true and bf16-mixed: float32; bf16-true: bf16). Under FSDP each is
  1/data-parallel size, plus what is gathered for compute (the root unit: embeddings, LM head, final norm;
  one decoder layer). DDP adds its gradient buckets (a second copy of the gradients). bf16-mixed adds autocast's
  bf16 copy of the weights of the model in training.
- activations of one micro-batch of micro_train_batch_size sequences of prompt + response tokens, kept for
  the backward pass, with and without gradient checkpointing (the configured one counts). Per token and decoder
  layer, Hugging Face's Qwen2/Llama layer keeps about 10 hidden-size vectors (two RMSNorms with their float32
  inputs, the attention's query and grouped-query-expanded key/value, its output and o_proj's input) and 4
  intermediate-size ones (gate, up, SiLU(gate), their product), counted with torch's saved-tensor hooks; its
  SDPA path with padding also keeps a [B, 1, S, S] mask per layer. The layer whose backward runs needs about
  as much again. Checkpointing keeps one hidden vector per layer and token and recomputes one layer at a time
  (measured: about one layer's activations on top; BENCHMARKS.md, "Memory").
- logits: the LM head's output on the response positions [B, T, V] in the compute dtype (lit_ppo.training.logits writes their
  gradient over them), plus
  a few float32 chunks of the chunked log-prob/entropy computation (lit_ppo.training.logits).
- vLLM (colocated): its weights in the rollout dtype and the KV cache the rollout batch needs
  (this rank's sequences x max_model_len); on a GPU vLLM reserves gpu_memory_utilization of the device, and
  sleeps (frees it) while training when rollout.vllm.sleep_between_steps is on.
- rollout.engine=hf instead: no second copy of the weights (the actor generates), the KV cache of one
  `generate` call (rollout.hf.max_batch_sequences sequences, or all of this rank's, x prompt + response tokens, in the compute
  dtype) and the last position's float32 logits per sequence; freed when generation ends, so only the rollout
  phase holds them.
- rollout.mode=disaggregated instead: nothing of generation on the trainer's devices; a second table per rollout
  worker: its engine as above for its share of every rank's sequences, and the pushes it received ahead of applying
  them (host memory, up to max(k, 1) versions; docs/async.md).

With `model.lora` (rank > 0): the base weights once per model body (actor, critic) and frozen, in the compute dtype
under bf16-mixed (no autocast copies then), no reference (the actor with its adapter disabled); gradients and AdamW
states for the adapters (and the critic's value head) only, in float32; vLLM holds one adapter beside the base, in
its max_lora_rank-sized slot. Activations are as without LoRA (the frozen base's layers still pass gradients back).
Under FSDP the frozen base is sharded like the rest, and a gathered unit has gradients for its adapter only.

The peak is the larger of the rollout phase (weights, optimizer states, vLLM) and the training phase
(everything above except a sleeping vLLM). BENCHMARKS.md ("Memory", "On a GPU") compares the training phase with
measured peaks; tests/end_to_end/test_gpu.py checks it against the CUDA allocator's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from lit_ppo.engine_registry import ENGINES
from lit_ppo.model_shape import ModelShape

GIB = 1024**3

# Bytes per value: stored weights, gradients, each of AdamW's two states, compute (activations, logits).
PRECISION_BYTES = {
    "32-true": {"weight": 4, "grad": 4, "adam_state": 4, "compute": 4},
    "bf16-mixed": {"weight": 4, "grad": 4, "adam_state": 4, "compute": 2},
    "bf16-true": {"weight": 2, "grad": 2, "adam_state": 2, "compute": 2},
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LAYER_HIDDEN_VECTORS = 10  # kept per token and decoder layer for the backward pass (see the module docstring)
LAYER_INTERMEDIATE_VECTORS = 4
LOGPROB_CHUNK_TOKENS = (
    256  # lit_ppo.training.logits.CHUNK_TOKENS: tokens per float32 chunk of the log-prob / entropy computation
)
LOGPROB_CHUNKS_ALIVE = 4  # float32 chunk temporaries alive at once in its backward
VLLM_MAX_NUM_SEQS = 256  # vLLM's default max_num_seqs (LLM class, GPU and CPU)  # tokens per float32 chunk of the log-prob / entropy computation


@dataclass(frozen=True)
class MemoryInputs:
    """The run's settings that memory depends on (from the config and the step plan)."""

    precision: str  # resolved: 32-true, bf16-mixed, bf16-true
    strategy: str  # single, ddp, fsdp
    data_parallel_size: int
    micro_batch_size: int  # sequences per forward/backward
    prompt_tokens: int  # data.max_prompt_length
    response_tokens: int  # rollout.max_response_tokens
    gradient_checkpointing: bool
    critic: bool
    reference: bool
    rollout_dtype: str
    rollout_sequences: int  # sequences this rank generates at once (its share of a rollout step)
    max_model_len: int
    on_gpu: bool
    gpu_memory_utilization: float = 0.3
    tensor_parallel_size: int = 1
    vllm_sleeps: bool = True  # rollout.vllm.sleep_between_steps (takes effect on GPUs only)
    cpu_kv_cache_gib: float = 1  # rollout.vllm.kv_cache_gib: vLLM's KV cache on CPU
    device_memory_gib: float | None = None
    grad_accumulation_steps: int = 1  # micro-batches per optimizer step per rank
    rollout_engine: str = "vllm"  # rollout.engine: vllm (a second copy of the weights) or hf (the actor generates)
    hf_batch_sequences: int | None = None  # rollout.hf.max_batch_sequences: sequences per HF generate call
    lora_rank: int = 0  # model.lora.rank; 0: full-parameter training
    lora_target_modules: str | tuple[str, ...] = "all-linear"
    # The actor's adapter as the pre-flight counted it on the model (StepPlan.lora.adapter_parameters); None: from the
    # shape, by the names of a Qwen2/Llama layer's seven linear modules (`ModelShape.lora_parameters`).
    lora_adapter_parameters: int | None = None
    vllm_max_lora_rank: int = 0  # vLLM's adapter slot (StepPlan.lora.vllm_max_lora_rank)
    rollout_workers: int = 0  # rollout.mode=disaggregated: rollout.workers.count; 0: the trainer's devices generate
    workers_share_device: bool = False  # rollout.workers.devices=0: the workers are on the trainer's first device
    max_staleness: int = 0  # rollout.max_staleness (k): versions a worker may hold received before it applies them
    teacher_parameters: int = 0  # on-policy distillation's teacher (model.teacher), frozen; 0: none
    teacher_dtype: str = "float32"  # model.teacher.dtype
    teacher_shape_from: str = ""  # where its parameter count was read
    context_parallel_size: int = 1  # C: each rank of a group runs 1/C of every row's positions (Ulysses)

    def adapter_parameters(self, shape: ModelShape, rank: int | None = None) -> int:
        """One model's LoRA adapter parameters at `rank` (default: lora_rank); they grow with the rank."""
        rank = rank or self.lora_rank
        if self.lora_adapter_parameters is not None:
            return self.lora_adapter_parameters * rank // self.lora_rank
        return shape.lora_parameters(rank, self.lora_target_modules)


@dataclass
class MemoryEstimate:
    rows: list[tuple[str, int, str]]  # (what, bytes per device, how)
    training_bytes: int
    rollout_bytes: int
    peak_bytes: int
    device_memory_gib: float | None
    warning: str | None
    worker_rows: list[tuple[str, int, str]] = field(default_factory=list)  # per rollout worker (its own device)
    worker_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": [{"what": w, "gib": round(b / GIB, 3), "bytes": b, "how": h} for w, b, h in self.rows],
            "training_gib": round(self.training_bytes / GIB, 3),
            "rollout_gib": round(self.rollout_bytes / GIB, 3),
            "peak_gib": round(self.peak_bytes / GIB, 3),
            "device_memory_gib": self.device_memory_gib,
            "warning": self.warning,
            **(
                {
                    "worker_rows": [
                        {"what": w, "gib": round(b / GIB, 3), "bytes": b, "how": h} for w, b, h in self.worker_rows
                    ],
                    "worker_gib": round(self.worker_bytes / GIB, 3),
                }
                if self.worker_rows
                else {}
            ),
        }

    def table(self) -> str:
        width = max(len(w) for w, _, _ in self.rows + self.worker_rows)
        lines = ["Memory per device (estimate)", "-" * (width + 40)]
        lines += [f"{w:<{width}}  {b / GIB:>9.2f} GiB  {h}" for w, b, h in self.rows]
        lines.append(f"{'training phase':<{width}}  {self.training_bytes / GIB:>9.2f} GiB")
        lines.append(f"{'rollout phase':<{width}}  {self.rollout_bytes / GIB:>9.2f} GiB")
        device = f" of {self.device_memory_gib:g} GiB" if self.device_memory_gib else " (device memory unknown)"
        lines.append(f"{'peak':<{width}}  {self.peak_bytes / GIB:>9.2f} GiB{device}")
        if self.warning:
            lines.append(f"warning: {self.warning}")
        if self.worker_rows:
            lines += ["", "Memory per rollout worker (its own device or process; estimate)", "-" * (width + 40)]
            lines += [f"{w:<{width}}  {b / GIB:>9.2f} GiB  {h}" for w, b, h in self.worker_rows]
            lines.append(f"{'worker total':<{width}}  {self.worker_bytes / GIB:>9.2f} GiB")
        return "\n".join(lines)


def activation_bytes(
    shape: ModelShape, batch: int, sequence: int, compute_bytes: int, checkpointing: bool, context_parallel: int = 1
) -> int:
    """What the backward pass of `batch` sequences of `sequence` tokens keeps from the decoder layers, plus the
    working set of the layer whose backward runs; under context parallelism (`context_parallel` C ranks) a rank's
    1/C of every row's positions (the whole rows' mask stays on every rank)."""
    tokens = batch * -(-sequence // context_parallel)
    layer = (
        tokens
        * compute_bytes
        * (LAYER_HIDDEN_VECTORS * shape.hidden_size + LAYER_INTERMEDIATE_VECTORS * shape.intermediate_size)
    )
    mask = (
        batch * sequence * sequence * compute_bytes
    )  # Hugging Face's SDPA path: a [B, 1, S, S] padding mask per layer
    if checkpointing:  # each layer's input; one layer recomputed at a time (its backward frees as it goes)
        return tokens * compute_bytes * shape.num_layers * shape.hidden_size + layer + mask
    return shape.num_layers * (layer + mask) + layer


def estimate_memory(shape: ModelShape, run: MemoryInputs) -> MemoryEstimate:
    """Per device: the models' state, what the strategy adds, a micro-batch's activations and logits, and what
    generation holds, each a row; the training and rollout phases' sums and their peak."""
    if run.precision not in PRECISION_BYTES:
        raise ValueError(f"estimate_memory: precision {run.precision!r} is not one of {', '.join(PRECISION_BYTES)}")
    size = PRECISION_BYTES[run.precision]
    params = shape.parameters()
    lora = run.lora_rank > 0
    shard = run.data_parallel_size * run.context_parallel_size if run.strategy == "fsdp" else 1  # every rank
    rows: list[tuple[str, int, str]] = []
    size, (weights, grads, optimizer, trained) = model_state_bytes(shape, run, size, params, lora, shard, rows)
    extra = strategy_bytes(shape, run, size, params, trained, lora, shard, rows)
    c = size["compute"]
    activations, logits = activation_and_logit_bytes(shape, run, c, rows)
    vllm, vllm_while_training, worker_rows, worker_bytes = rollout_engine_bytes(shape, run, params, c, rows)
    teacher = teacher_bytes(run, shard, rows)
    training = weights + grads + optimizer + extra + activations + logits + teacher
    rollout = weights + optimizer + vllm + teacher
    peak = max(training + vllm_while_training, rollout)
    warning = None
    if run.device_memory_gib and peak > run.device_memory_gib * GIB:
        warning = (
            f"the estimated peak of {peak / GIB:.1f} GiB per device exceeds the device's {run.device_memory_gib:g} GiB; "
            "fix: lower ppo.micro_train_batch_size, set model.gradient_checkpointing=true, use strategy=fsdp or more devices"
        )
    return MemoryEstimate(
        rows=rows,
        training_bytes=training,
        rollout_bytes=rollout,
        peak_bytes=peak,
        device_memory_gib=run.device_memory_gib,
        warning=warning,
        worker_rows=worker_rows,
        worker_bytes=worker_bytes,
    )


def model_state_bytes(
    shape: ModelShape, run: MemoryInputs, size: dict, params: int, lora: bool, shard: int, rows: list
) -> tuple[dict, tuple[int, int, int, int]]:
    """The models' weights, gradients and optimizer states, their rows added to `rows`: (the bytes per value, with
    LoRA's float32 adapters; (weights, gradients, optimizer states, trained parameters))."""
    how_shard = f" / {shard} (FSDP)" if shard > 1 else ""
    if lora:
        size = {**size, "grad": 4, "adam_state": 4}  # the adapters train in float32 whatever the base's dtype
        bodies = 2 if run.critic else 1
        adapter = run.adapter_parameters(shape)
        trained = adapter * bodies + (shape.hidden_size + 1 if run.critic else 0)  # + the critic's value head
        base_bytes = size["compute"] if run.precision == "bf16-mixed" else size["weight"]
        frozen = params * bodies * base_bytes // shard
        models = "actor" + (" + critic" if run.critic else "")
        rows.append(
            (
                "frozen base weights",
                frozen,
                f"{models}: {params * bodies / 1e6:,.0f} M params x {base_bytes} B{how_shard}"
                + ("; reference: the actor with its adapter disabled, no copy" if run.reference else ""),
            )
        )
        adapter_bytes = trained * 4 // shard
        rows.append(
            (
                "trained weights (LoRA)",
                adapter_bytes,
                f"rank {run.lora_rank} adapters{' + value head' if run.critic else ''}: {trained:,} "
                f"params x 4 B ({trained / (params * bodies):.2%} of the frozen){how_shard}",
            )
        )
        weights = frozen + adapter_bytes
    else:
        trained = params * (2 if run.critic else 1)  # the critic has the actor's body (its head is one vector)
        held = trained + (params if run.reference else 0)
        models = "actor" + (" + critic" if run.critic else "") + (" + reference" if run.reference else "")
        weights = held * size["weight"] // shard
        rows.append(("weights", weights, f"{models}: {held / 1e6:,.0f} M params x {size['weight']} B{how_shard}"))
    grads = trained * size["grad"] // shard
    rows.append(("gradients", grads, f"trained models x {size['grad']} B{how_shard}"))
    optimizer = trained * 2 * size["adam_state"] // shard
    rows.append(("optimizer states", optimizer, f"AdamW: 2 x {size['adam_state']} B per trained param{how_shard}"))
    return size, (weights, grads, optimizer, trained)


def strategy_bytes(
    shape: ModelShape, run: MemoryInputs, size: dict, params: int, trained: int, lora: bool, shard: int, rows: list
) -> int:
    """What the strategy adds while training (DDP's gradient buckets, FSDP's gathered units and unsharded gradients,
    autocast's weight copies), its rows added to `rows`."""
    extra = 0
    if run.strategy == "ddp" and run.data_parallel_size * run.context_parallel_size > 1:
        # one model's backward at a time; buckets are per wrapped model (with LoRA: its trained parameters only)
        extra = (trained // (2 if lora and run.critic else 1) if lora else params) * size["grad"]
        rows.append(("DDP gradient buckets", extra, "a copy of the gradients of the model in backward"))
    if (
        shard > 1
    ):  # gathered in the compute dtype (FSDP2's MixedPrecisionPolicy under bf16-mixed), gradients reduced in float32
        # With LoRA a unit holds its frozen base and its adapter, and only the adapter's gradients exist.
        layer_adapter = run.adapter_parameters(shape) // shape.num_layers if lora else 0
        unit = shape.embedding_parameters() + shape.layer_parameters() + layer_adapter
        gathered = unit * size["compute"] + (layer_adapter if lora else unit) * size["grad"]
        rows.append(
            (
                "FSDP gathered units",
                gathered,
                "root unit (embeddings, LM head) + one decoder layer, weights and "
                + ("the adapter's gradients" if lora else "gradients"),
            )
        )
        extra += gathered
        if run.grad_accumulation_steps > 1:  # reduce-scatter once per optimizer step: unsharded sums until then
            unsharded = trained * size["grad"]
            rows.append(
                (
                    "FSDP unsharded gradients",
                    unsharded,
                    f"accumulated over {run.grad_accumulation_steps} micro-batches before one reduce-scatter",
                )
            )
            extra += unsharded
    elif run.precision == "bf16-mixed" and not lora:  # a LoRA base is stored in bf16: nothing to copy
        autocast = params * 2
        rows.append(("autocast weight copies", autocast, "bf16 copies of the weights of the model in training"))
        extra += autocast
    return extra


def activation_and_logit_bytes(shape: ModelShape, run: MemoryInputs, c: int, rows: list) -> tuple[int, int]:
    """A micro-batch's activations (with or without gradient checkpointing, both rows shown) and its logits, their
    rows added to `rows`."""
    sequence = run.prompt_tokens + run.response_tokens
    C = run.context_parallel_size
    without = activation_bytes(shape, run.micro_batch_size, sequence, c, checkpointing=False, context_parallel=C)
    with_ = activation_bytes(shape, run.micro_batch_size, sequence, c, checkpointing=True, context_parallel=C)
    rows.append(
        (
            "activations, no checkpointing",
            without,
            f"{run.micro_batch_size} x {run.prompt_tokens + run.response_tokens} tokens x {shape.num_layers} layers"
            + (f", 1/{C} of the tokens per rank (context parallelism)" if C > 1 else "")
            + ("" if not run.gradient_checkpointing else " (not used)"),
        )
    )
    rows.append(
        (
            "activations, checkpointing",
            with_,
            "layer inputs + one layer" + ("" if run.gradient_checkpointing else " (not used)"),
        )
    )
    activations = with_ if run.gradient_checkpointing else without
    response = run.micro_batch_size * -(-run.response_tokens // C)  # the LM head at this rank's positions only
    chunk = min(run.response_tokens, LOGPROB_CHUNK_TOKENS)
    logits = response * shape.vocab_size * c + LOGPROB_CHUNKS_ALIVE * chunk * shape.vocab_size * 4
    rows.append(
        (
            "logits",
            logits,
            f"[{run.micro_batch_size}, {run.response_tokens}, {shape.vocab_size}] x {c} B (their "
            f"gradient overwrites them), + {LOGPROB_CHUNKS_ALIVE} float32 chunks of {chunk} tokens",
        )
    )
    return activations, logits


def rollout_engine_bytes(
    shape: ModelShape, run: MemoryInputs, params: int, c: int, rows: list
) -> tuple[int, int, list[tuple[str, int, str]], int]:
    """What generation holds on the trainer's device (in all; while training), its rows added to `rows`, and the
    rollout workers' own rows and bytes (rollout.mode=disaggregated; else none)."""
    worker_rows: list[tuple[str, int, str]] = []
    worker_bytes = 0
    if run.rollout_workers:  # the workers generate, on their own devices: nothing of it on the trainer's
        vllm = vllm_while_training = 0
        worker_bytes, worker_device_bytes = rollout_worker_bytes(shape, run, params, c, worker_rows)
        if run.workers_share_device:  # ... unless they share its device: their engines are there all the time
            vllm = vllm_while_training = run.rollout_workers * worker_device_bytes
            rows.append(
                (
                    "rollout workers' engines (on this device)",
                    vllm,
                    f"{run.rollout_workers} x the worker's table less its host memory (rollout.workers.devices=0)",
                )
            )
    elif not ENGINES[run.rollout_engine].preallocates_kv_cache:  # rollout.engine=hf: the actor generates
        vllm = hf_generation_bytes(shape, run, c, rows)
        vllm_while_training = 0  # the KV cache and logits of generate() are freed before training starts
    else:
        vllm, vllm_while_training = vllm_bytes(shape, run, params, rows)
    return vllm, vllm_while_training, worker_rows, worker_bytes


def teacher_bytes(run: MemoryInputs, shard: int, rows: list) -> int:
    """On-policy distillation's teacher in the training process: its weights in model.teacher.dtype (sharded like the
    other models under FSDP), held in both phases; its no-grad forward keeps no activations. Its row added to `rows`."""
    if not run.teacher_parameters:
        return 0
    held = run.teacher_parameters * DTYPE_BYTES[run.teacher_dtype] // shard
    how = f"frozen, {run.teacher_parameters / 1e6:,.0f} M params x {DTYPE_BYTES[run.teacher_dtype]} B"
    rows.append(("teacher weights", held, how + (f" / {shard} (FSDP)" if shard > 1 else "") + run.teacher_shape_from))
    return held


def rollout_worker_bytes(
    shape: ModelShape, run: MemoryInputs, params: int, compute_bytes: int, rows: list
) -> tuple[int, int]:
    """rollout.mode=disaggregated: (what one rollout worker holds, of it on its device), its rows added to `rows`: its
    engine on its device (vLLM's weights and KV cache for its share of all ranks' sequences, or an HF model of its own
    and one generate call's cache) and, in host memory, the pushes it received ahead of applying them (at most max(k, 1) versions: the pushed
    tensors as the trainer holds them, float32, or the adapter's)."""
    share = replace(run, rollout_sequences=-(-run.rollout_sequences * run.data_parallel_size // run.rollout_workers))
    if not ENGINES[run.rollout_engine].preallocates_kv_cache:  # rollout.engine=hf: a copy of the actor
        own = params * compute_bytes
        rows.append(("HF model (the worker's own)", own, f"{params / 1e6:,.0f} M params x {compute_bytes} B"))
        engine = own + hf_generation_bytes(shape, share, compute_bytes, rows)
    else:
        engine, _ = vllm_bytes(shape, share, params, rows)
    pushed = run.adapter_parameters(shape) * 4 if run.lora_rank > 0 else params * 4
    versions = max(run.max_staleness, 1)  # at k = 0 one push is held from its receipt until its apply
    staged = pushed * versions
    rows.append(
        (
            "received pushes not yet applied",
            staged,
            f"host memory: up to max(k, 1) = {versions} version{'s' if versions > 1 else ''} of "
            + ("the adapter" if run.lora_rank > 0 else "the weights")
            + " x 4 B (docs/async.md, the weight push)",
        )
    )
    return engine + staged, engine


def vllm_bytes(shape: ModelShape, run: MemoryInputs, params: int, rows: list) -> tuple[int, int]:
    """(vLLM's bytes in the rollout phase, its bytes while training), their rows added to `rows`."""
    kv_bytes = DTYPE_BYTES[run.rollout_dtype]
    vllm_weights = params * kv_bytes // run.tensor_parallel_size
    rows.append(
        (
            "vLLM weights",
            vllm_weights,
            f"{run.rollout_dtype}" + (f" / {run.tensor_parallel_size} (TP)" if run.tensor_parallel_size > 1 else ""),
        )
    )
    if run.lora_rank > 0:  # one adapter in vLLM's slot of max_lora_rank, in the rollout dtype
        slot = run.adapter_parameters(shape, run.vllm_max_lora_rank) * kv_bytes
        rows.append(("vLLM LoRA adapter", slot, f"one adapter in a max_lora_rank {run.vllm_max_lora_rank} slot"))
        vllm_weights += slot
    # vLLM runs at most VLLM_MAX_NUM_SEQS sequences at once and queues the rest: a smaller KV cache is slower, not fatal.
    in_flight = min(run.rollout_sequences, VLLM_MAX_NUM_SEQS)
    kv_needed = (
        in_flight * run.max_model_len * 2 * shape.num_layers * shape.kv_dim * kv_bytes // run.tensor_parallel_size
    )
    rows.append(
        (
            "vLLM KV cache, all in flight",
            kv_needed,
            f"{in_flight} of this {'worker' if run.rollout_workers else 'rank'}'s {run.rollout_sequences} sequences at "
            f"once x {run.max_model_len} tokens",
        )
    )
    if run.on_gpu and run.device_memory_gib:
        vllm = int(run.gpu_memory_utilization * run.device_memory_gib * GIB)
        share = vllm - vllm_weights
        how = f"gpu_memory_utilization {run.gpu_memory_utilization} x {run.device_memory_gib:g} GiB; KV cache share {share / GIB:.1f} GiB"
        if share < kv_needed:
            how += f" = {max(0.0, share / kv_needed):.0%} of all in flight (vLLM queues the rest)"
        rows.append(("vLLM reservation", vllm, how))
    elif run.on_gpu:  # the device memory is unknown here: what the rollout would take
        vllm = vllm_weights + kv_needed
    else:
        vllm = vllm_weights + int(run.cpu_kv_cache_gib * GIB)  # VLLM_CPU_KVCACHE_SPACE
        rows.append(("vLLM KV cache (CPU)", int(run.cpu_kv_cache_gib * GIB), "rollout.vllm.kv_cache_gib"))
    return vllm, 0 if (run.on_gpu and run.vllm_sleeps) else vllm


def hf_generation_bytes(shape: ModelShape, run: MemoryInputs, compute_bytes: int, rows: list) -> int:
    """rollout.engine=hf: what one Hugging Face `generate` call holds beside the actor (its KV cache and the last
    position's float32 logits per sequence), its row added to `rows`."""
    sequences = min(run.rollout_sequences, run.hf_batch_sequences or run.rollout_sequences)
    tokens = run.prompt_tokens + run.response_tokens  # a left-padded batch's width at its last step
    kv = sequences * tokens * 2 * shape.num_layers * shape.kv_dim * compute_bytes
    logits = sequences * shape.vocab_size * 4
    rows.append(
        (
            "HF generate KV cache and logits",
            kv + logits,
            f"{sequences} sequences per generate call x {tokens} tokens; the actor's weights generate "
            "(rollout.engine=hf: no second copy)",
        )
    )
    return kv + logits
