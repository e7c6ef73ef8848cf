"""What the CPU tests cannot show, checked once on a GPU: collectives under NCCL, gradient checkpointing, the memory
estimate, bf16 with float32 master weights, and MFU (issues 13, 18, 14).

    python bench/gpu_checks.py --out $OUT/gpu_checks.json     # on a CUDA machine; about 4-6 minutes on an H100
    python bench/gpu_checks.py --device cpu --smoke           # checks that the script runs (CPU, tiny shapes)
    python bench/gpu_checks.py --only A,D                     # some sections

Sections (each on its own: one that fails prints its error and the others still run):
A. collectives: a 1-rank NCCL process group (gloo on CPU) with lit_ppo.distributed.world_size patched to 2, so that
   every global_sum/global_max really calls all_reduce (an identity on one rank); a real PPO rollout step (critic,
   reference, GAE, whitening, KL, rollout correction) and the data module's evaluation inside trainer.fit. Every
   tensor given to a collective must be on the models' device.
B. gradient checkpointing: decoder-layer calls in one forward+backward (twice the layers with it) and the peak memory.
C. memory: lit_ppo.memory.estimate_memory(...).training_bytes against the measured peak of a real rollout step.
D. bf16: FSDP2 (shard_models, bf16_mixed) with float32 master weights against pure bf16 at lr 1e-6, and the
   trainer's bf16-mixed and bf16-true runs.
E. MFU: the measured bf16/float32 matmul peak, and the training phase of lit-ppo and of a plain PyTorch loop
   (bench/train_phase.py) in bf16-mixed.

Correctness checks print PASS/FAIL; the exit status is 1 if one fails or a section stops with an error. Timings and
memory figures are measurements, not checks. The report is printed as markdown and written as JSON to --out
(default: $OUT/gpu_checks.json when OUT is set).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import time
import traceback
from contextlib import contextmanager, nullcontext
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from common import (
    BENCH_MODEL,
    CACHE,
    SMOKE_MODEL,
    ModelSize,
    arithmetic_prompt_file,
    build_model_dir,
    build_run,
    command_line,
    grpo_preset,
    machine,
    versions,
)
from train_phase import FixedBatchDataModule, NullEngine, make_fixed_batch, run_litppo, run_plain

from lit_ppo.config import PPOConfig, RolloutCorrectionConfig
from lit_ppo.memory import GIB, MemoryInputs, ModelShape, estimate_memory
from lit_ppo.precision import resolve_precision
from lit_ppo.rollout import Generation

QWEN05B = ModelSize(
    hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864, max_position_embeddings=2048
)
QWEN05B_VOCAB = 151936
"""Qwen2.5-0.5B's shape (494 M parameters, tied embeddings), random weights."""
BENCH_24M = dataclasses.replace(BENCH_MODEL, max_position_embeddings=2048)
SMOKE_WIDE = dataclasses.replace(SMOKE_MODEL, max_position_embeddings=2048)
SMOKE_WIDE_VOCAB = 4096
"""The smoke stand-in for the 0.5B shape: tiny body, a widened vocabulary (the same code path, CPU-sized)."""


# ---------------------------------------------------------------- the report


class Report:
    """Sections of markdown tables, checks and notes; printed as they come and kept for the JSON."""

    def __init__(self):
        self.sections: dict[str, dict] = {}
        self.current: dict | None = None

    @contextmanager
    def section(self, key: str, title: str):
        self.current = {"title": title, "status": "ok", "checks": [], "tables": [], "notes": []}
        self.sections[key] = self.current
        print(f"\n## {key}. {title}\n", flush=True)
        started = time.perf_counter()
        try:
            yield self.current
        except Exception as e:  # one section's failure must not lose the others
            line = f"{type(e).__name__}: {e}".splitlines()[0][:500]
            self.current["status"] = "error"
            self.current["error"] = line
            self.current["traceback"] = traceback.format_exc()[-4000:]
            print(f"**ERROR**: {line}\n\n```\n{self.current['traceback']}\n```", flush=True)
        finally:
            self.current["seconds"] = round(time.perf_counter() - started, 1)
            if any(not c["ok"] for c in self.current["checks"]) and self.current["status"] == "ok":
                self.current["status"] = "fail"
            print(f"\n_section {key}: {self.current['status'].upper()} in {self.current['seconds']} s_", flush=True)
            free_memory()

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.current["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
        print(f"- **{'PASS' if ok else 'FAIL'}** {name}" + (f": {detail}" if detail else ""), flush=True)

    def note(self, text: str) -> None:
        self.current["notes"].append(text)
        print(f"{text}\n", flush=True)

    def table(self, title: str, headers: list[str], rows: list[list]) -> None:
        self.current["tables"].append({"title": title, "headers": headers, "rows": rows})
        lines = [f"**{title}**", "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
        print("\n".join(lines) + "\n", flush=True)

    def failed(self) -> bool:
        return any(s["status"] != "ok" for s in self.sections.values() if s["status"] != "skipped")


def cell(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"
    return str(value)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gib(n: int | None) -> float | None:
    return None if n is None else n / GIB


# ---------------------------------------------------------------- models and batches


def shape_dir(size: ModelSize, vocab_size: int | None, device: torch.device) -> Path:
    """bench/common.build_model_dir's model (character tokenizer, random weights), its vocabulary widened to
    `vocab_size` (the extra rows are random too; the tokenizer only ever emits the first ids). Built once, cached."""
    if vocab_size is None:
        return build_model_dir(size)
    import hashlib

    from lit_ppo.tiny import TOKENIZER_VERSION, build_char_tokenizer, build_tiny_model, save_model_dir

    key = hashlib.sha256(json.dumps([dataclasses.asdict(size), vocab_size, TOKENIZER_VERSION]).encode()).hexdigest()[
        :12
    ]
    path = CACHE / f"model-{key}"
    if not (path / "config.json").exists():
        tokenizer = build_char_tokenizer()

        def build(on: torch.device):
            with torch.device(on):
                model = build_tiny_model(tokenizer, seed=0, **dataclasses.asdict(size))
                model.resize_token_embeddings(vocab_size, mean_resizing=False)
            return model

        try:  # random initialization of 0.5 B parameters is quicker on the GPU
            model = build(device)
        except Exception as e:
            print(
                f"building the model on {device} failed ({type(e).__name__}: {e}); building it on the CPU", flush=True
            )
            model = build(torch.device("cpu"))
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        save_model_dir(model.to("cpu"), tokenizer, tmp)
        tmp.rename(path)
        del model
        free_memory()
    return path


def model_shape(model_dir: Path) -> ModelShape:
    return ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))


def random_prompts(n: int, length: int, vocab: range, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(vocab.start, vocab.stop, (n, length), generator=g).tolist()


def fixed_batch(n_prompts: int, samples: int, prompt_tokens: int, response_tokens: int, seed: int = 0):
    """bench/train_phase.make_fixed_batch over random prompts of `prompt_tokens` ids (4..99: the character
    tokenizer's ordinary tokens)."""
    vocab = range(4, 100)
    return make_fixed_batch(
        random_prompts(n_prompts, prompt_tokens, vocab, seed), samples, response_tokens, vocab, seed
    )


def lm_loss(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on `input_ids`: real gradients for every parameter (the softmax reaches every row
    of the tied LM head)."""
    return model(input_ids=input_ids, labels=input_ids).loss


# ---------------------------------------------------------------- the process group (sections A and D)

_GROUP_FILE: Path | None = None


def ensure_process_group(device: torch.device) -> str:
    """A 1-rank default process group: NCCL on CUDA (no CPU backend: a CPU tensor in a collective fails), gloo on CPU."""
    global _GROUP_FILE
    if dist.is_initialized():
        return dist.get_backend()
    import tempfile

    _GROUP_FILE = Path(tempfile.mkdtemp(prefix="gpu_checks-")) / "rendezvous"  # a file: no port to pick
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"file://{_GROUP_FILE}", rank=0, world_size=1, **kwargs)
    return backend


COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "all_gather_object",
    "broadcast_object_list",
)


@contextmanager
def recorded_collectives(world: int):
    """torch.distributed's collectives wrapped to record (name, devices of their tensors), and
    lit_ppo.distributed.world_size returning `world`, so that global_sum/global_max call all_reduce even on one rank.

    lit_ppo.datamodule also imported world_size by name, for all_gather_object of dynamic sampling's groups; it is
    left alone: a 1-rank group cannot fill a 2-rank list, and that path does not run here."""
    import lit_ppo.distributed as lit_dist

    calls: list[tuple[str, list[str]]] = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def wrap(name, original):
        def recorded(*args, **kwargs):
            tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            calls.append((name, [str(t.device) for t in tensors]))
            return original(*args, **kwargs)

        return recorded

    original_world_size = lit_dist.world_size
    for name, original in originals.items():
        setattr(dist, name, wrap(name, original))
    lit_dist.world_size = lambda: world
    try:
        yield calls
    finally:
        lit_dist.world_size = original_world_size
        for name, original in originals.items():
            setattr(dist, name, original)


class StandInEngine(NullEngine):
    """vLLM's place in evaluation: response i of a prompt is i + 1 copies of the prompt's last token (text `i`)."""

    def generate(self, prompt_token_ids, *, n, temperature, top_p, max_tokens, seeds, **_):
        return [
            Generation(
                prompt_index=p, token_ids=[ids[-1]] * (i + 1), truncated=False, text=str(i), logprobs=[0.0] * (i + 1)
            )
            for p, ids in enumerate(prompt_token_ids)
            for i in range(n)
        ]


# ---------------------------------------------------------------- A. collectives


def section_collectives(report: Report, cfg) -> None:
    backend = ensure_process_group(cfg.device)
    model_dir = shape_dir(cfg.small_model, None, cfg.device)
    prompts, samples, P, T = (4, 2, 8, 8) if cfg.smoke else (8, 4, 32, 64)
    batch = fixed_batch(prompts, samples, P, T)
    # Sampler log-probs near the random model's (-log 128), so that the rollout-correction and log-prob
    # comparison reductions run; the gate is off (these are not the model's log-probs).
    batch = dataclasses.replace(batch, rollout_logprobs=[[-4.8] * T for _ in batch.response_ids])
    ppo = PPOConfig(
        rollout_batch_size=prompts,
        n_samples_per_prompt=samples,
        train_batch_size=prompts * samples // 2,
        micro_train_batch_size=prompts * samples // 4,
        kl_coef=0.01,
        rollout_correction=RolloutCorrectionConfig(mode="tis"),
    )
    eval_file = arithmetic_prompt_file(8, seed=1)
    with recorded_collectives(world=2) as calls:
        trainer, module, datamodule, plan = build_run(
            model_dir,
            arithmetic_prompt_file(64),
            ppo,
            max_response_tokens=T,
            total_rollout_steps=2,
            engine=StandInEngine(),
            out_dir=CACHE / "gpu_checks-A",
            datamodule_class=FixedBatchDataModule,
            accelerator=cfg.accelerator,
            precision=cfg.precision,
            eval_prompt_file=eval_file,
            max_logprob_abs_diff=None,
            eval_samples_per_prompt=2,
        )
        datamodule.fixed_batch = batch
        error = None
        try:
            trainer.fit(module, datamodule=datamodule)  # evaluates before the first and after the last rollout step
            during_fit = len(calls)
            evaluation = datamodule.evaluate()  # once more, on its own
        except Exception as e:
            error = f"{type(e).__name__}: {e}".splitlines()[0]
            during_fit, evaluation = len(calls), {}
    counts: dict[str, int] = {}
    for name, _ in calls:
        counts[name] = counts.get(name, 0) + 1
    devices = sorted({d for _, ds in calls for d in ds})
    off_device = [(name, ds) for name, ds in calls if any(not d.startswith(cfg.device.type) for d in ds)]
    report.note(
        f"backend {backend}, world_size patched to 2 on a 1-rank group; model {describe(model_dir)}; "
        f"PPO preset (critic, reference, GAE, KL in reward, TIS rollout correction), {cfg.precision}, "
        f"{prompts} prompts x {samples} samples x ({P} + {T}) tokens, 2 rollout steps; evaluation "
        f"(stand-in engine, pass@2) at the start, after the last step, and once after fit."
    )
    report.table(
        "collectives called",
        ["collective", "calls", "tensor devices"],
        [[name, n, ", ".join(sorted({d for c, ds in calls if c == name for d in ds}))] for name, n in counts.items()],
    )
    report.check(
        "a PPO rollout step and evaluation run with every reduction through the process group",
        error is None and module.rollout_step == 2 and "eval/reward" in evaluation,
        error
        or f"{module.rollout_step} rollout steps, {during_fit} collectives during fit, evaluation "
        f"{ {k: v for k, v in evaluation.items() if k != 'eval/samples'} }",
    )
    report.check(
        "no 'No backend type associated with device type cpu'",
        error is None or "No backend type" not in error,
        error or "",
    )
    report.check(
        f"every collective's tensors on the models' device ({cfg.device.type})",
        bool(calls) and not off_device,
        f"devices seen {devices}; off-device calls {off_device[:5]}",
    )
    row = module.history[-1] if module.history else {}
    report.data = {"counts": counts, "devices": devices}
    report.note(
        "last rollout step: "
        + ", ".join(
            f"{k} {row[k]:.4g}"
            for k in (
                "rollout/reward_mean",
                "rollout/kl_to_reference",
                "actor/policy_loss",
                "critic/value_loss",
                "rollout/logprob_abs_diff",
            )
            if isinstance(row.get(k), float)
        )
    )
    del trainer, module, datamodule


def describe(model_dir: Path) -> str:
    shape = model_shape(model_dir)
    return (
        f"Qwen2 hidden {shape.hidden_size}, {shape.num_layers} layers, {shape.num_heads}/{shape.num_kv_heads} "
        f"heads, vocab {shape.vocab_size}, {shape.parameters() / 1e6:.1f} M params"
    )


# ---------------------------------------------------------------- B. gradient checkpointing


def section_checkpointing(report: Report, cfg) -> None:
    from transformers import AutoModelForCausalLM

    from lit_ppo.batching import pack
    from lit_ppo.logits import logprobs_and_entropy
    from lit_ppo.models import prepare_for_training

    model_dir = shape_dir(cfg.big_model, cfg.big_vocab, cfg.device)
    B, P, T = (2, 8, 16) if cfg.smoke else (4, 128, 1024)
    batch = fixed_batch(1, B, P, T)
    results = {}
    for checkpointing in (False, True):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        prepare_for_training(model, checkpointing).to(cfg.device)
        layers = list(model.model.layers)
        count = [0]
        # A pre-hook: non-reentrant recomputation stops once it has what the backward needs, before a forward hook.
        handles = [layer.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1)) for layer in layers]
        mb = pack(batch.prompt_ids, batch.response_ids, 0, cfg.device)
        synchronize(cfg.device)
        baseline = torch.cuda.memory_allocated(cfg.device) if cfg.cuda else None
        if cfg.cuda:
            torch.cuda.reset_peak_memory_stats(cfg.device)
        forward_calls = None
        with cfg.autocast():
            logits = model(
                input_ids=mb.input_ids,
                attention_mask=mb.attention_mask,
                position_ids=mb.position_ids,
                logits_to_keep=T + 1,
            ).logits
            logp, _ = logprobs_and_entropy(logits, mb.response_ids)
            loss = -(logp * mb.response_mask).sum() / mb.response_mask.sum()
        forward_calls = count[0]
        loss.backward()
        synchronize(cfg.device)
        peak = torch.cuda.max_memory_allocated(cfg.device) - baseline if cfg.cuda else None
        results[checkpointing] = {"forward": forward_calls, "total": count[0], "layers": len(layers), "peak": peak}
        for h in handles:
            h.remove()
        del model, logits, logp, loss, mb
        free_memory()
    report.note(
        f"model {describe(model_dir)}; one micro-batch of {B} x ({P} + {T}) tokens, "
        f"{'bf16 autocast' if cfg.cuda else 'float32'}, lit-ppo's chunked log-probs; "
        "peak = max_memory_allocated during forward+backward minus the weights before it"
    )
    report.table(
        "decoder-layer calls and peak memory",
        ["checkpointing", "layers", "calls in forward", "calls in forward+backward", "peak above weights (GiB)"],
        [["on" if k else "off", r["layers"], r["forward"], r["total"], gib(r["peak"])] for k, r in results.items()],
    )
    off, on = results[False], results[True]
    report.check("without checkpointing each decoder layer runs once", off["total"] == off["layers"], str(off["total"]))
    report.check(
        "with checkpointing each decoder layer runs twice (recomputed in backward)",
        on["total"] == 2 * on["layers"] and on["forward"] == on["layers"],
        str(on["total"]),
    )
    if cfg.cuda:
        report.check(
            "checkpointing lowers the peak",
            on["peak"] < off["peak"],
            f"{gib(off['peak']):.2f} -> {gib(on['peak']):.2f} GiB ({on['peak'] / off['peak']:.2f}x)",
        )
    else:
        report.note("peak memory: n/a without CUDA (bench/memory_estimate.py measures it on CPU)")


# ---------------------------------------------------------------- C. memory estimate


class PeakOfStep(L.Callback):
    """The CUDA allocator's peak during each rollout step (reset when the step starts), one figure per step.

    The steps after the first are the steady state the estimate describes: AdamW's states exist from the first
    optimizer step on, so only from then do they coexist with a micro-batch's activations (the first step's peak is
    lower by about the states' size)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peaks: list[int] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        torch.cuda.synchronize(self.device)
        self.peaks.append(torch.cuda.max_memory_allocated(self.device))


def section_memory(report: Report, cfg) -> None:
    B, P, T = (4, 8, 16) if cfg.smoke else (4, 128, 1024)
    models = {"24M": (cfg.small_model, None), "0.5B-shape": (cfg.big_model, cfg.big_vocab)}
    rows, worst = [], 0.0
    for name, (size, vocab) in models.items():
        model_dir = shape_dir(size, vocab, cfg.device)
        shape = model_shape(model_dir)
        for precision in ("32-true", "bf16-mixed"):
            for checkpointing in (False, True):
                ppo = PPOConfig(
                    rollout_batch_size=1,
                    n_samples_per_prompt=B,
                    train_batch_size=B,
                    micro_train_batch_size=B,
                    kl_coef=0.01,
                )
                peak = PeakOfStep(cfg.device) if cfg.cuda else None
                free_memory()
                before = torch.cuda.memory_allocated(cfg.device) if cfg.cuda else 0
                trainer, module, datamodule, plan = build_run(
                    model_dir,
                    arithmetic_prompt_file(64),
                    ppo,
                    max_response_tokens=T,
                    total_rollout_steps=2,
                    engine=NullEngine(),
                    out_dir=CACHE / "gpu_checks-C",
                    datamodule_class=FixedBatchDataModule,
                    accelerator=cfg.accelerator,
                    precision=precision,
                    gradient_checkpointing=checkpointing,
                    callbacks=[peak] if peak else [],
                )
                datamodule.fixed_batch = fixed_batch(1, B, P, T)
                started = time.perf_counter()
                trainer.fit(module, datamodule=datamodule)
                seconds = time.perf_counter() - started
                estimate = estimate_memory(
                    shape,
                    MemoryInputs(
                        precision=precision,
                        strategy="single",
                        data_parallel_size=1,
                        micro_batch_size=B,
                        prompt_tokens=P,
                        response_tokens=T,
                        gradient_checkpointing=checkpointing,
                        critic=plan.critic_enabled,
                        reference=plan.reference_enabled,
                        rollout_dtype=plan.rollout_dtype,
                        rollout_sequences=plan.samples_per_rank_per_rollout_step,
                        max_model_len=P + T,
                        on_gpu=cfg.cuda,
                    ),
                )
                measured = max(peak.peaks[1:]) - before if peak else None
                print(
                    f"  peaks per batch (GiB above start): {[round(gib(x - before), 3) for x in peak.peaks]}"
                    if peak
                    else "",
                    flush=True,
                )
                first_step = peak.peaks[0] - before if peak else None
                ratio = estimate.training_bytes / measured if measured else None
                if ratio:
                    worst = max(worst, abs(ratio - 1))
                rows.append(
                    [
                        name,
                        precision,
                        "on" if checkpointing else "off",
                        gib(estimate.training_bytes),
                        gib(measured),
                        gib(first_step),
                        ratio,
                        None if ratio is None else ("yes" if abs(ratio - 1) <= 0.3 else "no"),
                        round(seconds, 1),
                    ]
                )
                print(f"  {rows[-1]}", flush=True)
                del trainer, module, datamodule
                free_memory()
    report.note(
        f"a real rollout step (Lightning trainer + PPOModule, PPO preset: actor, critic, reference; AdamW; "
        f"micro-batch {B} x ({P} prompt + {T} response) tokens, one micro-batch per step) on "
        f"{cfg.device.type}, 2 rollout steps; measured = the largest torch.cuda.max_memory_allocated of a training batch "
        "after the first (AdamW's states exist then, as in every later step) minus what "
        "was allocated before the run was built; estimated = lit_ppo.memory.estimate_memory(...).training_bytes"
    )
    report.table(
        "training-phase memory: estimate vs measured",
        [
            "model",
            "precision",
            "checkpointing",
            "estimated (GiB)",
            "measured, steady state (GiB)",
            "first step (GiB)",
            "estimate / measured",
            "within +-30%",
            "fit s",
        ],
        rows,
    )
    if cfg.cuda:
        report.note(f"largest deviation {worst:.0%} (goal within 30%: {'met' if worst <= 0.3 else 'not met'})")
    report.data = {"rows": rows}


# ---------------------------------------------------------------- D. bf16 with float32 master weights


def fraction_changed(before: dict[str, torch.Tensor], model) -> float:
    changed = total = 0
    for name, p in model.named_parameters():
        now = p.full_tensor() if hasattr(p, "full_tensor") else p
        now = now.detach().to(before[name].dtype)
        changed += int((now != before[name]).sum())
        total += now.numel()
    return changed / total


def section_bf16(report: Report, cfg) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from lit_ppo.distributed import shard_models
    from lit_ppo.models import prepare_for_training

    ensure_process_group(cfg.device)
    model_dir = shape_dir(cfg.small_model, None, cfg.device)
    steps, lr = 10, 1e-6
    ids = torch.randint(
        4, 100, (4 if cfg.smoke else 8, 32 if cfg.smoke else 256), generator=torch.Generator().manual_seed(0)
    )
    ids = ids.to(cfg.device)
    rows = []

    # FSDP2 bf16-mixed: float32 shards (parameters, gradients, AdamW), bf16 compute.
    model = prepare_for_training(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), False).to(
        cfg.device
    )
    mesh = init_device_mesh(cfg.device.type, (1,), mesh_dim_names=("data_parallel",))
    shard_models((model,), mesh["data_parallel"], bf16_mixed=True)
    compute_dtypes = set()
    hook = model.model.layers[0].mlp.gate_proj.register_forward_hook(
        lambda m, inputs, output: compute_dtypes.add(str(output.dtype))
    )
    before = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    stored = sorted({str(p.dtype) for p in model.parameters()})
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for _ in range(steps):
        lm_loss(model, ids).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    hook.remove()
    states = sorted({str(v.dtype) for s in optimizer.state.values() for k, v in s.items() if k != "step"})
    fsdp_fraction = fraction_changed(before, model)
    rows.append(
        [
            "FSDP2 shard_models(bf16_mixed=True)",
            ", ".join(stored),
            ", ".join(sorted(compute_dtypes)),
            ", ".join(states),
            fsdp_fraction,
        ]
    )
    del model, optimizer, before
    free_memory()

    # Pure bf16 storage (what bf16-true did before issue 18, and still does).
    model = prepare_for_training(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), False)
    model = model.to(cfg.device, dtype=torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for _ in range(steps):
        lm_loss(model, ids).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    bf16_fraction = fraction_changed(before, model)
    rows.append(
        [
            "pure bf16 (model.to(bfloat16), AdamW)",
            "torch.bfloat16",
            "torch.bfloat16",
            ", ".join(sorted({str(v.dtype) for s in optimizer.state.values() for k, v in s.items() if k != "step"})),
            bf16_fraction,
        ]
    )
    del model, optimizer, before
    free_memory()

    # The trainer's own precisions (single device): 2 rollout steps x 5 AdamW steps at lr 1e-6, GRPO preset.
    trainer_fraction = {}
    for precision in ("bf16-mixed", "bf16-true"):
        args = argparse.Namespace(
            rollout_batch_size=10,
            samples_per_prompt=2,
            train_batch_size=4,
            micro_batch_size=4,
            response_tokens=8 if cfg.smoke else 64,
            steps=2,
            lr=lr,
            seed=0,
        )
        ppo = grpo_preset(
            kl_coef=0.0,
            rollout_batch_size=10,
            n_samples_per_prompt=2,
            train_batch_size=4,
            micro_train_batch_size=4,
            ppo_epochs=1,
            actor_lr=lr,
        )
        trainer, module, datamodule, plan = build_run(
            model_dir,
            arithmetic_prompt_file(64),
            ppo,
            max_response_tokens=args.response_tokens,
            total_rollout_steps=2,
            engine=NullEngine(),
            out_dir=CACHE / "gpu_checks-D",
            datamodule_class=FixedBatchDataModule,
            accelerator=cfg.accelerator,
            precision=precision,
        )
        datamodule.fixed_batch = fixed_batch(10, 2, 16, args.response_tokens)
        before = {n: p.detach().clone() for n, p in module.actor.named_parameters()}
        compute_dtypes = set()
        hook = module.actor.model.layers[0].mlp.gate_proj.register_forward_hook(
            lambda m, inputs, output: compute_dtypes.add(str(output.dtype))
        )
        trainer.fit(module, datamodule=datamodule)
        hook.remove()
        optimizer = module.optimizers().optimizer if hasattr(module.optimizers(), "optimizer") else module.optimizers()
        states = sorted({str(v.dtype) for s in optimizer.state.values() for k, v in s.items() if k != "step"})
        stored = sorted({str(p.dtype) for p in module.actor.parameters()})
        trainer_fraction[precision] = fraction_changed(
            {n: t.to(module.actor.get_parameter(n).dtype) for n, t in before.items()}, module.actor
        )
        rows.append(
            [
                f"lit-ppo trainer, precision={precision} ({module.actor_optimizer_steps} AdamW steps)",
                ", ".join(stored),
                ", ".join(sorted(compute_dtypes)),
                ", ".join(states),
                trainer_fraction[precision],
            ]
        )
        del trainer, module, datamodule, optimizer, before
        free_memory()

    report.note(
        f"model {describe(model_dir)}; AdamW lr {lr:g}, no weight decay; {steps} steps of next-token loss on "
        f"random tokens (FSDP2 and pure bf16, on a 1-rank {cfg.device.type} device mesh for FSDP2); the trainer "
        "rows train GRPO on a fixed batch. 'changed' = fraction of parameter elements that differ from their "
        "initial value (in the stored dtype)."
    )
    report.table(
        "bf16: what an update at lr 1e-6 changes",
        ["setup", "stored weights", "layer compute dtype", "AdamW states", "fraction changed"],
        rows,
    )
    report.check(
        "FSDP2 bf16-mixed keeps float32 master weights that change (>= 99%)",
        fsdp_fraction >= 0.99 and rows[0][1] == "torch.float32",
        f"{fsdp_fraction:.4f}",
    )
    report.check("FSDP2 bf16-mixed computes in bf16", "torch.bfloat16" in rows[0][2], rows[0][2])
    report.check(
        "trainer bf16-mixed keeps float32 weights that change (>= 99%)",
        trainer_fraction["bf16-mixed"] >= 0.99 and rows[2][1] == "torch.float32" and "torch.bfloat16" in rows[2][2],
        f"{trainer_fraction['bf16-mixed']:.4f}, compute {rows[2][2]}",
    )
    report.note(
        f"pure bf16 changed {bf16_fraction:.4f} and the trainer's bf16-true {trainer_fraction['bf16-true']:.4f} "
        "of the weights (expected small: the plan warns that bf16-true loses updates below bf16's resolution)"
    )
    report.data = {"rows": rows}


# ---------------------------------------------------------------- E. MFU


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int, repeats: int, inner: int) -> dict:
    """FLOP/s of n x n x n matmuls (2 n^3 each): `repeats` timings of `inner` back-to-back products after warm-up."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    synchronize(device)
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(inner):
            a @ b
        synchronize(device)
        rates.append(2 * n**3 * inner / (time.perf_counter() - started))
    return {"mean": sum(rates) / len(rates), "max": max(rates), "n": n}


def training_flops(shape: ModelShape, sequences: int, prompt_tokens: int, response_tokens: int) -> float:
    """Model FLOPs of one pass of training (forward + backward) over the batch:
    6 x (decoder-layer parameters) x (all positions) + 6 x vocab x hidden x (response positions: the LM head runs
    only where it predicts a response token) + 12 x layers x q_dim x S^2 per sequence (attention scores and
    values, PaLM's count, no causal halving); S = prompt + response tokens."""
    S = prompt_tokens + response_tokens
    body = 6 * shape.num_layers * shape.layer_parameters() * sequences * S
    head = 6 * shape.vocab_size * shape.hidden_size * sequences * response_tokens
    attention = 12 * shape.num_layers * shape.q_dim * S * S * sequences
    return float(body + head + attention)


def section_mfu(report: Report, cfg) -> None:
    from transformers import AutoTokenizer

    # On a CPU an 8192^3 product takes minutes: 2048^3 reaches its peak already.
    n, repeats, inner = (512, 3, 4) if cfg.smoke else ((8192, 5, 10) if cfg.cuda else (2048, 3, 3))
    # A CPU without native bf16 emulates it, at a small fraction of its float32 rate: a smaller product suffices.
    bf16_n = n if cfg.cuda or cfg.smoke else 1024
    peaks = {
        "bf16": matmul_peak(cfg.device, torch.bfloat16, bf16_n, repeats, 1 if bf16_n != n else inner),
        "float32": matmul_peak(cfg.device, torch.float32, n, repeats, inner // 2 or 1),
    }
    if cfg.cuda:
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high")
        peaks["tf32"] = matmul_peak(cfg.device, torch.float32, n, repeats, inner)
        torch.set_float32_matmul_precision(previous)
    report.table(
        f"matmul peak ({n} x {n} x {n}, mean of {repeats} x {inner} products after warm-up)",
        ["dtype", "mean TFLOP/s", "max TFLOP/s"],
        [[k, v["mean"] / 1e12, v["max"] / 1e12] for k, v in peaks.items()],
    )
    free_memory()

    # The precision a run gets here with `precision: auto`: bf16-mixed on a GPU, float32 on a CPU without native bf16.
    precision = resolve_precision("auto", cfg.accelerator)
    peak_dtype = "float32" if precision == "32-true" else "bf16"
    small = cfg.e_model == "24m" and not cfg.smoke
    model_dir = (
        shape_dir(cfg.small_model, None, cfg.device) if small else shape_dir(cfg.big_model, cfg.big_vocab, cfg.device)
    )
    shape = model_shape(model_dir)
    # GRPO on a fixed batch: 16 prompts x 4 samples, 2 AdamW steps of 32 in micro-batches of 8, 3 rollout steps
    # (the first warm-up). Response and prompt lengths by model: the 24 M one is bench/train_phase.py's workload.
    args = argparse.Namespace(
        rollout_batch_size=16,
        samples_per_prompt=4,
        train_batch_size=32,
        micro_batch_size=8,
        response_tokens=64 if small else 512,
        steps=3,
        lr=1e-5,
        seed=0,
        repeats=cfg.e_repeats,
        prompt_length=16 if small else 128,
    )
    if cfg.smoke:
        vars(args).update(
            rollout_batch_size=4,
            samples_per_prompt=2,
            train_batch_size=4,
            micro_batch_size=2,
            response_tokens=16,
            steps=2,
            repeats=1,
            prompt_length=8,
        )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = fixed_batch(
        args.rollout_batch_size, args.samples_per_prompt, args.prompt_length, args.response_tokens, args.seed
    )
    N, P, T = len(batch.response_ids), args.prompt_length, args.response_tokens
    flops = training_flops(shape, N, P, T)
    results: dict[str, list[float]] = {"lit-ppo": [], "plain": []}
    for rep in range(args.repeats):
        for name in ("lit-ppo", "plain") if rep % 2 == 0 else ("plain", "lit-ppo"):
            if cfg.over_budget(extra=90):  # section E may run 90 s past the budget at which sections still start
                report.note(
                    f"stopped early: over the time budget ({cfg.budget_s:g} + 90 s) before {name} repetition {rep + 1}"
                )
                break
            if name == "lit-ppo":
                r = run_litppo(
                    args,
                    model_dir,
                    arithmetic_prompt_file(64),
                    batch,
                    accelerator=cfg.accelerator,
                    precision=precision,
                )
            else:
                r = run_plain(
                    args, model_dir, batch, tokenizer.pad_token_id, device=str(cfg.device), precision=precision
                )
            results[name] += r["train_s"]
            print(
                f"  repetition {rep + 1} {name}: training phase {', '.join(f'{s:.3f}' for s in r['train_s'])} s",
                flush=True,
            )
            free_memory()
    if cfg.profile:
        profile_training_phases(args, model_dir, batch, tokenizer.pad_token_id, cfg, precision)
    rows = []
    medians = {}
    for name, seconds in results.items():
        if not seconds:
            continue
        s = sorted(seconds)[len(seconds) // 2]
        medians[name] = s
        rows.append(
            [name, len(seconds), s, N * (P + T) / s, N * T / s, flops / s / 1e12, flops / s / peaks[peak_dtype]["mean"]]
        )
    report.note(
        f"model {describe(model_dir)}; {precision} ({PRECISION_WORDS[precision]}); fixed batch "
        f"{N} sequences x ({P} prompt + {T} response) tokens, {N // args.train_batch_size} AdamW steps of "
        f"{args.train_batch_size} sequences in micro-batches of {args.micro_batch_size}; {args.steps} rollout "
        f"steps per run, the first not counted; runs alternate. Model FLOPs per training phase "
        f"{flops:.3e} = {' '.join(training_flops.__doc__.split(':', 1)[1].split())} MFU = model FLOP/s / measured "
        f"{peak_dtype} matmul peak (mean)."
    )
    report.table(
        f"training phase (GRPO, {precision})",
        [
            "loop",
            "timed steps",
            "median s",
            "tokens/s (all positions)",
            "response tokens/s",
            "model TFLOP/s",
            f"MFU (of measured {peak_dtype} peak)",
        ],
        rows,
    )
    if len(medians) == 2:
        report.note(f"lit-ppo / plain loop tokens per second: {medians['plain'] / medians['lit-ppo']:.3f} (medians)")
    report.data = {"peaks": peaks, "rows": rows, "flops": flops, "train_s": results}


PRECISION_WORDS = {
    "bf16-mixed": "float32 weights and AdamW, bf16 autocast",
    "32-true": "float32 throughout",
    "bf16-true": "bf16 weights and AdamW",
}


# ---------------------------------------------------------------- main

SECTIONS = {
    "A": ("collectives on a device-strict backend (issue 13)", section_collectives),
    "B": ("gradient checkpointing recomputes and lowers the peak (issue 13)", section_checkpointing),
    "C": ("memory estimate vs measured peak (issue 13)", section_memory),
    "D": ("bf16 with float32 master weights (issue 18)", section_bf16),
    "E": ("MFU of the training phase (issue 14)", section_mfu),
}


def profile_training_phases(args, model_dir, batch, pad_token_id, cfg, precision: str) -> None:
    """One run of each loop under torch.profiler: where lit-ppo's training phase spends what the plain loop does not.
    The tables are of whole runs (model loading included); the operators that differ are what matters."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cfg.cuda else [])
    sort = "self_cuda_time_total" if cfg.cuda else "self_cpu_time_total"
    one_step = argparse.Namespace(**{**vars(args), "steps": 2})
    for name in ("lit-ppo", "plain"):
        with profile(activities=activities) as prof:
            if name == "lit-ppo":
                r = run_litppo(
                    one_step,
                    model_dir,
                    arithmetic_prompt_file(64),
                    batch,
                    accelerator=cfg.accelerator,
                    precision=precision,
                )
            else:
                r = run_plain(one_step, model_dir, batch, pad_token_id, device=str(cfg.device), precision=precision)
        print(f"\n### profile: {name} (training phases {r['train_s']} s), top operators by {sort}\n", flush=True)
        print(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60), flush=True)
        free_memory()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes: checks that the script runs; measures nothing"
    )
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections, e.g. A,B")
    parser.add_argument(
        "--out",
        default=str(Path(os.environ["OUT"]) / "gpu_checks.json") if os.environ.get("OUT") else None,
        help="the JSON report (default: $OUT/gpu_checks.json when OUT is set)",
    )
    parser.add_argument("--e-repeats", type=int, default=2, help="E: alternating repetitions of each loop")
    parser.add_argument(
        "--e-model",
        choices=["0.5b", "24m"],
        default=None,
        help="E: the Qwen2.5-0.5B shape (default on cuda) or the 24 M bench model (default on cpu)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="E: also run lit-ppo and the plain loop once each under torch.profiler and print their top operators",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=400.0,
        help="seconds after which no section starts (E stops its repetitions 90 s later): the run "
        "must fit a 10-minute slot",
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "--device cuda: no CUDA device is visible; fix: run on a GPU machine or pass --device cpu --smoke"
        )
    only = [s.strip().upper() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        raise SystemExit(f"--only {args.only}: unknown sections {unknown}; fix: use some of {', '.join(SECTIONS)}")

    started = time.perf_counter()
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cuda = device.type == "cuda"
    cfg = argparse.Namespace(
        device=device,
        cuda=cuda,
        smoke=args.smoke,
        accelerator="cuda" if cuda else "cpu",
        precision="bf16-mixed",
        budget_s=args.budget_s,
        profile=args.profile,
        e_repeats=args.e_repeats,
        e_model=args.e_model or ("0.5b" if cuda else "24m"),
        small_model=SMOKE_MODEL if args.smoke else BENCH_24M,
        big_model=SMOKE_WIDE if args.smoke else QWEN05B,
        big_vocab=SMOKE_WIDE_VOCAB if args.smoke else QWEN05B_VOCAB,
        autocast=lambda: torch.autocast(device.type, dtype=torch.bfloat16) if cuda else nullcontext(),
        over_budget=lambda extra=0.0: time.perf_counter() - started > args.budget_s + extra,
    )
    L.seed_everything(0, verbose=False)

    print("# lit-ppo GPU checks\n")
    print(f"- command: `{command_line()}`")
    print(f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    print(f"- machine: {machine()}")
    print("- versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()) + f"; python {sys.version.split()[0]}")
    if cuda:
        props = torch.cuda.get_device_properties(device)
        print(f"- device: {props.name}, {props.total_memory / GIB:.1f} GiB, capability {props.major}.{props.minor}")
    if args.smoke:
        print("- mode: SMOKE (tiny shapes: checks that the script runs; the figures mean nothing)")

    report = Report()
    for key in only:
        title, run = SECTIONS[key]
        if cfg.over_budget():
            report.sections[key] = {
                "title": title,
                "status": "skipped",
                "checks": [],
                "tables": [],
                "notes": [
                    f"not started: {time.perf_counter() - started:.0f} s elapsed, over --budget-s {args.budget_s:g}"
                ],
            }
            print(f"\n## {key}. {title}\n\nSKIPPED (time budget)", flush=True)
            continue
        report.data = None
        with report.section(key, title) as section:
            run(report, cfg)
        if report.data is not None:
            section["data"] = report.data
    if dist.is_initialized():
        dist.destroy_process_group()

    total = time.perf_counter() - started
    print("\n## Summary\n")
    print("| section | status | seconds | checks |\n|---|---|---|---|")
    for key, s in report.sections.items():
        checks = "; ".join(f"{'PASS' if c['ok'] else 'FAIL'} {c['name']}" for c in s["checks"]) or "-"
        print(f"| {key} {s['title']} | {s['status'].upper()} | {s.get('seconds', '-')} | {checks} |")
    print(f"\ntotal {total:.0f} s; {'FAILED' if report.failed() else 'all checks passed'}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {
                    "command": command_line(),
                    "device": str(device),
                    "smoke": args.smoke,
                    "total_seconds": round(total, 1),
                    "failed": report.failed(),
                    "versions": versions(),
                    "sections": report.sections,
                },
                indent=1,
                default=str,
            )
        )
        print(f"JSON report: {out}")
    sys.exit(1 if report.failed() else 0)


if __name__ == "__main__":
    main()
