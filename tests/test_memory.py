"""The memory pre-flight: hand-computed estimates for a small shape, and `mode=plan` printing and saving them."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lit_ppo.memory import GIB, MemoryInputs, estimate_memory
from lit_ppo.model_shape import ModelShape
from lit_ppo.run import entry as run_module
from tests.helpers import compose_config

# vocab 100, hidden 8 (2 heads of 4; 1 KV head: kv_dim 4), intermediate 16, 2 layers, tied, q/k/v biases.
SHAPE = ModelShape(vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2, num_kv_heads=1)
RUN = MemoryInputs(
    precision="32-true",
    strategy="single",
    data_parallel_size=1,
    micro_batch_size=2,
    prompt_tokens=3,
    response_tokens=5,
    gradient_checkpointing=False,
    critic=True,
    reference=True,
    rollout_dtype="float32",
    rollout_sequences=4,
    max_model_len=16,
    on_gpu=True,
    gpu_memory_utilization=0.5,
    device_memory_gib=1.0,
)


def rows(estimate) -> dict[str, int]:
    return {what: size for what, size, _ in estimate.rows}


def test_parameter_count_by_hand():
    # layer: q 8x8 + k,v 2 x 8x4 + o 8x8 + biases 8+4+4 = 208; MLP 3 x 8x16 = 384; two norms 16 -> 608
    assert SHAPE.layer_parameters() == 608
    assert SHAPE.embedding_parameters() == 100 * 8 + 8  # tied LM head, final norm
    assert SHAPE.parameters() == 2 * 608 + 808 == 2024


def test_qwen_sizes_match_the_published_parameter_counts():
    qwen05 = ModelShape(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2
    )
    qwen7 = ModelShape(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        tie_word_embeddings=False,
    )
    assert qwen05.parameters() == pytest.approx(0.494e9, rel=0.01)  # "0.49B"
    assert qwen7.parameters() == pytest.approx(7.62e9, rel=0.01)  # "7.61B"


def test_single_float32_estimate_by_hand():
    e = estimate_memory(SHAPE, RUN)
    r = rows(e)
    assert r["weights"] == 3 * 2024 * 4  # actor, critic, reference
    assert r["gradients"] == 2 * 2024 * 4
    assert r["optimizer states"] == 2 * 2024 * 8
    # a layer: 2 x 8 tokens x (10 x 8 + 4 x 16) x 4 B = 9216; its mask 2 x 8 x 8 x 4 B = 512. Without checkpointing
    # 2 layers x (layer + mask) + one layer's backward; with: 16 tokens x 2 layers x 8 x 4 B + a layer + a mask
    assert r["activations, no checkpointing"] == 2 * (9216 + 512) + 9216 == 28672
    assert r["activations, checkpointing"] == 16 * 2 * 8 * 4 + 9216 + 512 == 10752
    assert (
        r["logits"] == 10 * 100 * 4 + 4 * 5 * 100 * 4
    )  # logits (their gradient in place), 4 float32 chunks of 5 tokens
    assert r["vLLM weights"] == 2024 * 4
    assert r["vLLM KV cache, all in flight"] == 4 * 16 * 2 * 2 * 4 * 4
    assert r["vLLM reservation"] == GIB // 2
    assert e.training_bytes == 24288 + 16192 + 32384 + 28672 + 12000
    assert e.rollout_bytes == 24288 + 32384 + GIB // 2
    assert e.peak_bytes == e.rollout_bytes and e.warning is None  # vLLM sleeps while training on a GPU


def test_checkpointing_ddp_fsdp_and_bf16_by_hand():
    assert (
        estimate_memory(SHAPE, dataclasses.replace(RUN, gradient_checkpointing=True)).training_bytes
        == 24288 + 16192 + 32384 + 10752 + 12000
    )
    ddp = rows(estimate_memory(SHAPE, dataclasses.replace(RUN, strategy="ddp", data_parallel_size=2)))
    assert ddp["DDP gradient buckets"] == 2024 * 4 and ddp["weights"] == 24288
    fsdp = rows(estimate_memory(SHAPE, dataclasses.replace(RUN, strategy="fsdp", data_parallel_size=2)))
    assert fsdp["weights"] == 24288 // 2 and fsdp["gradients"] == 16192 // 2 and fsdp["optimizer states"] == 32384 // 2
    assert fsdp["FSDP gathered units"] == (808 + 608) * (4 + 4)
    assert "FSDP unsharded gradients" not in fsdp
    accumulating = rows(
        estimate_memory(
            SHAPE, dataclasses.replace(RUN, strategy="fsdp", data_parallel_size=2, grad_accumulation_steps=4)
        )
    )
    assert accumulating["FSDP unsharded gradients"] == 2 * 2024 * 4  # actor and critic, float32, whole
    bf16 = rows(estimate_memory(SHAPE, dataclasses.replace(RUN, precision="bf16-mixed", rollout_dtype="bfloat16")))
    assert bf16["weights"] == 24288 and bf16["autocast weight copies"] == 2024 * 2
    assert bf16["activations, no checkpointing"] == 28672 // 2 and bf16["logits"] == 10 * 100 * 2 + 4 * 5 * 100 * 4
    true16 = rows(estimate_memory(SHAPE, dataclasses.replace(RUN, precision="bf16-true")))
    assert true16["weights"] == 24288 // 2 and true16["optimizer states"] == 32384 // 2


def test_hf_engine_counts_its_generate_cache_not_a_second_copy_of_the_weights():
    # rollout.engine=hf: the actor generates, so no vLLM weights or reservation; one generate call of 4 sequences
    # x (3 + 5) tokens holds its KV cache (2 layers x K and V x kv_dim 4 x 4 B) and one float32 logits row each.
    hf = dataclasses.replace(RUN, rollout_engine="hf")
    e = estimate_memory(SHAPE, hf)
    r = rows(e)
    assert not any(what.startswith("vLLM") for what in r)
    kv_and_logits = 4 * 8 * 2 * 2 * 4 * 4 + 4 * 100 * 4
    assert r["HF generate KV cache and logits"] == kv_and_logits
    assert e.rollout_bytes == 24288 + 32384 + kv_and_logits
    assert e.training_bytes == estimate_memory(SHAPE, RUN).training_bytes  # freed before training
    halves = rows(estimate_memory(SHAPE, dataclasses.replace(hf, hf_batch_sequences=2)))
    assert halves["HF generate KV cache and logits"] == kv_and_logits // 2


def test_plan_mode_memory_follows_the_rollout_engine(tmp_path, capsys):
    run_module.main(compose_config("+experiment=qwen1.5b", "mode=plan", "rollout.engine=hf", f"output_dir={tmp_path}"))
    memory = json.loads((tmp_path / "plan.json").read_text())["memory"]
    whats = [row["what"] for row in memory["rows"]]
    assert "HF generate KV cache and logits" in whats and not any(w.startswith("vLLM") for w in whats)


def test_over_the_device_memory_warns_in_one_line():
    cpu = dataclasses.replace(RUN, on_gpu=False, cpu_kv_cache_gib=0, device_memory_gib=100_000 / GIB)
    e = estimate_memory(SHAPE, cpu)
    assert e.peak_bytes == 113536 + 2024 * 4  # on CPU vLLM stays resident while training
    assert e.warning and "\n" not in e.warning and "micro_train_batch_size" in e.warning
    assert f"warning: {e.warning}" in e.table()


def test_plan_mode_prints_and_saves_the_memory_of_a_real_experiment(tmp_path, capsys):
    """qwen7b from its declared architecture (no weights here), on 32 GiB devices: over, so a warning."""
    cfg = compose_config("+experiment=qwen7b", "mode=plan", f"output_dir={tmp_path}", "strategy.device_memory_gib=32")
    run_module.main(cfg)
    out = capsys.readouterr().out
    assert (
        "Memory per device (estimate; model shape from model.architecture; device: GPU of strategy.device_memory_gib)"
        in out
    )
    assert "activations, checkpointing" in out and "vLLM reservation" in out
    memory = json.loads((tmp_path / "plan.json").read_text())["memory"]
    assert memory["device_memory_gib"] == 32 and memory["peak_gib"] > 32
    assert memory["warning"] and f"warning: {memory['warning']}" in out
    assert {row["what"] for row in memory["rows"]} >= {
        "weights",
        "gradients",
        "optimizer states",
        "logits",
        "vLLM weights",
    }


# qwen7b_long: 16k-token responses, C = 4, fitting with gradient checkpointing (~97 GiB without)
@pytest.mark.parametrize("experiment", ["qwen7b", "qwen1.5b", "qwen0.5b", "gsm8k_tools", "qwen7b_long"])
def test_an_experiment_is_estimated_for_the_gpus_it_is_for_and_fits_them(experiment, tmp_path, capsys):
    """`+experiment=qwen7b mode=plan` on this CPU machine estimates the 80 GB GPUs the experiment declares (vLLM
    reserving its share of one), not this machine, and each experiment's own estimate fits them (else a warning)."""
    cfg = compose_config(f"+experiment={experiment}", "mode=plan", f"output_dir={tmp_path}")
    run_module.main(cfg)
    out = capsys.readouterr().out
    memory = json.loads((tmp_path / "plan.json").read_text())["memory"]
    assert memory["device_memory_gib"] == 79.6 and memory["device_from"] == "GPU of strategy.device_memory_gib"
    assert "device: GPU of strategy.device_memory_gib" in out
    rows = {row["what"]: row for row in memory["rows"]}
    assert "vLLM reservation" in rows and "vLLM KV cache (CPU)" not in rows
    assert rows["vLLM reservation"]["gib"] == pytest.approx(0.6 * 79.6, abs=0.01)
    assert memory["peak_gib"] <= 79.6 and memory["warning"] is None, memory["warning"]


def test_plan_mode_reads_a_local_config_json(tiny_model_dir, tmp_path, capsys):
    cfg = compose_config("mode=plan", f"output_dir={tmp_path}", f"model.path={tiny_model_dir}")
    run_module.main(cfg)
    memory = json.loads((tmp_path / "plan.json").read_text())["memory"]
    assert memory["model_shape_from"].endswith("config.json") and memory["warning"] is None


def test_device_peak_memory_reads_and_resets_the_cuda_peak_and_is_none_on_cpu(monkeypatch):
    """perf/device_peak_memory_gib (the figure issue 28 sets beside the plan's estimate on a GPU): each call returns
    the allocator's peak since the last one and resets it, so every rollout step reports its own; off CUDA, nothing.
    The CUDA counters are stood in for here (this machine has none); tests/end_to_end/test_gpu.py reads the real ones."""
    import torch

    from lit_ppo.training.metrics import device_peak_memory_gib

    assert device_peak_memory_gib(torch.device("cpu")) is None
    peaks = {"value": 3 * 1024**3, "resets": 0}

    def reset(device):
        peaks["value"], peaks["resets"] = 0, peaks["resets"] + 1

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: peaks["value"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    assert device_peak_memory_gib(torch.device("cuda", 0)) == 3.0
    assert peaks["resets"] == 1
    assert device_peak_memory_gib(torch.device("cuda", 0)) == 0.0


def test_with_rollout_workers_generation_is_counted_on_the_workers_not_on_the_trainers_device():
    """rollout.mode=disaggregated: the trainer's device holds no vLLM (its rollout phase is its weights and optimizer
    states); each worker holds vLLM's weights, the KV cache of its share of every rank's sequences, and up to
    max(k, 1) received pushes in host memory (float32 weights, or the adapter)."""
    colocated = estimate_memory(SHAPE, RUN)
    workers = estimate_memory(SHAPE, dataclasses.replace(RUN, rollout_workers=2, max_staleness=2))
    assert not any(what.startswith("vLLM") for what in rows(workers))
    assert workers.rollout_bytes == 24288 + 32384 and workers.training_bytes == colocated.training_bytes
    w = dict((what, b) for what, b, _ in workers.worker_rows)
    assert w["vLLM weights"] == 2024 * 4
    assert w["vLLM KV cache, all in flight"] == 2 * 16 * 2 * 2 * 4 * 4  # 4 sequences x 1 rank / 2 workers
    assert w["received pushes not yet applied"] == 2 * 2024 * 4
    # on a GPU vLLM reserves gpu_memory_utilization of the (same kind of) device, its weights and cache inside it
    assert workers.worker_bytes == w["vLLM reservation"] + w["received pushes not yet applied"]
    assert "Memory per rollout worker" in workers.table() and "worker_rows" in workers.to_dict()
    assert "Memory per rollout worker" not in colocated.table() and "worker_rows" not in colocated.to_dict()


def test_rollout_workers_sharing_the_trainers_device_count_their_engines_there_and_their_pushes_in_host_memory():
    """rollout.workers.devices=0 (one GPU for the trainer and its worker): each worker's engine (vLLM's reservation
    here) is on the trainer's device in both phases; the pushes it holds are in host memory, not on the device."""
    own = estimate_memory(SHAPE, dataclasses.replace(RUN, rollout_workers=2, max_staleness=2))
    shared = estimate_memory(
        SHAPE, dataclasses.replace(RUN, rollout_workers=2, max_staleness=2, workers_share_device=True)
    )
    w = dict((what, b) for what, b, _ in shared.worker_rows)
    engines = 2 * w["vLLM reservation"]
    assert rows(shared)["rollout workers' engines (on this device)"] == engines
    assert shared.training_bytes == own.training_bytes
    assert shared.peak_bytes == max(own.training_bytes + engines, own.rollout_bytes + engines)
    assert shared.worker_bytes == own.worker_bytes


def test_the_teacher_weights_are_in_both_phases_of_the_memory_estimate():
    """A 1,000-parameter bf16 teacher: 2,000 bytes more in the training and the rollout phase, halved under 2-rank
    FSDP, which shards it like the other models."""
    without = estimate_memory(SHAPE, RUN)
    with_teacher = estimate_memory(SHAPE, dataclasses.replace(RUN, teacher_parameters=1000, teacher_dtype="bfloat16"))
    assert rows(with_teacher)["teacher weights"] == 2000 and "teacher weights" not in rows(without)
    assert with_teacher.training_bytes - without.training_bytes == 2000
    assert with_teacher.rollout_bytes - without.rollout_bytes == 2000
    sharded = dataclasses.replace(RUN, strategy="fsdp", data_parallel_size=2, teacher_parameters=1000)
    assert rows(estimate_memory(SHAPE, sharded))["teacher weights"] == 1000 * 4 // 2


def test_context_parallelism_divides_a_ranks_tokens_by_c_by_hand():
    """C = 2: a rank's layers keep 1/2 of each row's 8 positions (4 of 8 tokens x 2 rows: 8 x 4 B x (10 x 8 + 4 x 16)
    = 4608 a layer), the whole rows' [2, 1, 8, 8] mask stays (512 a layer; with gradient checkpointing each layer's
    input at the rank's positions, one layer and the mask once); the LM head at 3 of 5 response positions per
    row; FSDP shards over every rank (D x C) and DDP keeps its buckets at D = 1."""
    cp = dataclasses.replace(RUN, context_parallel_size=2)
    assert rows(estimate_memory(SHAPE, cp))["activations, no checkpointing"] == 2 * (4608 + 512) + 4608
    # checkpointing: each layer's input at this rank's 8 positions (8 x 4 B x 8 a layer), one layer and the mask
    assert rows(estimate_memory(SHAPE, cp))["activations, checkpointing"] == 2 * 8 * 4 * 8 + 4608 + 512
    assert rows(estimate_memory(SHAPE, cp))["logits"] == 2 * 3 * 100 * 4 + 4 * 5 * 100 * 4
    fsdp = rows(estimate_memory(SHAPE, dataclasses.replace(cp, strategy="fsdp")))
    assert fsdp["weights"] == 24288 // 2
    assert rows(estimate_memory(SHAPE, dataclasses.replace(cp, strategy="ddp")))["DDP gradient buckets"] == 2024 * 4
