"""Weight push to a rollout worker through vLLM's weight-transfer interface: seconds the trainer spends per push.

One real rollout worker (its own process and vLLM engine, `rollout.mode=disaggregated`) started from the model
directory; the trainer holds the model (float32, as its actor) and pushes it `--pushes` times through
`RolloutWorkers.update_weights` (the trainer engine of lit-ppo's `lit_ppo_gloo` backend: buckets of
rollout.workers.weight_push_bucket_mib broadcast over gloo, received by the worker while it generates). Printed per
push kind:

- push, trainer side: `update_weights`' seconds (what `timing/weight_sync_s` logs in a run; the probe's forward is
  left out: `max_logprob_abs_diff` off), with the bytes (`perf/weight_sync_bytes`) and GB/s;
- push to first sample: from the push's start until a one-token generate queued behind it returns, i.e. the worker
  also loaded the version (through vLLM's `update_weights`, or with `--lora-rank` as a new adapter) and generated.

    .venv/bin/python bench/worker_push.py --qwen05b                   # Qwen2.5-0.5B shape, full weights
    .venv/bin/python bench/worker_push.py --qwen05b --lora-rank 16    # the adapter alone (all-linear, rank 16)
    .venv/bin/python bench/worker_push.py --smoke                     # checks that it runs
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from common import add_common_args, bench_model_dir, fmt, model_description, print_header, qwen05b_model_dir, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qwen05b", action="store_true", help="the Qwen2.5-0.5B shape (151,936 vocabulary)")
    parser.add_argument("--lora-rank", type=int, default=0, help="push a LoRA adapter of this rank; 0: full weights")
    parser.add_argument("--pushes", type=int, default=6, help="timed pushes (after one warm-up push)")
    parser.add_argument("--bucket-mib", type=int, default=256, help="rollout.workers.weight_push_bucket_mib")
    parser.add_argument("--vllm-dtype", default="bfloat16", help="the worker engine's dtype (rollout.dtype)")
    add_common_args(parser, repeats=1)
    args = parser.parse_args()
    if args.smoke:
        args.pushes = 2
    model_dir = qwen05b_model_dir(args.seed, smoke=args.smoke) if args.qwen05b or args.smoke else bench_model_dir(args)
    print_header(
        "weight push to a rollout worker through vLLM's weight-transfer interface (lit_ppo_gloo), trainer side",
        args,
        model=model_description(model_dir),
        push=f"LoRA rank {args.lora_rank}, all-linear: the adapter alone"
        if args.lora_rank
        else "full weights (float32)",
        worker=f"1 rollout worker, vLLM dtype {args.vllm_dtype}, buckets of {args.bucket_mib} MiB, {args.pushes} "
        "timed pushes after 1 warm-up",
    )
    from transformers import AutoModelForCausalLM

    from lit_ppo.contract import AdapterWeights, GenerateRequest, WeightUpdate
    from lit_ppo.distributed import full_tensor_metadata
    from lit_ppo.rollout.workers.client import RolloutWorkers
    from lit_ppo.rollout.workers.client_settings import ClientSettings

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_config = None
    if args.lora_rank:
        from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

        model = get_peft_model(
            model, LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules="all-linear")
        )
        config = model.peft_config["default"].to_dict()
        peft_config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}

    def update(version: int) -> WeightUpdate:
        if args.lora_rank:
            adapter = {n: t.detach() for n, t in get_peft_model_state_dict(model).items()}
            return WeightUpdate(version, adapter=AdapterWeights(adapter, peft_config, version))
        return WeightUpdate(version, tensors=model.state_dict().items(), metadata=full_tensor_metadata(model))

    started = time.perf_counter()
    workers = RolloutWorkers(
        engine_kwargs=dict(
            model_dir=str(model_dir),
            dtype=args.vllm_dtype,
            max_model_len=256,
            kv_cache_gib=1,
            seed=args.seed,
            enforce_eager=True,
            max_lora_rank=args.lora_rank or None,
            weight_transfer=True,
        ),
        settings=ClientSettings(
            workers=1,
            devices_per_worker=1,
            trainer_devices=1,
            log_dir=Path(tempfile.mkdtemp(prefix="worker_push-")),
            start_timeout_s=900,
            batch_timeout_s=900,
            push_timeout_s=900,
            bucket_mib=args.bucket_mib,
        ),
    )
    print(f"worker started in {time.perf_counter() - started:.1f} s (log: {workers.launch.log(0)})", flush=True)
    pushed, to_sample, moved = [], [], 0
    try:
        for version in range(1, args.pushes + 2):
            started = time.perf_counter()
            moved = workers.update_weights(update(version))
            pushed.append(time.perf_counter() - started)
            tickets = workers.submit(
                GenerateRequest([[1, 2, 3]], n=1, temperature=1.0, top_p=1.0, max_tokens=1, seeds=[version])
            )
            _, versions, _ = workers.collect(tickets)
            to_sample.append(time.perf_counter() - started)
            if versions != [version]:
                raise RuntimeError(f"the sample after push {version} was generated by version {versions}")
            print(f"push {version}: {pushed[-1]:.3f} s trainer side, {to_sample[-1]:.3f} s to the first sample of it")
    finally:
        workers.close()
    push, first = stats(pushed[1:]), stats(to_sample[1:])
    print(f"bytes per push            : {moved / 1e6:.2f} MB (perf/weight_sync_bytes)")
    print(f"push, trainer side        : {fmt(push)}  ({moved / 1e9 / push['median']:.3f} GB/s)")
    print(f"push to first sample      : {fmt(first)}")


if __name__ == "__main__":
    main()
