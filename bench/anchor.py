"""The public anchor's single-GPU training-phase protocol (prime-rl's published figures on one H100: Qwen3-0.6B full RL
11.9k tok/s, 11.1 % MFU; Qwen3-4B with LoRA r16 6.23k tok/s, 21.7 % MFU; OLMo-3-7B with LoRA r16 5.35k tok/s, 29 %
MFU), run through lit-ppo's own training phase. The third row here is the Qwen2.5-7B shape (the one lit-ppo's
qwen7b_lora recipe trains; an LM head of its own, vocabulary 152,064), LoRA r16: the same size class as the anchor's
OLMo-3-7B, not the same model.

Protocol: the model's shape with random weights (nothing downloaded); each rollout step one optimizer step over 2
packed micro-batches of at most 16,384 real tokens (ppo.packing, ppo.micro_train_max_tokens=16384), gradient
checkpointing on, GRPO without KL (no reference, no experience forward: exactly on-policy), `precision: auto`
(bf16-mixed on a GPU), a fixed rollout batch of samples whose prompts are 100-300 tokens and responses fill the two
micro-batches; the first rollout step is warm-up and not counted. The LoRA rows train r16 adapters (peft, all linear
layers, alpha 32) on frozen weights. The layout is the flat packed one (ppo.shared_prefix=false: every sample's prompt
computed, as the anchor does; `--shared-prefix auto` lets the product choose). `--attn`: model.attn_implementation
(default transformers' sdpa; flex_attention packs one row per micro-batch under a block mask, a GPU only).

tok/s: real (prompt + response) tokens trained per second of the training phase (`timing/train_s`).
MFU: model FLOPs per second / the device's dense bf16 peak (--peak-tflops; H100 SXM 989), with the model FLOPs of
one forward and backward (bench/mfu.training_flops, per sample, S = its prompt + response tokens, R = its response):
    6 x (decoder-layer parameters) x S  +  6 x vocab x hidden x R  +  12 x layers x q_dim x S^2
(body, LM head at response positions only, attention scores and values without causal halving). Recomputation
(gradient checkpointing) is not counted, and LoRA is counted as full training (6 x), so MFU compares model work, not
hardware work. Beside it, prime-rl's own count (bench/mfu.prime_rl_flops_per_token: 4 x matmul parameters + 6 x LoRA
parameters, the LM head at every position, attention as one sequence of the micro-batch's length), the one its
published MFU uses, so that the MFU columns compare with the anchor's.

    python bench/anchor.py --model qwen3-0.6b          # on one GPU: the anchor's first row
    python bench/anchor.py --model qwen3-4b-lora       # the second
    python bench/anchor.py --model qwen2.5-7b-lora --attn flex_attention   # the 7B row, flex attention
    .venv/bin/python bench/anchor.py --smoke           # on a CPU: scaled down (2 x 1,024 tokens), checks that it runs
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from common import CACHE, arithmetic_prompt_file, build_run, command_line, grpo_preset
from mfu import matmul_peak, prime_rl_flops_per_token, training_flops

from lit_ppo.batch import RolloutBatch
from lit_ppo.config import LoraConfig
from lit_ppo.model_shape import ModelShape
from lit_ppo.precision import resolve_precision
from lit_ppo.run.preflight import flex_backward_on_cpu
from lit_ppo.testing import FixedBatchDataModule, NullEngine, rollout_batch_from_ids

# Qwen3's published configs (config.json of Qwen/Qwen3-0.6B and Qwen/Qwen3-4B): tied embeddings, head_dim 128. The
# Qwen2.5-7B rows are bench/gpu_e2e.py's model of that shape (`model_dir_of`).
SHAPES = {
    "qwen3-0.6b": dict(
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        intermediate_size=3072,
        vocab_size=151936,
    ),  # fmt: skip
    "qwen3-4b-lora": dict(
        hidden_size=2560,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=9728,
        vocab_size=151936,
    ),  # fmt: skip
    "smoke": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        vocab_size=4096,
    ),  # fmt: skip
}
# prime-rl, one H100, seq len 16,384: tok/s, MFU %, its model. The first two from its benchmarks/results/BENCHMARKS.md
# (FA3), the OLMo-3-7B point as issue 41 gives it; all three follow from bench/mfu.prime_rl_flops_per_token.
ANCHOR = {
    "qwen3-0.6b": (11.9e3, 11.1, "Qwen3-0.6B full RL"),
    "qwen3-4b-lora": (6.23e3, 21.7, "Qwen3-4B LoRA r16"),
    "qwen2.5-7b-lora": (5.35e3, 29.0, "OLMo-3-7B LoRA r16"),
}
SAMPLES_PER_PROMPT = 8


def model_dir_of(name: str):
    """A saved Qwen3 model of `name`'s shape with random weights (and the character tokenizer), built once; the
    Qwen2.5-7B shape is bench/gpu_e2e.py's model (Qwen2 architecture), built once for both."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from lit_ppo.demo.tiny import build_char_tokenizer, save_model_dir

    if name in ("qwen2.5-7b-lora", "smoke-qwen2"):
        from gpu_e2e import model_dir

        return model_dir("qwen2.5-7b", smoke=name == "smoke-qwen2")
    path = CACHE / f"anchor-{name}"
    if not (path / "config.json").exists():
        config = Qwen3Config(**SHAPES[name], head_dim=128 if name != "smoke" else 32, tie_word_embeddings=True,
                             max_position_embeddings=40960)  # fmt: skip
        torch.manual_seed(0)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # bf16 on disk (half the bytes to write and read; the run loads float32 master weights or a bf16 frozen base)
        save_model_dir(model.to("cpu", torch.bfloat16), build_char_tokenizer(), path)
    return path


def anchor_batch(micro_batch_tokens: int, micro_batches: int, vocab: int, seed: int) -> RolloutBatch:
    """Groups of SAMPLES_PER_PROMPT samples of one 100-300-token prompt, responses 100-1,500 tokens, until the real
    tokens fill `micro_batches` x `micro_batch_tokens` (97 %: the partition needs some slack), random ids."""
    rng = random.Random(seed)
    budget = int(0.97 * micro_batches * micro_batch_tokens)
    prompts, responses, total = [], [], 0
    while True:
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(100, 300))]
        group = [[rng.randrange(4, vocab) for _ in range(rng.randint(100, 1500))] for _ in range(SAMPLES_PER_PROMPT)]
        size = SAMPLES_PER_PROMPT * len(prompt) + sum(map(len, group))
        if total + size > budget:
            break
        prompts += [prompt] * SAMPLES_PER_PROMPT
        responses += group
        total += size
    if not prompts:  # the smoke's budget holds no group of long responses: short ones
        prompts = [[rng.randrange(4, vocab) for _ in range(100)]] * SAMPLES_PER_PROMPT
        responses = [[rng.randrange(4, vocab) for _ in range(budget // SAMPLES_PER_PROMPT - 100)]] * SAMPLES_PER_PROMPT
    rewards = torch.tensor([float(rng.random() < 0.5) for _ in prompts])
    return rollout_batch_from_ids(prompts, responses, SAMPLES_PER_PROMPT, rewards)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(ANCHOR), default="qwen3-0.6b")
    parser.add_argument("--attn", choices=["sdpa", "eager", "flex_attention"], default=None,
                        help="model.attn_implementation; default: transformers' (sdpa)")  # fmt: skip
    parser.add_argument("--shared-prefix", choices=["off", "auto"], default="off",
                        help="off: the flat packed layout (the anchor's); auto: ppo.shared_prefix=null")  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="CPU-sized model and 2 x 1,024 tokens; measures nothing")
    parser.add_argument("--steps", type=int, default=4, help="rollout steps; the first is warm-up, not counted")
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak; default: 989 (H100 SXM)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    name = ("smoke-qwen2" if args.model == "qwen2.5-7b-lora" else "smoke") if args.smoke else args.model
    if args.smoke:
        args.micro_batch_tokens, args.steps = 1024, 2
    lora = name.endswith("lora") or args.smoke  # the smoke runs the LoRA path too (it is the one that can break)
    attn = args.attn
    if attn == "flex_attention" and not cuda and not flex_backward_on_cpu():
        print(f"--attn flex_attention: torch {torch.__version__} has no flex attention backward on a CPU (the pre-flight "
              "refuses it); this CPU run uses sdpa")  # fmt: skip
        attn = None
    model_dir = model_dir_of(name)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]  # the Qwen2.5-7B rows: gpu_e2e's
    batch = anchor_batch(args.micro_batch_tokens, 2, vocab_size, args.seed)
    N = len(batch.prompt_ids)
    real = sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
    accelerator = "gpu" if cuda else "cpu"
    precision = resolve_precision("auto", accelerator)
    ppo = grpo_preset(
        kl_coef=0.0,
        rollout_batch_size=N // SAMPLES_PER_PROMPT,
        n_samples_per_prompt=SAMPLES_PER_PROMPT,
        train_batch_size=N,
        micro_train_batch_size=1,
        micro_train_max_tokens=args.micro_batch_tokens,
        packing=True,
        shared_prefix=None if args.shared_prefix == "auto" else False,
        actor_lr=1e-5,
    )
    trainer, module, datamodule, plan = build_run(
        model_dir,
        arithmetic_prompt_file(max(64, N), args.seed),
        ppo,
        max_response_tokens=max(map(len, batch.response_ids)),
        max_model_len=max(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)),
        total_rollout_steps=args.steps,
        engine=NullEngine(),
        out_dir=CACHE / "anchor-run",
        seed=args.seed,
        datamodule_class=FixedBatchDataModule,
        gradient_checkpointing=True,
        accelerator=accelerator,
        precision=precision,
        # The product's LoRA (model.lora, peft): the frozen base in bf16 under bf16-mixed, the adapter in float32.
        lora=LoraConfig(rank=16, alpha=32.0, target_modules="all-linear") if lora else None,
        attn_implementation=attn,
    )
    datamodule.fixed_batch = batch
    started = time.perf_counter()
    trainer.fit(module, datamodule=datamodule)
    wall = time.perf_counter() - started
    steady = module.history[1:]
    seconds = sorted(r["timing/train_s"] for r in steady)[len(steady) // 2]
    tokens_per_s = real / seconds
    config = json.loads((model_dir / "config.json").read_text())
    shape = ModelShape.from_hf_config(config)
    flops = sum(training_flops(shape, 1, len(p), len(r)) for p, r in zip(batch.prompt_ids, batch.response_ids))
    if args.peak_tflops:
        peak = args.peak_tflops * 1e12
    elif cuda:
        peak = 989e12
    else:  # a CPU has no published peak here: the measured float32 matmul rate
        peak = matmul_peak(torch.device("cpu"), torch.float32, 512, 3, 4)["max"]
    mfu = flops / seconds / peak
    trainable = sum(p.numel() for p in module.actor.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in module.actor.parameters() if not p.requires_grad)
    prime_flops = real * prime_rl_flops_per_token(config, trainable if lora else 0, args.micro_batch_tokens)
    prime_mfu = prime_flops / seconds / peak
    print(f"command: {command_line()}")
    print(f"actor: {trainable:,} trainable and {frozen:,} frozen parameters ({module.actor.dtype} weights)")
    print(
        f"model: {name} shape ({'LoRA r16 on frozen weights' if lora else 'full RL'}), random weights; "
        f"{precision}; gradient checkpointing on; attention {module.plan.layout.attn_implementation or attn or 'sdpa'}; "
        f"layout {'shared prefix' if module.plan.layout.shared_prefix else 'flat packed'}; "
        f"{torch.cuda.get_device_name(0) if cuda else 'cpu'}"
    )
    last = steady[-1]
    micro_batches = round(last["perf/trained_tokens"] / max(last["perf/real_tokens_per_micro_batch"], 1.0))
    print(
        f"batch: {N} samples, {real} real tokens in {micro_batches} "
        f"packed micro-batches of <= {args.micro_batch_tokens} tokens (padding {steady[-1]['perf/padding_fraction']:.1%}); "
        f"{module.actor_optimizer_steps} optimizer steps in {args.steps} rollout steps, the first one warm-up"
    )
    times = ", ".join(f"{r['timing/train_s']:.3f}" for r in steady)
    print(f"training phase: {times} s (median {seconds:.3f} s)")
    print(f"tokens/s: {tokens_per_s:.4g} real tokens per second of the training phase")
    print(
        f"MFU: {flops:.4g} model FLOPs / {seconds:.3f} s / {peak / 1e12:.4g} TFLOP/s peak = {mfu:.2%} "
        "(6 x layer params x S + 6 x vocab x hidden x R + 12 x layers x q_dim x S^2, per sample)"
    )
    print(
        f"MFU (prime-rl's count): {prime_flops:.4g} FLOPs / {seconds:.3f} s / {peak / 1e12:.4g} TFLOP/s = "
        f"{prime_mfu:.2%} ({'4 x matmul params + 6 x LoRA params' if lora else '6 x matmul params'} + 12 x layers x "
        f"hidden x {args.micro_batch_tokens} per token; over real tokens, where prime-rl counts every processed "
        "position, padding of a packed row included)"
    )
    if name in ANCHOR:
        anchor_tokens, anchor_mfu, anchor_model = ANCHOR[name]
        # Another model than the anchor's (OLMo-3-7B beside Qwen2.5-7B): its MFU compares, its tokens per second not.
        same_model = not anchor_model.startswith("OLMo")
        ratio = f"{tokens_per_s / anchor_tokens:.2f}x tok/s, " if same_model else ""
        print(
            f"anchor (prime-rl, one H100, {anchor_model}): {anchor_tokens:.4g} tok/s, {anchor_mfu} % MFU; here "
            f"{ratio}MFU {100 * prime_mfu:.1f} % by its count"
        )
    print(f"wall: {wall:.1f} s for the whole fit")


if __name__ == "__main__":
    main()
