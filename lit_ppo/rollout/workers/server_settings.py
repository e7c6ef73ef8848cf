"""What a vLLM server as a rollout worker runs with (rollout.workers.launch=server, docs/async.md): `vllm serve`'s
arguments and variables built from the run's settings (what a spawned server is started with, and the command that
starts one by hand for rollout.workers.server_urls), and the check of a given server against them: it must serve the
run's model with what a spawned one is started with where the samples or the push depend on it (`server_mismatch`,
from its /server_info: the model's shapes, the dtype, the log-probs mode, ...), else one line naming the setting, both
values and the flag."""

from __future__ import annotations

import json
import logging
import shlex
from pathlib import Path

import torch

from lit_ppo.rollout.workers.server_http import SERVED_MODEL_NAME

log = logging.getLogger("lit_ppo")


def server_arguments(settings: dict, port: int, host: str = "127.0.0.1") -> list[str]:
    """`vllm serve`'s arguments for a rollout worker from `VLLMEngine`'s settings (`rollout.engine.worker_settings`): what
    `VLLMEngine` passes to `LLM(...)`, plus the server's own (its scale-out route for token ids, vLLM's sampling
    defaults rather than the model's generation_config.json, the weight-transfer backend). A server started outside
    the trainer needs the same (docs/async.md)."""
    from vllm.platforms import current_platform

    from lit_ppo.rollout.weight_transfer.backend import BACKEND

    args = ["--model", str(settings["model_dir"]), "--host", host, "--port", str(port)]
    args += ["--served-model-name", SERVED_MODEL_NAME, "--dtype", str(settings["dtype"])]
    args += ["--max-model-len", str(settings["max_model_len"]), "--seed", str(settings["seed"])]
    args += ["--tensor-parallel-size", str(settings["tensor_parallel_size"])]
    if settings["enforce_eager"]:
        args.append("--enforce-eager")
    if current_platform.is_cpu():
        args.append("--no-enable-chunked-prefill")  # seeded CPU generators cannot rewind (engine.py)
    else:
        args += ["--gpu-memory-utilization", str(settings["gpu_memory_utilization"])]
    args += ["--enable-prefix-caching", "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm"]
    args += ["--enable-scale-out", "--weight-transfer-config", json.dumps({"backend": BACKEND})]
    return args


def server_variables(kv_cache_gib: float) -> dict[str, str]:
    """The variables a rollout worker's server needs in its environment beside the trainer's."""
    return dict(
        VLLM_SERVER_DEV_MODE="1",  # the RL routes: pause, resume, the weight transfer, the weight version, /server_info
        VLLM_CPU_KVCACHE_SPACE=str(max(1, int(kv_cache_gib))),  # CPU: the KV cache's GiB (rollout.vllm.kv_cache_gib)
        TOKENIZERS_PARALLELISM="false",
    )


def shell_line(variables: dict[str, str], command: list[str]) -> str:
    """`command` with `variables` before it, as a shell runs it (the JSON of --weight-transfer-config quoted)."""
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in variables.items()] + [shlex.join(command)])


MODEL_SHAPE_KEYS = (
    "architectures",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)
"""What a server's model must share with the run's for the push to load (config.json: the class, the vocabulary, the
tensors' shapes)."""


def model_shape(model: str) -> dict | None:
    """MODEL_SHAPE_KEYS of the model at `model` (a folder, or a Hugging Face id in this machine's cache) from its
    config.json (a multimodal model's text_config); None where this machine cannot read it."""
    config_file = Path(model) / "config.json"
    if not config_file.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model, "config.json")
        except Exception:  # not a repository id either
            cached = None
        if not isinstance(cached, str):
            return None
        config_file = Path(cached)
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    text = {**config, **(config.get("text_config") or {})}
    return {key: text[key] for key in MODEL_SHAPE_KEYS if key in text}


def dtype_name(dtype) -> str | None:
    """vLLM's or torch's name of a dtype ("float32", "float", "torch.float32") as torch's dtype's name ("float32");
    None for what names no dtype ("auto")."""
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


def server_mismatch(server_info: dict, settings: dict, server: str = "a vLLM server") -> str | None:
    """What in a given server's /server_info (`?config_format=json`) differs from what this run's rollout workers
    need (`settings`: `VLLMEngine`'s, as `server_arguments` passes them to a spawned server): the rest of one line
    naming the setting, both values and the `vllm serve` flag that fixes it; None when nothing differs. The model is
    compared by its config.json (MODEL_SHAPE_KEYS) where this machine can read the server's."""
    vllm = server_info.get("vllm_config") or {}
    model = vllm.get("model_config") or {}
    served = model.get("model")
    if (
        settings.get("model_dir")
        and served is not None
        and Path(served).resolve() != Path(settings["model_dir"]).resolve()
    ):
        ours, theirs = model_shape(settings["model_dir"]), model_shape(served)
        if theirs is None:
            log.warning(
                "trainer: %s serves %s, which this machine cannot read: its model is not compared with the run's (%s); "
                "a server of another model fails at the first weight push",
                server,
                served,
                settings["model_dir"],
            )
        elif ours is not None and theirs != ours:
            differ = [k for k in MODEL_SHAPE_KEYS if theirs.get(k) != ours.get(k)]
            return (
                f"serves another model than the run's: {served} ("
                + ", ".join(f"{k} {theirs.get(k)}" for k in differ)
                + f") where the run's {settings['model_dir']} has "
                + ", ".join(f"{k} {ours.get(k)}" for k in differ)
                + f"; fix: start it with --model {settings['model_dir']} (docs/async.md gives the whole command)"
            )
    scheduler = vllm.get("scheduler_config") or {}
    on_cpu = (vllm.get("device_config") or {}).get("device") == "cpu"
    # (setting, the server's value, the run's, the flag)
    needed = [
        ("logprobs_mode", model.get("logprobs_mode"), "processed_logprobs", "--logprobs-mode processed_logprobs"),
        (
            "weight_transfer_config.backend",
            (vllm.get("weight_transfer_config") or {}).get("backend"),
            "lit_ppo_gloo",
            '--weight-transfer-config \'{"backend": "lit_ppo_gloo"}\'',
        ),
        (
            "tensor_parallel_size",
            (vllm.get("parallel_config") or {}).get("tensor_parallel_size", 1),
            1,
            "--tensor-parallel-size 1",
        ),
        # the model's generation_config.json would fill the fields a request leaves out (top_k, repetition_penalty)
        ("generation_config", model.get("generation_config"), "vllm", "--generation-config vllm"),
    ]
    wanted_dtype = dtype_name(settings.get("dtype"))
    if wanted_dtype is not None:  # the plan's "vLLM dtype"
        dtype = dtype_name(model.get("dtype")) or model.get("dtype")
        needed.append(("dtype", dtype, wanted_dtype, f"--dtype {wanted_dtype}"))
    if on_cpu:  # seeded CPU generators cannot rewind a chunked prefill's discarded sample (engine.py)
        chunked = scheduler.get("enable_chunked_prefill")
        needed.append(("enable_chunked_prefill", chunked, False, "--no-enable-chunked-prefill"))
    for name, got, wanted, flag in needed:
        if got != wanted:
            return (
                f"runs with {name} {got!r} where this run's rollout workers need {wanted!r}; fix: start it with {flag} "
                "(docs/async.md gives the whole command)"
            )
    length = model.get("max_model_len")
    if isinstance(length, int) and length < settings.get("max_model_len", 0):
        return (
            f"serves max_model_len {length}, below rollout.max_model_len={settings['max_model_len']}; fix: start it "
            f"with --max-model-len {settings['max_model_len']}"
        )
    return None


def server_command_line(settings: dict, port: int, host: str = "127.0.0.1") -> str:
    """The command, with its environment, that starts a server for rollout.workers.server_urls by hand (docs/async.md):
    what a spawned server runs (its log's first line), less the PYTHONPATH the trainer gives it."""
    command = ["python", "-m", "vllm.entrypoints.openai.api_server", *server_arguments(settings, port, host)]
    return shell_line(server_variables(settings["kv_cache_gib"]), command)
