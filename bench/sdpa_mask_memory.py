"""What a whole row's [L, L] mask costs the one-rank training forward under sdpa (issue 51 item 3), CPU, float32.

A packed micro-batch of 2 samples in one row of `L` tokens (the block-diagonal causal mask) through the product's
forward and backward (`models.response_logprobs_and_entropy`, log-probs summed), a Qwen2-shaped model with random
weights (hidden 256, `layers` layers, 8 heads, 4 KV heads). transformers builds a bool [1, 1, L, L] mask for sdpa;
torch's sdpa converts a bool mask to a float copy at every call (every layer), and keeps it for the backward. Against
it: the same forward given that mask once as float (transformers passes a 4-D mask on as it is; the log-probs are
compared bitwise). Measured: the growth of the process's peak resident memory (VmHWM, reset by /proc/self/clear_refs)
over the forward, and over the forward and backward.

    .venv/bin/python bench/sdpa_mask_memory.py 4096 2
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers.masking_utils import create_causal_mask  # noqa: E402

from lit_ppo.demo.tiny import build_char_tokenizer, build_tiny_model  # noqa: E402
from lit_ppo.training.batching import pack_samples  # noqa: E402
from lit_ppo.training.models import prepare_for_training, response_logprobs_and_entropy  # noqa: E402


def _status(field: str) -> float:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) / 1024


def _grown(model, mb) -> tuple[float, float, torch.Tensor]:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    logp, _ = response_logprobs_and_entropy(model, mb, 1.0)
    forward = _status("VmHWM") - before
    logp.sum().backward()
    model.zero_grad(set_to_none=True)
    return forward, _status("VmHWM") - before, logp.detach()


def main() -> None:
    length, layers = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    tokenizer = build_char_tokenizer()
    shape = dict(hidden_size=256, num_layers=layers, num_heads=8, num_kv_heads=4, intermediate_size=768)
    model = build_tiny_model(tokenizer, **shape, max_position_embeddings=length + 8, seed=0).float()
    model = prepare_for_training(model, False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 40, (256,), generator=g).tolist() for _ in range(2)]
    responses = [torch.randint(4, 40, (length // 2 - 256,), generator=g).tolist() for _ in range(2)]
    mb = pack_samples(prompts, responses, tokenizer.pad_token_id, "cpu")
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}; torch {torch.__version__}, one thread")
    print(
        f"model: Qwen2 {shape}, attention {model.config._attn_implementation}; row {tuple(mb.input_ids.shape)}, 2 "
        f"samples packed; an [L, L] mask is {length**2 / 2**20:.0f} MiB of bool, {4 * length**2 / 2**20:.0f} MiB float"
    )
    forward, both, bool_logp = _grown(model, mb)
    print(f"bool mask (transformers', the product's): forward {forward:.0f} MiB, forward + backward {both:.0f} MiB")
    embeds = torch.empty((1, mb.input_ids.shape[1], 1))
    mask = create_causal_mask(
        config=model.config,
        inputs_embeds=embeds,
        attention_mask=None,
        past_key_values=None,
        position_ids=mb.position_ids,
    )
    additive = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))  # sdpa's own conversion of a bool mask
    del mask
    forward, both, float_logp = _grown(model, dataclasses.replace(mb, attention_mask=additive))
    print(f"float mask given once: forward {forward:.0f} MiB, forward + backward {both:.0f} MiB")
    print(f"log-probs bitwise equal: {torch.equal(bool_logp, float_logp)}")


if __name__ == "__main__":
    main()
