"""What the CPU tests cannot show, on a CUDA device (issues 13 and 18): collectives under NCCL, the peak memory of
gradient checkpointing, the memory estimate against the allocator's measured peak, and bf16 with float32 master
weights. Skipped without CUDA, so `make test` on a CPU machine skips them; run them on a GPU with
`python -m pytest -m gpu`. Their CPU counterparts: tests/test_collectives.py (device-strict collectives, two gloo
ranks), tests/training/test_gradient_checkpointing.py (decoder layers recomputed), tests/test_memory.py (the estimate by hand),
tests/test_precision.py (every precision runs; FSDP2 bf16-mixed keeps float32 master weights). The MFU measurement
that ran beside these checks is a benchmark: bench/mfu.py."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist

from lit_ppo.config import RolloutConfig, RolloutCorrectionConfig
from lit_ppo.memory import GIB, MemoryInputs, estimate_memory
from lit_ppo.model_shape import ModelShape
from lit_ppo.testing import FixedBatchDataModule, random_rollout_batch
from tests.helpers import LastTokenEngine, build_run, compose_run_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEVICE = torch.device("cuda", 0)
MODEL_24M = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1408)
"""bench/common.BENCH_MODEL: 23.7 M parameters, 128-token vocabulary."""
QWEN05B = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864)
QWEN05B_VOCAB = 151936
"""Qwen2.5-0.5B's shape (494 M parameters with its vocabulary, tied embeddings), random weights."""


def build_model(path: Path, vocab_size: int | None = None, **size) -> str:
    from lit_ppo.demo.tiny import build_char_tokenizer, build_tiny_model, save_model_dir

    tokenizer = build_char_tokenizer()
    with torch.device(DEVICE):  # random initialization of 0.5 B parameters is quicker on the GPU
        model = build_tiny_model(tokenizer, max_position_embeddings=2048, seed=0, **size)
        if vocab_size:  # the extra rows are never emitted by the character tokenizer; they cost what Qwen's do
            model.resize_token_embeddings(vocab_size, mean_resizing=False)
    return str(save_model_dir(model.to("cpu"), tokenizer, path))


@pytest.fixture(scope="module")
def model_24m(tmp_path_factory) -> str:
    return build_model(tmp_path_factory.mktemp("gpu") / "24m", **MODEL_24M)


@pytest.fixture(scope="module")
def model_05b(tmp_path_factory) -> str:
    return build_model(tmp_path_factory.mktemp("gpu") / "05b", QWEN05B_VOCAB, **QWEN05B)


@pytest.fixture(scope="module")
def process_group():
    """A 1-rank NCCL group (no CPU backend: a CPU tensor in a collective fails, as on many GPUs)."""
    rendezvous = Path(tempfile.mkdtemp(prefix="test_gpu-")) / "rendezvous"  # a file: no port to race for
    dist.init_process_group("nccl", init_method=f"file://{rendezvous}", rank=0, world_size=1, device_id=DEVICE)
    yield
    dist.destroy_process_group()


def fixed_batch(prompts: int, samples: int, prompt_tokens: int, response_tokens: int):
    """lit_ppo.testing.random_rollout_batch over random prompts; ids 4..99 are the character tokenizer's ordinary
    tokens."""
    ids = torch.randint(4, 100, (prompts, prompt_tokens), generator=torch.Generator().manual_seed(1)).tolist()
    return random_rollout_batch(ids, samples, response_tokens, range(4, 100), seed=0)


def peak_above(baseline: int) -> float:
    torch.cuda.synchronize(DEVICE)
    return (torch.cuda.max_memory_allocated(DEVICE) - baseline) / GIB


def test_ppo_rollout_steps_and_evaluation_reduce_on_the_gpu_under_nccl(
    model_24m, arithmetic_files, tmp_path, process_group, monkeypatch
):
    """The path that crashed before issue 13 ("No backend type associated with device type cpu"): every
    global_sum/global_max of a PPO rollout step (critic, reference, GAE, KL, TIS rollout correction) and of
    evaluation goes through NCCL with its tensors on the GPU. The world size reads 2 on the 1-rank group, so that
    the reductions really call all_reduce (an identity on one rank)."""
    import lit_ppo.distributed

    calls: list[str] = []
    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "reduce"):

        def strict(*args, _name=name, _original=getattr(dist, name), **kwargs):
            tensors = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            off = [str(t.device) for t in tensors if t.device != DEVICE]
            assert not off, f"{_name} got tensors on {off}"
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(dist, name, strict)
    monkeypatch.setattr(lit_ppo.distributed, "world_size", lambda: 2)
    T = 64
    trainer, module, datamodule, _ = build_run(
        model_24m,
        LastTokenEngine(),
        arithmetic_files,
        tmp_path,
        total_rollout_steps=2,
        rollout=RolloutConfig(
            max_response_tokens=T, max_model_len=256, eval_samples_per_prompt=2, max_logprob_abs_diff=None
        ),
        accelerator="cuda",
        precision="bf16-mixed",
        datamodule_class=FixedBatchDataModule,
        rollout_batch_size=8,
        n_samples_per_prompt=4,
        train_batch_size=16,
        micro_train_batch_size=8,
        kl_coef=0.01,
        rollout_correction=RolloutCorrectionConfig(mode="tis"),
    )
    # Sampler log-probs near the random model's (-log 128), so that the rollout-correction reductions run.
    batch = fixed_batch(8, 4, 32, T)
    datamodule.fixed_batch = dataclasses.replace(batch, rollout_logprobs=[[-4.8] * T for _ in batch.response_ids])
    trainer.fit(module, datamodule=datamodule)
    evaluation = datamodule.evaluate()
    assert module.rollout_step == 2 and module.critic is not None and module.reference is not None
    assert set(evaluation) >= {"eval/reward", "eval/pass@2"}
    assert calls and set(calls) == {"all_reduce"}


def test_gradient_checkpointing_recomputes_each_layer_and_lowers_the_peak(model_24m):
    """One micro-batch of 4 x (128 + 1024) tokens under bf16 autocast through lit-ppo's log-prob code: with
    checkpointing each decoder layer runs twice (recomputed in backward) and the peak above the weights is lower."""
    from transformers import AutoModelForCausalLM

    from lit_ppo.training.batching import pack
    from lit_ppo.training.logits import logprobs_and_entropy
    from lit_ppo.training.models import prepare_for_training

    B, P, T = 4, 128, 1024
    batch = fixed_batch(1, B, P, T)
    calls, peaks = {}, {}
    for checkpointing in (False, True):
        model = prepare_for_training(AutoModelForCausalLM.from_pretrained(model_24m), checkpointing).to(DEVICE)
        count = [0]
        # A pre-hook: non-reentrant recomputation stops once it has what the backward needs, before a forward hook.
        for layer in model.model.layers:
            layer.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
        mb = pack(batch.prompt_ids, batch.response_ids, 0, DEVICE)
        torch.cuda.synchronize(DEVICE)
        baseline = torch.cuda.memory_allocated(DEVICE)
        torch.cuda.reset_peak_memory_stats(DEVICE)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(
                input_ids=mb.input_ids,
                attention_mask=mb.attention_mask,
                position_ids=mb.position_ids,
                logits_to_keep=T + 1,
            ).logits
            logp, _ = logprobs_and_entropy(logits, mb.response_ids)
            loss = -(logp * mb.response_mask).sum() / mb.response_mask.sum()
        loss.backward()
        peaks[checkpointing] = peak_above(baseline)
        calls[checkpointing] = count[0]
        del model, logits, logp, loss, mb
        torch.cuda.empty_cache()
    assert calls == {False: 8, True: 16}
    assert peaks[True] < peaks[False], peaks


class PeakOfStep(L.Callback):
    """The CUDA allocator's peak during each rollout step (reset when the step starts), one figure per step."""

    def __init__(self):
        self.peaks: list[int] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        torch.cuda.synchronize(DEVICE)
        torch.cuda.reset_peak_memory_stats(DEVICE)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        torch.cuda.synchronize(DEVICE)
        self.peaks.append(torch.cuda.max_memory_allocated(DEVICE))


@pytest.mark.parametrize(
    "model, precision, checkpointing",
    [
        ("24m", "bf16-mixed", False),
        ("24m", "bf16-mixed", True),
        pytest.param("05b", "32-true", False, marks=pytest.mark.slow),
        pytest.param("05b", "32-true", True, marks=pytest.mark.slow),
        pytest.param("05b", "bf16-mixed", False, marks=pytest.mark.slow),
        pytest.param("05b", "bf16-mixed", True, marks=pytest.mark.slow),
    ],
)
def test_memory_estimate_is_within_30_percent_of_the_measured_peak(
    model, precision, checkpointing, request, arithmetic_files, tmp_path
):
    """`mode=plan`'s estimate of the training phase (lit_ppo.memory.estimate_memory) against the allocator's peak of
    a real rollout step (actor, critic, reference, AdamW; micro-batch 4 x (128 + 1024) tokens). Measured at steady
    state: the second step, when AdamW's states coexist with the activations. The 24 M model in float32 is left out:
    on an H100 it measured 0.68 (BENCHMARKS.md, "On a GPU"), a known gap of the estimate, not checked here."""
    model_dir = request.getfixturevalue("model_24m" if model == "24m" else "model_05b")
    B, P, T = 4, 128, 1024
    peak = PeakOfStep()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(DEVICE)
    trainer, module, datamodule, plan = build_run(
        model_dir,
        LastTokenEngine(),
        arithmetic_files,
        tmp_path,
        total_rollout_steps=2,
        rollout=RolloutConfig(max_response_tokens=T, max_model_len=P + T),
        callbacks=[peak],
        gradient_checkpointing=checkpointing,
        accelerator="cuda",
        precision=precision,
        datamodule_class=FixedBatchDataModule,
        rollout_batch_size=1,
        n_samples_per_prompt=B,
        train_batch_size=B,
        micro_train_batch_size=B,
        kl_coef=0.01,
    )
    datamodule.fixed_batch = fixed_batch(1, B, P, T)
    trainer.fit(module, datamodule=datamodule)
    shape = ModelShape.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))
    inputs = MemoryInputs(
        precision=precision,
        strategy="single",
        data_parallel_size=1,
        micro_batch_size=B,
        prompt_tokens=P,
        response_tokens=T,
        gradient_checkpointing=checkpointing,
        critic=plan.models.critic_enabled,
        reference=plan.models.reference_enabled,
        rollout_dtype=plan.models.rollout_dtype,
        rollout_sequences=plan.counts.samples_per_rank_per_rollout_step,
        max_model_len=P + T,
        on_gpu=True,
    )
    estimated = estimate_memory(shape, inputs).training_bytes
    assert plan.models.critic_enabled and plan.models.reference_enabled and len(peak.peaks) >= 2
    measured = peak.peaks[1] - before  # (a third call, which ends the stream, trains nothing)
    assert 0.7 <= estimated / measured <= 1.3, f"estimated {estimated / GIB:.2f} GiB, measured {measured / GIB:.2f}"


def fraction_changed(before: dict[str, torch.Tensor], model) -> float:
    """Share of the parameter elements that differ from `before` (in the stored dtype)."""
    changed = total = 0
    for name, p in model.named_parameters():
        now = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
        changed += int((now != before[name].to(now.dtype)).sum())
        total += now.numel()
    return changed / total


def test_fsdp2_bf16_mixed_keeps_float32_master_weights_that_lr_1e6_moves(model_24m, process_group):
    """FSDP2 `shard_models(bf16_mixed=True)` on a 1-rank NCCL mesh: float32 shards and AdamW states, layers that
    compute in bf16, and 10 AdamW steps at lr 1e-6 change >= 99 % of the weights. The control, the same steps on
    weights stored in bf16, changes few: each update is far below bf16's resolution at |w| ~ 0.02."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from lit_ppo.distributed import shard_models
    from lit_ppo.training.models import prepare_for_training

    ids = torch.randint(4, 100, (8, 256), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    fractions, dtypes = {}, {}
    for setup in ("fsdp2 bf16-mixed", "pure bf16"):
        model = prepare_for_training(AutoModelForCausalLM.from_pretrained(model_24m, dtype=torch.float32), False)
        if setup == "pure bf16":
            model.to(DEVICE, dtype=torch.bfloat16)
        else:
            model.to(DEVICE)
            mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("data_parallel",))
            shard_models((model,), mesh["data_parallel"], bf16_mixed=True)
        compute = set()
        model.model.layers[0].mlp.gate_proj.register_forward_hook(lambda m, i, out: compute.add(out.dtype))
        before = {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()
        }
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
        for _ in range(10):
            model(input_ids=ids, labels=ids).loss.backward()  # next-token loss: a gradient for every parameter
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        fractions[setup] = fraction_changed(before, model)
        states = {v.dtype for s in optimizer.state.values() for k, v in s.items() if k != "step"}
        dtypes[setup] = ({p.dtype for p in model.parameters()}, compute, states)
        del model, optimizer, before
        torch.cuda.empty_cache()
    assert dtypes["fsdp2 bf16-mixed"] == ({torch.float32}, {torch.bfloat16}, {torch.float32})
    assert fractions["fsdp2 bf16-mixed"] >= 0.99 and fractions["pure bf16"] < 0.5, fractions


def test_trainer_bf16_mixed_keeps_float32_weights_that_lr_1e6_moves(model_24m, arithmetic_files, tmp_path):
    """The trainer at precision=bf16-mixed on one GPU: float32 weights and AdamW states, bf16 compute, and
    10 AdamW steps at lr 1e-6 change >= 99 % of the actor's weights; at bf16-true (the control, which the plan warns
    about) few change."""
    grpo = compose_run_config("ppo=grpo").ppo  # no critic: the optimizer's states are the actor's
    fractions, dtypes = {}, {}
    for precision in ("bf16-mixed", "bf16-true"):
        trainer, module, datamodule, _ = build_run(
            model_24m,
            LastTokenEngine(),
            arithmetic_files,
            tmp_path / precision,
            total_rollout_steps=2,
            rollout=RolloutConfig(max_response_tokens=64),
            accelerator="cuda",
            precision=precision,
            datamodule_class=FixedBatchDataModule,
            **{
                **{f.name: getattr(grpo, f.name) for f in dataclasses.fields(grpo)},
                "rollout_batch_size": 10,
                "n_samples_per_prompt": 2,
                "train_batch_size": 4,
                "micro_train_batch_size": 4,
                "ppo_epochs": 1,
                "actor_lr": 1e-6,
                "kl_coef": 0.0,
            },
        )
        datamodule.fixed_batch = fixed_batch(10, 2, 16, 64)
        before = {n: p.detach().clone() for n, p in module.actor.named_parameters()}
        compute = set()
        module.actor.model.layers[0].mlp.gate_proj.register_forward_hook(lambda m, i, out: compute.add(out.dtype))
        trainer.fit(module, datamodule=datamodule)
        optimizer = module.optimizers()
        optimizer = getattr(optimizer, "optimizer", optimizer)  # Lightning's wrapper
        states = {v.dtype for s in optimizer.state.values() for k, v in s.items() if k != "step"}
        assert module.critic is None and module.actor_optimizer_steps == 10
        fractions[precision] = fraction_changed(before, module.actor)
        dtypes[precision] = ({p.dtype for p in module.actor.parameters()}, compute, states)
        del trainer, module, datamodule, optimizer, before
        torch.cuda.empty_cache()
    assert dtypes["bf16-mixed"] == ({torch.float32}, {torch.bfloat16}, {torch.float32})
    assert fractions["bf16-mixed"] >= 0.99 and fractions["bf16-true"] < 0.5, fractions
