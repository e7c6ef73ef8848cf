"""The GPU machine's scripts on the CPU (issue 28: a path that only runs on a GPU still gets a CPU-side test that fails
the same way). bench/gpu_e2e.py composes `+experiment=qwen1.5b` with `rollout.engine=hf`, a tokenizer filled to the
model's vocabulary and the recipe's math reward, and runs train.py as a user would; here at its --smoke size, on the
CPU, so a config key, an override or a report column that breaks shows before a GPU lease is spent on it. Issue 41's
parts likewise, with vLLM and flash-attn unimportable as on the GPU machine: the 7B LoRA recipe, one HF rollout worker
on the trainer's device, and prime-rl's FLOP count that bench/anchor.py reports beside lit-ppo's."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT


def test_the_end_to_end_gpu_script_runs_train_py_with_the_hf_engine_and_reports_every_phase(tmp_path):
    result = subprocess.run(
        [sys.executable, "bench/gpu_e2e.py", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "+experiment=qwen1.5b" in out and "rollout.engine=hf" in out
    assert "step | generate_s | reward_s | experience_s | train_s" in out
    assert "median rollout step after the first" in out
    with open(tmp_path / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("timing/train_s")]
    assert len(rows) == 2  # the smoke's 2 rollout steps, each with its phases
    assert all(float(r["timing/generate_s"]) > 0 and float(r["perf/trained_tokens"]) > 0 for r in rows)
    assert (tmp_path / "plan.json").exists() and (tmp_path / "run.log").exists()


def smoke(tmp_path, *args: str) -> str:
    """bench/gpu_e2e.py --smoke with vLLM and flash-attn unimportable (bench/no_vllm, as on the GPU machine's image)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "bench" / "no_vllm")}
    result = subprocess.run(
        [
            sys.executable,
            "bench/gpu_e2e.py",
            "--smoke",
            "--out",
            str(tmp_path),
            "--run-dir",
            str(tmp_path / "run"),
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_the_7b_lora_recipe_composes_with_a_random_weight_model_of_its_shape_and_no_vllm(tmp_path):
    """Issue 41's first part: `+experiment=qwen7b_lora rollout.engine=hf` on a model dir built from a config (untied, as
    Qwen2.5-7B); the plan shows the recipe's LoRA r32 and the HF engine."""
    out = smoke(tmp_path, "--shape", "qwen2.5-7b")
    assert "+experiment=qwen7b_lora" in out and "rollout.engine=hf" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["lora"]["rank"] == 32 and plan["models"]["rollout_engine"] == "hf"
    cache = Path(os.environ.get("LIT_PPO_BENCH_CACHE") or ROOT / ".cache" / "lit_ppo" / "bench")  # bench/common.CACHE
    config = (cache / "gpu-e2e-qwen2.5-7b-smoke-0/config.json").read_text()
    assert '"tie_word_embeddings": false' in config


def test_one_hf_rollout_worker_sharing_the_trainers_device_reports_the_push_without_vllm(tmp_path):
    """Issue 41's fourth part: rollout.mode=disaggregated with one HF-engine worker, rollout.workers.devices=0, k = 1;
    the report has the push's seconds and bytes (full float32 weights) from metrics.csv."""
    out = smoke(tmp_path, "--mode", "disaggregated")
    assert "rollout.workers.devices=0" in out and "weight sync: median" in out
    with open(tmp_path / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("timing/train_s")]
    assert len(rows) == 2 and all(float(r["perf/weight_sync_bytes"]) > 0 for r in rows)
    assert (tmp_path / "rollout_worker0.log").exists()


def test_prime_rls_flop_count_gives_its_three_published_single_h100_points(monkeypatch):
    """bench/mfu.prime_rl_flops_per_token at prime-rl's benchmark sequence length (16,384) and one H100's 989 TFLOP/s
    gives its published MFU from its tok/s: Qwen3-0.6B full 11.9k = 11.1 %, Qwen3-4B LoRA r16 6.23k = 21.7 %,
    OLMo-3-7B LoRA r16 5.35k = 29 % (OLMo-3-7B: 32 layers, hidden 4096, 32 heads and KV heads, intermediate 11008,
    vocabulary 100278)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from mfu import prime_rl_flops_per_token

    qwen3_06b = dict(num_hidden_layers=28, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
                     head_dim=128, intermediate_size=3072, vocab_size=151936)  # fmt: skip
    qwen3_4b = dict(num_hidden_layers=36, hidden_size=2560, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, intermediate_size=9728, vocab_size=151936)  # fmt: skip
    olmo3_7b = dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
                    intermediate_size=11008, vocab_size=100278)  # fmt: skip
    lora_4b = 36 * 16 * (2 * (2560 + 4096) + 2 * (2560 + 1024) + 3 * (2560 + 9728))  # r x (in + out), 7 modules
    lora_7b = 32 * 16 * (4 * (4096 + 4096) + 3 * (4096 + 11008))
    assert lora_4b == 33_030_144  # what bench/anchor.py's peft model counts (BENCHMARKS.md, issue 28)
    for config, lora, tokens_per_s, mfu_percent in [
        (qwen3_06b, 0, 11.9e3, 11.1),
        (qwen3_4b, lora_4b, 6.23e3, 21.7),
        (olmo3_7b, lora_7b, 5.35e3, 29.0),
    ]:
        mfu = 100 * prime_rl_flops_per_token(config, lora, 16384) * tokens_per_s / 989e12
        assert abs(mfu - mfu_percent) < 0.05, (mfu, mfu_percent)
    # full training: 6 x (q, k, v, o + MLP + LM head) + 12 x layers x hidden x seq_len, by hand for the 0.6B shape
    matmul = 28 * 1024 * 128 * (2 * 16 + 2 * 8) + 28 * 3 * 3072 * 1024 + 151936 * 1024
    assert prime_rl_flops_per_token(qwen3_06b, 0, 16384) == 6 * matmul + 12 * 28 * 1024 * 16384
