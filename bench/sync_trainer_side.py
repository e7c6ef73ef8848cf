"""The weight sync's trainer side (issue 28, Part 2.3): seconds and bytes to gather and stream the actor's tensors, full
and LoRA, at the Qwen2.5-0.5B and 1.5B shapes, where vLLM is not installed (the GPU machine).

`PPOModule.sync_weights` runs as in a run, into a stand-in for the engine's receiving end that does what vLLM does
with what it gets, so the figure is the trainer's side plus the copy it cannot avoid:
- full weights: every tensor by Hugging Face name (`full_tensors`: gathered where sharded; one GPU here), streamed
  into `SinkEngine.update_weights`, which copies each into a preallocated destination of the rollout dtype on the same
  device (vLLM's weight loaders `param.copy_(loaded)`, the cast to bf16 included);
- LoRA r16 (all linear layers): the adapter alone (`adapter_tensors`) into `SinkEngine.update_weights`, which makes the
  host copies `VLLMEngine.sync_adapter` makes before its in-process load (vLLM folds alpha / r into lora_B in place,
  so it must get copies).
Each sync is timed with the device synchronized before and after, `--syncs` times after one untimed; the median is
printed with the bytes (`perf/weight_sync_bytes`, what `sync_weights` records). The actor is float32 master weights
under bf16-mixed (full) or a bf16 frozen base with a float32 adapter (LoRA), as `load_models` makes them.

    python bench/sync_trainer_side.py                      # on one GPU: 0.5B and 1.5B shapes, full and LoRA r16
    .venv/bin/python bench/sync_trainer_side.py --smoke    # on a CPU: a tiny model, checks that it runs
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import CACHE, arithmetic_prompt_file, build_run, command_line, grpo_preset, qwen05b_model_dir
from gpu_e2e import model_dir as qwen15b_model_dir

from lit_ppo.config import LoraConfig
from lit_ppo.contract import CountedTensors, WeightUpdate
from lit_ppo.precision import resolve_precision
from lit_ppo.rollout.engine import adapter_host_copies, tensor_bytes
from lit_ppo.testing import NullEngine


class SinkEngine(NullEngine):
    """The receiving end of a weight sync without vLLM: full tensors copied into destinations of the rollout dtype on
    the device (allocated at the first sync, as vLLM's parameters exist before it), adapters copied to the host."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.destinations: dict[str, torch.Tensor] = {}

    def update_weights(self, update: WeightUpdate) -> int:
        if update.adapter is not None:  # what VLLMEngine.sync_adapter does before vLLM's load
            return tensor_bytes(adapter_host_copies(update.adapter.tensors))
        counted = CountedTensors(update.tensors)
        for name, tensor in counted:
            if name not in self.destinations:
                self.destinations[name] = torch.empty(tensor.shape, dtype=self.dtype, device=tensor.device)
            self.destinations[name].copy_(tensor)
        return counted.bytes


def measure(model_dir, lora_rank: int, syncs: int, device: torch.device, precision: str) -> tuple[float, int, str]:
    """(median seconds per sync, bytes pushed per sync, the actor's parameter dtypes)."""
    ppo = grpo_preset(kl_coef=0.0, rollout_batch_size=1, n_samples_per_prompt=2, train_batch_size=2,
                      micro_train_batch_size=1)  # fmt: skip
    _, module, _, plan = build_run(
        model_dir,
        arithmetic_prompt_file(64, 0),
        ppo,
        max_response_tokens=16,
        total_rollout_steps=1,
        engine=NullEngine(),
        out_dir=CACHE / "sync-trainer-side-run",
        accelerator="gpu" if device.type == "cuda" else "cpu",
        precision=precision,
        lora=LoraConfig(rank=lora_rank, alpha=2.0 * lora_rank) if lora_rank else None,
    )
    module.to(device)
    engine = SinkEngine(torch.bfloat16 if plan.models.rollout_dtype == "bfloat16" else torch.float32)
    seconds = []
    for version in range(syncs + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        module.sync_weights(engine, version=version + 1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if version:  # the first allocates the destinations
            seconds.append(time.perf_counter() - started)
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in module.actor.parameters()})
    pushed_bytes = module.last_sync_bytes  # perf/weight_sync_bytes: what the trainer handed to the engine
    del module, engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(seconds), pushed_bytes, "+".join(dtypes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--syncs", type=int, default=5, help="timed syncs per row (after one untimed)")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU; measures nothing")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    precision = resolve_precision("auto", "gpu" if cuda else "cpu")
    shapes = {"smoke": qwen05b_model_dir(smoke=True)} if args.smoke else {
        "Qwen2.5-0.5B": qwen05b_model_dir(), "Qwen2.5-1.5B": qwen15b_model_dir(smoke=False)}  # fmt: skip
    print(f"command: {command_line()}")
    print(
        f"device: {torch.cuda.get_device_name(device) if cuda else 'cpu'}; precision {precision}; torch {torch.__version__}"
    )
    print("shape | what | trainer weights | bytes pushed | median s per sync | GB/s")
    for name, path in shapes.items():
        for rank in (0, args.lora_rank):
            seconds, pushed, weights = measure(path, rank, args.syncs, device, precision)
            what = "full weights" if rank == 0 else f"LoRA r{rank} adapter (all-linear)"
            print(
                f"{name} | {what} | {weights} | {pushed / 1e6:.2f} MB | {seconds:.4f} | {pushed / seconds / 1e9:.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
