"""Pre-flight checks: what a user can get wrong, caught before any model loads, each in one line.

`mode=plan` and every training run pass through them (`run/prepare.py:preflight`, the one caller, which reads the
values out of the config). They read only what is cheap to read: the model's config.json and tokenizer files,
the prompt files; a reward function's or environment's signature (bound, never called) is checked in
lit_ppo/run/user_code.py. Each function here takes plain values (paths, numbers, callables) and raises a `UserError`
naming the key or file:line and the fix.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lit_ppo.config import close_match_hints
from lit_ppo.errors import ConfigError, first_line

if TYPE_CHECKING:
    from lit_ppo.plan import LoraTargets

# ------------------------------------------------------------------ files


# (A prompt file's encoding: `lit_ppo.rollout.prompts.check_utf8`, checked as the file is read.)


@dataclass(frozen=True)
class ModelFiles:
    """Where the model's config.json and tokenizer were found, and what config.json says."""

    directory: Path
    config: dict
    source: str  # for messages: the config.json's path
    local: bool = True  # False: a hub name (its snapshot in the cache may hold config.json alone)

    @property
    def max_positions(self) -> int | None:
        config = self.config.get("text_config", self.config)  # multimodal configs nest the language model's
        value = config.get("max_position_embeddings")
        return int(value) if value else None


def find_model_files(model_path: str, *, required: bool, offline: bool) -> ModelFiles | None:
    """The model's config.json without loading the model: a local directory, else a hub name already in the
    Hugging Face cache, else (online, `required`) downloaded, config.json only. `required` (a training run):
    a missing directory or an unreachable hub name is a ConfigError; else (`mode=plan`) None."""
    path = Path(model_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            if (path / "adapter_config.json").is_file():  # a LoRA run's actor/: the adapter alone
                raise ConfigError(
                    f"model.path={model_path} is a LoRA adapter (adapter_config.json), not a whole model; fix: the "
                    "run's merged model (<run>/actor_merged, written with model.lora.save_merged=true), or the run's "
                    "checkpoint (resume=<path.ckpt>) with its model.lora settings"
                )
            if (path / "actor" / "config.json").is_file():  # a run's directory: its final policy is in actor/
                raise ConfigError(
                    f"model.path={model_path} is a run's directory, not a model; fix: model.path={path / 'actor'} "
                    "(the run's final policy)"
                )
            raise ConfigError(
                f"model.path={model_path} is a directory without config.json; fix: point model.path at a saved "
                "Hugging Face model (save_pretrained) or a hub name"
            )
        return ModelFiles(path, json.loads((path / "config.json").read_text()), str(path / "config.json"))
    looks_local = model_path.startswith(("/", ".", "~")) or model_path.count("/") != 1 or path.exists()
    if looks_local:
        if not required:
            return None
        raise ConfigError(
            f"model.path={model_path} does not exist on this machine; fix: point model.path at a local model "
            "directory or a hub name such as Qwen/Qwen2.5-0.5B"
        )
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(model_path, "config.json")
    if isinstance(cached, str):
        return ModelFiles(Path(cached).parent, json.loads(Path(cached).read_text()), cached, local=False)
    if not required:
        return None
    if offline:
        raise ConfigError(
            f"model.path={model_path} is a hub name, not in the Hugging Face cache, and the hub is offline "
            "(HF_HUB_OFFLINE=1); fix: download it first (`hf download "
            f"{model_path}`), point model.path at a local copy, or unset HF_HUB_OFFLINE"
        )
    try:
        downloaded = hf_hub_download(model_path, "config.json")
    except Exception as e:
        raise ConfigError(
            f"model.path={model_path}: its config.json cannot be fetched from the Hugging Face hub "
            f"({first_line(e, type(e).__name__)}); fix: "
            "check the name and the network, or point model.path at a local model directory"
        ) from None
    return ModelFiles(Path(downloaded).parent, json.loads(Path(downloaded).read_text()), downloaded, local=False)


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def pad_token_note(name: str, pad_token: str | None, eos_token: str | None) -> str | None:
    """None when the tokenizer has a pad token; else the note that its eos token pads (padding positions are
    masked out of attention and loss, so which id fills them does not matter); ConfigError with neither."""
    if pad_token is not None:
        return None
    if eos_token is None:
        raise ConfigError(
            f"the tokenizer of {name} has neither a pad token nor an eos token; fix: add a pad token to the "
            "tokenizer (tokenizer.add_special_tokens({'pad_token': ...}) and save_pretrained)"
        )
    return f"tokenizer: {name} has no pad token; padding with its eos token {eos_token!r} (padding is masked out)"


# ------------------------------------------------------------------ lengths


def check_lengths(
    *,
    max_model_len: int,
    max_positions: int | None,
    positions_source: str,
    response_tokens: int,
    response_key: str,
    longest_prompt: tuple[int, str] | None,
) -> None:
    """Every sequence vLLM generates is prompt + response tokens within `rollout.max_model_len`, which the
    model's positions bound: vLLM would otherwise cut responses short without a word (the plan would count
    tokens that are never generated), or refuse a prompt minutes into the run. `longest_prompt`: the data's
    longest prompt in tokens and where it is (file:line), None when the data is not on this machine."""
    if max_positions is not None and max_model_len > max_positions:
        raise ConfigError(
            f"rollout.max_model_len={max_model_len} exceeds the model's {max_positions} positions "
            f"(max_position_embeddings in {positions_source}); fix: set rollout.max_model_len={max_positions} or less"
        )
    # (a fix never names a max_model_len above the model's positions: where they cannot hold it, the line says so)
    at_the_limit = max_positions is not None and max_model_len >= max_positions
    if response_tokens >= max_model_len:
        room = f" (the model has {max_positions} positions)" if max_positions is not None else ""
        limit = f" (at most {max_positions})" if max_positions is not None else ""
        raise_it = "" if at_the_limit else f" or raise rollout.max_model_len{limit}"
        raise ConfigError(
            f"{response_key}={response_tokens} leaves no room for a prompt in rollout.max_model_len={max_model_len}: "
            f"prompt + response must fit in it, and vLLM would cut the responses short{room}; fix: lower "
            f"{response_key}{raise_it}"
        )
    if longest_prompt is not None:
        tokens, where = longest_prompt
        needed = tokens + response_tokens
        if needed > max_model_len:
            shorter = (
                f"data.max_prompt_length={max_model_len - response_tokens} (longer prompts then follow "
                "data.bad_records)"
            )
            if max_positions is not None and needed > max_positions:
                longest = (
                    ""
                    if at_the_limit
                    else (
                        f"rollout.max_model_len={max_positions} with data.max_prompt_length="
                        f"{max_positions - response_tokens}, or "
                    )
                )
                lower = f", or lower {response_key}" if tokens < max_positions else ""  # the prompt alone fits
                fix = (
                    f", which the model's {max_positions} positions cannot hold either; fix: {longest}{shorter}{lower}"
                )
            else:
                limit = f" (at most {max_positions}, the model's positions)" if max_positions else ""
                fix = f"; fix: set rollout.max_model_len={needed} or more{limit}, or {shorter}"
            raise ConfigError(
                f"{where}: a prompt of {tokens} tokens + {response_key}={response_tokens} = {needed} > "
                f"rollout.max_model_len={max_model_len}{fix}"
            )


# ------------------------------------------------------------------ packing


def resolve_packing(packing: bool | None, model_type: str | None) -> bool | None:
    """ppo.packing for a model of `model_type` (config.json; None: not on this machine, `mode=plan`, left as set):
    null becomes on where transformers reads the model's packed position ids and off (with a line saying why) where
    not; true where not is refused."""
    from lit_ppo.training.packing import packing_unsupported

    if model_type is None or packing is False:
        return packing
    reason = packing_unsupported(model_type)
    if reason and packing:
        raise ConfigError(f"ppo.packing=true: {reason}; fix: set ppo.packing=false (padded micro-batches)")
    if reason:
        from lit_ppo.console import show

        show(f"packing: off, {reason} (ppo.packing=null); micro-batches are padded")
    return reason is None


def resolve_shared_prefix(shared_prefix: bool | None, model_config, attn_implementation: str | None) -> bool | None:
    """ppo.shared_prefix for the model (its transformers config; None: not on this machine, left as set) once packing
    is on: null becomes off (with a line saying why) where the layout would not be exact for it (sliding-window
    layers, an attention implementation without a ready 4-D mask); true there is refused."""
    from lit_ppo.training.packing import shared_prefix_unsupported

    if model_config is None or shared_prefix is False:
        return shared_prefix
    reason = shared_prefix_unsupported(model_config, attn_implementation or "sdpa")
    if reason and shared_prefix:
        raise ConfigError(f"ppo.shared_prefix=true: {reason}; fix: set ppo.shared_prefix=false (flat packed rows)")
    if reason:
        from lit_ppo.console import show

        show(f"shared prefix: off, {reason} (ppo.shared_prefix=null); every sample's prompt is laid out")
        return False
    return shared_prefix


def check_attention(attn_implementation: str | None, accelerator: str = "auto") -> None:
    """model.attn_implementation where the run trains on `accelerator` (strategy.accelerator): the kernels it names must
    be installed here, or the model's load would fail (or, for flex attention, its first forward or backward) only after
    the data and the engine were set up. Flex attention trains on a GPU only: torch (2.13) runs its forward on a CPU but
    not its backward ("FlexAttention does not support backward on CPU"; `flex_backward_on_cpu` asks the installed
    torch)."""
    import torch
    import transformers.utils as available

    needs = {
        "flash_attention_2": (available.is_flash_attn_2_available, "the flash-attn package (2.x) with a CUDA device"),
        "flash_attention_3": (
            available.is_flash_attn_3_available,
            "flash-attn 3 (flash_attn_interface) with a CUDA device",
        ),
        "flex_attention": (available.is_torch_flex_attn_available, "a torch with flex attention (2.5 or later)"),
    }
    if attn_implementation in needs:
        present, what = needs[attn_implementation]
        if not present():
            raise ConfigError(
                f"model.attn_implementation={attn_implementation}: needs {what}, not found here; fix: install it, or "
                "model.attn_implementation=null (transformers' default, sdpa)"
            )
    on_cpu = str(accelerator) == "cpu" or (str(accelerator) == "auto" and not torch.cuda.is_available())
    if attn_implementation == "flex_attention" and on_cpu and not flex_backward_on_cpu():
        raise ConfigError(
            f"model.attn_implementation=flex_attention: torch {torch.__version__} has no flex attention backward on a "
            "CPU (strategy.accelerator resolves to cpu here); fix: train on a GPU, or model.attn_implementation=null "
            "(sdpa)"
        )


def flex_backward_on_cpu() -> bool:
    """Whether the installed torch computes flex attention's gradients on a CPU: one backward through 16 positions,
    uncompiled (torch refuses at the call, before any kernel runs, where it cannot)."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    query = torch.zeros(1, 1, 16, 8, requires_grad=True)
    try:
        flex_attention(query, query, query).sum().backward()
    except NotImplementedError:
        return False
    return True


# ------------------------------------------------------------------ LoRA targets


def meta_model(architecture: Any, where: str) -> Any:
    """The causal LM that `architecture` describes (a transformers config, or the directory of its config.json),
    built on the meta device: its modules and their shapes, no memory taken and no weights read. `where` names the
    model in a refusal."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        if isinstance(architecture, (str, Path)):
            architecture = AutoConfig.from_pretrained(architecture)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(architecture)
    except Exception as e:  # the run's own load (AutoModelForCausalLM.from_pretrained) would fail alike
        raise ConfigError(
            f"{where}: transformers cannot build a causal LM from its config.json ({type(e).__name__}: "
            f"{first_line(e)}), so "
            "model.lora.target_modules cannot be matched to its modules; fix: point model.path at a model that "
            "AutoModelForCausalLM loads"
        ) from None


def lora_targets(model: Any, target_modules: str | list[str], rank: int, where: str) -> LoraTargets:
    """The linear modules of `model` that `model.lora.target_modules` adapts, matched as peft matches them: all-linear,
    every linear module but the output layer (the LM head); a list, the modules whose whole name is one of the names
    or ends with `.name`. A name that matches no linear module is refused, with the linear modules' names: peft would
    adapt the others without a word, or fail with its own error once the model has loaded. `where` names the model
    in that message."""
    import torch
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers; peft's all-linear counts them too

    from lit_ppo.plan import LoraTargets

    linear = {name: module for name, module in model.named_modules() if isinstance(module, (torch.nn.Linear, Conv1D))}
    existing = list(dict.fromkeys(name.rsplit(".", 1)[-1] for name in linear))
    if target_modules == "all-linear":
        output = model.get_output_embeddings()
        chosen = [name for name, module in linear.items() if module is not output]
    else:
        targets = list(target_modules)
        unmatched = [t for t in targets if not any(_peft_matches(name, t) for name in linear)]
        if unmatched:
            hints = close_match_hints(unmatched, existing)
            raise ConfigError(
                f"model.lora.target_modules=[{','.join(targets)}]: {', '.join(unmatched)} matches no linear module of "
                f"{where}, whose linear modules are {', '.join(existing)}; fix: correct "
                + (", ".join(hints) if hints else "or remove " + ", ".join(unmatched))
                + ", or use model.lora.target_modules=all-linear"
            )
        chosen = [name for name in linear if any(_peft_matches(name, t) for t in targets)]
    parameters = sum(rank * sum(linear[name].weight.shape) for name in chosen)  # rank x (in + out) each
    return LoraTargets(modules=tuple(chosen), adapter_parameters=parameters)


def _peft_matches(module_name: str, target: str) -> bool:
    """peft's rule for a list of target names (tuners_utils.check_target_module_exists)."""
    return module_name == target or module_name.endswith(f".{target}")


# ------------------------------------------------------------------ ranks


def check_accelerator(accelerator: str, devices: int, strategy_name: str) -> None:
    """strategy.accelerator=gpu (strategy=fsdp's preset) or cuda where torch finds no GPU: Lightning would stop after
    the plan with its 30-line "No supported gpu backend found!". For training runs only: `mode=plan` plans a GPU
    cluster's run on any machine."""
    import torch

    if str(accelerator) not in ("gpu", "cuda") or torch.cuda.is_available():
        return
    if str(accelerator) == "gpu" and torch.backends.mps.is_available():  # Lightning's gpu is CUDA or Apple's MPS
        return
    processes = f" (strategy.devices={devices}: {devices} CPU processes)" if devices > 1 else ""
    raise ConfigError(
        f"strategy.accelerator={accelerator} (strategy={strategy_name}) but torch finds no GPU on this machine; fix: "
        f"strategy.accelerator=cpu{processes}, or run on a machine with a GPU (mode=plan plans for GPUs on any machine)"
    )


def check_strategy(name: str, devices: int, num_nodes: int) -> None:
    """strategy=single runs one process. Asked for more devices or nodes, Lightning would start the other ranks and
    their engines with its own DDP defaults, and the first backward would fail minutes later with DDP's "parameters
    that were not used in producing the loss" (the actor and the critic take separate backward passes; strategy=ddp
    sets find_unused_parameters for that)."""
    if name == "single" and (devices > 1 or num_nodes > 1):
        nodes = f" strategy.num_nodes={num_nodes}" if num_nodes > 1 else ""
        raise ConfigError(
            f"strategy=single runs one process, but strategy.devices={devices}{nodes} asks for "
            f"{devices * num_nodes} ranks; fix: strategy=ddp strategy.devices={devices}{nodes} (or strategy=fsdp), "
            "or strategy.devices=1"
        )


CHILD_START_METHODS = ("spawn", "fork", "forkserver")
"""Lightning start methods that run the ranks as child processes of this one (ddp_spawn, ddp_fork, ddp_notebook)."""


def check_launcher(lightning: dict | None, class_default: bool = True) -> None:
    """A Lightning strategy whose ranks are child processes of this one (`start_method` spawn, fork or forkserver,
    given in strategy.lightning or, with `class_default`, its class's default): rank 0's training, evaluations and
    history stay in its child, while this process, which did not train, writes the run's summary and outputs
    (measured: a fork run of 2 CPU ranks trained and wrote `rollout_steps: 0`); spawn's pickling of the run fails
    before any rank starts. Lightning's default (popen: every rank a copy of the command, as torchrun and srun start
    them) runs `train` on every rank. (`class_default` imports the class, hence Lightning and transformers: not for
    `mode=plan`, which imports neither.)"""
    if not lightning or not lightning.get("_target_"):
        return
    method = lightning.get("start_method")
    if method is None and class_default:
        import inspect

        import hydra

        parameter = inspect.signature(hydra.utils.get_class(lightning["_target_"])).parameters.get("start_method")
        method = parameter.default if parameter is not None else None
    if method in CHILD_START_METHODS:
        refuse_child_launcher(method)


def refuse_child_launcher(method: str) -> None:
    raise ConfigError(
        f"strategy.lightning.start_method={method} runs the ranks as child processes of this one, which would write "
        "the run's outputs without their training (rank 0's history and evaluations stay in its child); fix: "
        "strategy.lightning.start_method=popen (Lightning's default: each rank a copy of the command), or start the "
        "ranks with torchrun or srun"
    )
