"""Training phase: lit-ppo's PPOModule.train_on_experience against a plain PyTorch loop, tokens per second.

Both train the same model (same initial weights) on the same fixed rollout batch (prompt + response token
ids, rewards), in the same mini-batch order and micro-batches, with AdamW at the same learning rate and
gradient clipping at 1. lit-ppo runs for real: a Lightning trainer fits a PPOModule (GRPO preset, no KL)
whose data module serves that batch at every rollout step without generating; its training phase is the
module's own `timing/train_s` (train_on_experience). The plain loop is forward, log-softmax gather, a
clipped-ratio loss, backward, clip, step. They alternate, several times; the first rollout step of each
run is warm-up (optimizer state allocation) and not counted.

    .venv/bin/python bench/train_phase.py            # the measurement
    .venv/bin/python bench/train_phase.py --smoke    # checks that it runs
"""

from __future__ import annotations

import argparse
import time

import torch
from common import (
    CACHE,
    add_common_args,
    arithmetic_prompt_file,
    bench_model_dir,
    build_run,
    command_line,
    fmt,
    grpo_for,
    model_description,
    print_header,
    stats,
)

from lit_ppo import algorithms as algo
from lit_ppo.batch import RolloutBatch
from lit_ppo.rollout.prompts import load_prompts
from lit_ppo.testing import FixedBatchDataModule, NullEngine, random_rollout_batch


def run_litppo(
    args, model_dir, prompt_file, batch: RolloutBatch, accelerator: str = "cpu", precision: str = "32-true"
) -> dict:
    ppo = grpo_for(args, actor_lr=args.lr)
    trainer, module, datamodule, plan = build_run(
        model_dir,
        prompt_file,
        ppo,
        max_response_tokens=args.response_tokens,
        total_rollout_steps=args.steps,
        engine=NullEngine(),
        out_dir=CACHE / "train_phase-run",
        seed=args.seed,
        datamodule_class=FixedBatchDataModule,
        accelerator=accelerator,
        precision=precision,
    )
    datamodule.fixed_batch = batch
    trainer.fit(module, datamodule=datamodule)
    steady = module.history[1:]
    return {
        "train_s": [r["timing/train_s"] for r in steady],
        "experience_s": [r["timing/experience_s"] for r in steady],
        "optimizer_steps": module.actor_optimizer_steps,
    }


# ---------------------------------------------------------------- the plain loop


def plain_tensors(batch: RolloutBatch, pad_id: int):
    """Left-padded prompts followed by the responses, as one [N, P+T] tensor, with mask and positions."""
    P = max(len(p) for p in batch.prompt_ids)
    rows, masks = [], []
    for p, r in zip(batch.prompt_ids, batch.response_ids):
        rows.append([pad_id] * (P - len(p)) + p + r)
        masks.append([0] * (P - len(p)) + [1] * (len(p) + len(r)))
    input_ids, attention_mask = torch.tensor(rows), torch.tensor(masks)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids, P


def plain_response_logprobs(model, input_ids, attention_mask, position_ids, P: int, T: int):
    # The LM head only where it predicts a response token (as lit-ppo's logits_to_keep): [B, T] log-probs.
    logits = (
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=T + 1)
        .logits[:, :T]
        .float()
    )
    return torch.log_softmax(logits, -1).gather(-1, input_ids[:, P:].unsqueeze(-1)).squeeze(-1)


def run_plain(
    args, model_dir, batch: RolloutBatch, pad_id: int, device: str = "cpu", precision: str = "32-true"
) -> dict:
    """The plain loop on `device`; `precision` bf16-mixed runs the forward passes under bf16 autocast (float32
    weights, gradients and AdamW states), as Lightning's bf16-mixed does."""
    from contextlib import nullcontext

    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    input_ids, attention_mask, position_ids, P = (
        t.to(device) if isinstance(t, torch.Tensor) else t for t in plain_tensors(batch, pad_id)
    )
    N, T = len(batch.response_ids), args.response_tokens

    def compute():
        return torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16-mixed" else nullcontext()

    def synchronized_time() -> float:  # CUDA runs asynchronously: wait for the queued work before reading the clock
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    with torch.no_grad(), compute():  # the experience: old log-probs and GRPO advantages, once
        started = synchronized_time()
        old_logp = torch.cat(
            [
                plain_response_logprobs(
                    model,
                    input_ids[i : i + args.micro_batch_size],
                    attention_mask[i : i + args.micro_batch_size],
                    position_ids[i : i + args.micro_batch_size],
                    P,
                    T,
                )
                for i in range(0, N, args.micro_batch_size)
            ]
        )
        experience_s = synchronized_time() - started
        advantages, _ = algo.grpo(
            batch.rewards.to(device), torch.ones(N, T, device=device), group_size=args.samples_per_prompt
        )
    shuffle = torch.Generator().manual_seed(args.seed)  # the same mini-batch order as lit-ppo's
    train_s = []
    for _ in range(args.steps):
        started = synchronized_time()
        order = torch.randperm(N, generator=shuffle)
        for start in range(0, N, args.train_batch_size):
            mini = order[start : start + args.train_batch_size]
            for micro_start in range(0, len(mini), args.micro_batch_size):
                idx = mini[micro_start : micro_start + args.micro_batch_size].to(device)
                with compute():
                    logp = plain_response_logprobs(model, input_ids[idx], attention_mask[idx], position_ids[idx], P, T)
                    ratio = torch.exp(logp - old_logp[idx])
                    adv = advantages[idx]
                    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
                    loss = per_token.mean(-1).sum() / len(
                        mini
                    )  # mean over tokens, then over the mini-batch's sequences
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        train_s.append(synchronized_time() - started)
    return {"train_s": train_s[1:], "experience_s": [experience_s]}


def time_forward(model_dir, batch: RolloutBatch, pad_id: int, micro: int, T: int) -> float:
    """Seconds of a no-grad forward over the whole batch, `micro` samples at a time (the experience's cost)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    input_ids, attention_mask, position_ids, P = plain_tensors(batch, pad_id)
    with torch.no_grad():
        plain_response_logprobs(model, input_ids[:micro], attention_mask[:micro], position_ids[:micro], P, T)  # warm-up
        started = time.perf_counter()
        for i in range(0, len(input_ids), micro):
            plain_response_logprobs(
                model, input_ids[i : i + micro], attention_mask[i : i + micro], position_ids[i : i + micro], P, T
            )
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollout-batch-size", type=int, default=16, help="prompts in the fixed rollout batch")
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    parser.add_argument("--train-batch-size", type=int, default=32, help="samples per optimizer step")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="samples per forward/backward")
    parser.add_argument("--response-tokens", type=int, default=64, help="tokens per response")
    parser.add_argument("--steps", type=int, default=3, help="rollout steps per run; the first is warm-up, not counted")
    parser.add_argument("--lr", type=float, default=1e-5)
    add_common_args(parser, repeats=3)
    args = parser.parse_args()
    if args.smoke:
        args.rollout_batch_size, args.samples_per_prompt, args.train_batch_size, args.micro_batch_size = 4, 2, 4, 2
        args.response_tokens, args.steps, args.repeats = 16, 2, 1
    if args.steps < 2:
        raise SystemExit(f"--steps={args.steps}: need at least 2 rollout steps (the first is warm-up); fix: --steps 3")

    from transformers import AutoTokenizer

    model_dir = bench_model_dir(args)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_file = arithmetic_prompt_file(max(64, args.rollout_batch_size), args.seed)
    prompt_ids = [p.prompt_ids for p in load_prompts(prompt_file, tokenizer).prompts[: args.rollout_batch_size]]
    batch = random_rollout_batch(
        prompt_ids, args.samples_per_prompt, args.response_tokens, range(4, len(tokenizer)), args.seed
    )  # ids 0-3 are special tokens
    N, T = len(batch.response_ids), args.response_tokens
    P = max(len(p) for p in batch.prompt_ids)
    optimizer_steps = N // args.train_batch_size
    print_header(
        "training phase: lit-ppo train_on_experience vs a plain PyTorch loop",
        args,
        model=model_description(model_dir),
        batch=f"{args.rollout_batch_size} prompts x {args.samples_per_prompt} samples = {N} samples, "
        f"{T} response tokens each (prompt width {P}); train_batch_size={args.train_batch_size}, "
        f"micro_batch_size={args.micro_batch_size} -> {optimizer_steps} AdamW steps per rollout step, "
        f"lr {args.lr:g}, clip 0.2, max_grad_norm 1, float32",
        runs=f"{args.repeats} repetitions x 2, alternating, {args.steps} rollout steps each (first is warm-up)",
    )

    results = {"lit-ppo": [], "plain": []}
    experience = {"lit-ppo": [], "plain": []}
    for rep in range(args.repeats):
        order = ("lit-ppo", "plain") if rep % 2 == 0 else ("plain", "lit-ppo")
        for name in order:
            r = (
                run_litppo(args, model_dir, prompt_file, batch)
                if name == "lit-ppo"
                else run_plain(args, model_dir, batch, tokenizer.pad_token_id)
            )
            if name == "lit-ppo" and r["optimizer_steps"] != optimizer_steps * args.steps:
                raise SystemExit(
                    f"lit-ppo took {r['optimizer_steps']} optimizer steps, expected {optimizer_steps * args.steps}"
                )
            results[name] += r["train_s"]
            experience[name] += r["experience_s"]
            print(
                f"repetition {rep + 1} {name:<8}: training phase "
                f"{', '.join(f'{N * T / s:.0f}' for s in r['train_s'])} response tok/s",
                flush=True,
            )

    tok_s = {k: stats([N * T / s for s in v]) for k, v in results.items()}
    print("-" * 100)
    print(
        f"trained response tokens per rollout step: {N * T} ({N * (P + T)} sequence positions incl. prompt and padding)"
    )
    for name in results:
        print(
            f"{name:<8} training phase : {fmt(tok_s[name], 'response tok/s', 0)}; "
            f"{fmt(stats(results[name]), 's / rollout step')}"
        )
    fraction = tok_s["lit-ppo"]["median"] / tok_s["plain"]["median"]
    print(
        f"lit-ppo / plain tokens per second: {fraction:.2f} (medians; goal >= 0.90: {'met' if fraction >= 0.9 else 'not met'})"
    )

    # The experience (no-grad forward for old log-probs): lit-ppo runs it at micro_train_batch_size.
    bigger = min(N, 4 * args.micro_batch_size)
    at_micro = time_forward(model_dir, batch, tokenizer.pad_token_id, args.micro_batch_size, T)
    at_bigger = time_forward(model_dir, batch, tokenizer.pad_token_id, bigger, T)
    print(
        f"experience (no-grad forward of {N} samples): lit-ppo make_experience {fmt(stats(experience['lit-ppo']))}; "
        f"plain forward at batch {args.micro_batch_size}: {at_micro:.3f} s, at batch {bigger}: {at_bigger:.3f} s"
    )
    print(f"command : {command_line()}")


if __name__ == "__main__":
    main()
