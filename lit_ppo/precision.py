"""Which numeric precision a run trains in, and the vLLM dtype that goes with it: decided once, here.

`strategy.precision` (conf/strategy/*.yaml) is one of
- `auto` (the default): `bf16-mixed` where the device computes bf16 natively (CUDA GPUs with bf16;
  CPUs with AVX512-BF16 or AMX), `32-true` elsewhere, where bf16 is emulated and slower than float32;
- `32-true`: float32 everything;
- `bf16-mixed`: float32 weights, gradients and AdamW states, bf16 compute (autocast; under FSDP2 also
  `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`), as verl and OpenRLHF train;
- `bf16-true`: weights and optimizer states in bf16. Half the memory, but an update smaller than bf16's
  resolution (2^-8 of the weight) rounds away: lr 1e-6 on |w| = 0.02 changes almost nothing.
`16-mixed` (fp16 with a loss scaler) is refused: the update loop clips and checks gradients before they
would be unscaled, and a skipped step would never update the scaler.

The step plan (`compute_plan`) records the resolved precision and the trainer is built from it, so the
plan table shows what the run does.
"""

from __future__ import annotations

import os
from pathlib import Path

PRECISIONS = ("auto", "32-true", "bf16-mixed", "bf16-true")
ROLLOUT_DTYPES = ("float32", "bfloat16", "float16")


# `LIT_PPO_NATIVE_BF16=0` makes a CPU with native bf16 count as one without (and `=1` the reverse), so
# a machine with AVX512-BF16 can run the suite down the path a machine without it takes (`make
# test-no-bf16`, .ci/run). Anything else is refused: a typo must not silently pick a path.
NATIVE_BF16_ENV = "LIT_PPO_NATIVE_BF16"


def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """AVX512-BF16 or AMX-BF16 in the CPU's flags (Linux); False where that cannot be read.
    `LIT_PPO_NATIVE_BF16=0|1` overrides what the flags say."""
    forced = os.environ.get(NATIVE_BF16_ENV)
    if forced is not None and forced != "":
        if forced not in ("0", "1"):
            from lit_ppo.errors import ConfigError

            raise ConfigError(
                f"{NATIVE_BF16_ENV}={forced!r} is not 0 or 1; fix: set it to 0 (treat bf16 as emulated), 1, or unset it"
            )
        return forced == "1"
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"avx512_bf16", "amx_bf16"})
    return False


def device_has_native_bf16(accelerator: str) -> bool:
    """Whether `strategy.accelerator` computes bf16 natively. A plan made for GPUs on a machine without
    one (`mode=plan` on a laptop) assumes a GPU with bf16, as every GPU since Ampere has."""
    import torch

    accelerator = str(accelerator)
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    if on_gpu:
        return torch.cuda.is_bf16_supported(including_emulation=False) if torch.cuda.is_available() else True
    if accelerator in ("cpu", "auto"):
        return cpu_has_native_bf16()
    return False  # mps and others: float32


def resolve_precision(precision, accelerator: str) -> str:
    """`strategy.precision` as the trainer runs it: `auto` decided for this device, the rest checked."""
    from lit_ppo.errors import ConfigError

    precision = str(precision)
    if precision == "16-mixed":
        raise ConfigError(
            "strategy.precision=16-mixed is not supported (fp16 needs a loss scaler that the update loop "
            "does not drive); fix: use strategy.precision=bf16-mixed, or auto"
        )
    if precision not in PRECISIONS:
        raise ConfigError(f"strategy.precision={precision!r} is unknown; fix: use one of {', '.join(PRECISIONS)}")
    if precision == "auto":
        return "bf16-mixed" if device_has_native_bf16(accelerator) else "32-true"
    return precision


def resolve_rollout_dtype(precision: str, configured: str | None) -> str:
    """vLLM's dtype: `rollout.dtype` when set, else the training compute dtype (bf16 or float32)."""
    from lit_ppo.errors import ConfigError

    if configured is None:
        return "bfloat16" if precision.startswith("bf16") else "float32"
    if configured not in ROLLOUT_DTYPES:
        raise ConfigError(
            f"rollout.dtype={configured!r} is unknown; fix: use null (follow strategy.precision) or one "
            f"of {', '.join(ROLLOUT_DTYPES)}"
        )
    return configured


def describe(precision: str) -> str:
    return {
        "32-true": "float32 weights, optimizer states and compute",
        "bf16-mixed": "float32 weights and optimizer states, bf16 compute",
        "bf16-true": "bf16 weights and optimizer states (updates below bf16 resolution are lost)",
    }[precision]
