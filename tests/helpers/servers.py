"""vLLM servers as rollout workers (lit_ppo/rollout/workers/servers.py and its modules): a server's settings as the
client derives them, and a model folder of the tests' tiny model's shape."""

from __future__ import annotations

import json
from pathlib import Path

BY_HAND = dict(  # a server's settings as the client derives them (`kv_cache_gib` set by each test)
    model_dir="/models/tiny",
    dtype="float32",
    max_model_len=128,
    seed=0,
    tensor_parallel_size=1,
    enforce_eager=True,
    gpu_memory_utilization=0.3,
)


def model_folder(root: Path, **shape) -> str:
    """A model folder with only a config.json (what `server_mismatch` reads of a model): the tests' tiny Qwen2's shape,
    `shape` over it."""
    config = dict(
        architectures=["Qwen2ForCausalLM"],
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({**config, **shape}))
    return str(root)
