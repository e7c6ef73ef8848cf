"""The training step's numbers, recorded and compared bit for bit: a refactor of the step must not change them.

`record OUT.pt` runs a few short tiny-model runs (PPO with a critic, GRPO exactly on-policy with and without the KL in
the loss, packing on and off, 2 PPO epochs of 2 mini-batches, a token budget, old log-probs from vLLM, dynamic
sampling, LoRA) and saves, per run: every forward's log-probs and entropies, every experience the metrics row reads
(old, reference and rollout log-probs, values, advantages, returns, KL), the metrics rows (timings and memory left out)
and the final weights of the actor and the critic. `compare A.pt B.pt` says which differ (torch.equal, no tolerance).

    PYTHONPATH=$PWD .venv/bin/python bench/train_step_bitwise.py record /tmp/before.pt
    (change the code)
    PYTHONPATH=$PWD .venv/bin/python bench/train_step_bitwise.py record /tmp/after.pt
    PYTHONPATH=$PWD .venv/bin/python bench/train_step_bitwise.py compare /tmp/before.pt /tmp/after.pt

`compare-runs A B` compares two `python train.py` output directories the same way (e.g. 2 DDP ranks on CPU:
`strategy=ddp strategy.devices=2 strategy.accelerator=cpu strategy.precision=32-true`, before and after): metrics.csv
without its wall-clock columns, the final actor/ tensors and the last checkpoint's trained tensors.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from lit_ppo.config import DynamicSamplingConfig, LoraConfig, RolloutConfig  # noqa: E402
from lit_ppo.training import module as module_file  # noqa: E402
from tests.helpers import build_run, save_fixture_model  # noqa: E402

BASE = dict(rollout_batch_size=4, n_samples_per_prompt=4, train_batch_size=16, micro_train_batch_size=4)
RUNS: dict[str, dict] = {
    "ppo_critic": dict(ppo_epochs=2, train_batch_size=8),  # gae, KL in the reward, 2 epochs of 2 mini-batches
    "ppo_critic_packed": dict(ppo_epochs=2, train_batch_size=8, packing=True),
    "ppo_token_budget": dict(ppo_epochs=2, train_batch_size=8, micro_train_max_tokens=96, packing=False),
    "grpo_on_policy": dict(advantage_estimator="grpo", kl_coef=0.0, kl_mode="loss", packing=False),
    "grpo_on_policy_packed": dict(advantage_estimator="grpo", kl_coef=0.0, kl_mode="loss", packing=True),
    "grpo_kl_loss": dict(advantage_estimator="grpo", kl_coef=0.05, kl_mode="loss", entropy_coef=0.01),
    "grpo_vllm_old": dict(advantage_estimator="grpo", kl_coef=0.0, kl_mode="loss", old_logprobs="rollout"),
    "dapo_dynamic": dict(
        advantage_estimator="grpo",
        kl_coef=0.0,
        kl_mode="loss",
        clip_ratio_high=0.28,
        loss_agg_mode="seq-mean-token-mean",
        dynamic_sampling=DynamicSamplingConfig(enabled=True, max_generation_rounds=2),
    ),
    "lora_ppo": dict(lora=LoraConfig(rank=4, alpha=8.0), engine="hf"),
}
SKIPPED_COLUMNS = ("timing/", "perf/tokens_per_second", "perf/generated_tokens_per_s", "perf/device_peak_memory_gib")
"""Wall-clock figures: they differ between any two runs."""


def tiny_model_dir(root: Path) -> str:
    """The tests' fixture model (seed 0), the one conftest's `tiny_model_dir` builds."""
    return save_fixture_model(root / "model", 0)


def data_files(root: Path):
    from lit_ppo.demo.arithmetic import make_problems, write_jsonl

    train, evaluation = make_problems(seed=0, max_operand=20, n_train=64, n_eval=8)
    return write_jsonl(train, root / "train.jsonl"), write_jsonl(evaluation, root / "eval.jsonl")


def half_reward(prompts, responses, references, extras):
    """Uniform for prompts whose answer is even (dynamic sampling drops those groups), the response's length otherwise."""
    return [1.0 if int(ref) % 2 == 0 else len(r) / 8 for r, ref in zip(responses, references)]


def comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(SKIPPED_COLUMNS)}


def record_run(name: str, settings: dict, model_dir: str, engine, files, out: Path) -> dict:
    settings = dict(settings)
    lora, engine_kind = settings.pop("lora", None), settings.pop("engine", "vllm")
    rollout = RolloutConfig(max_response_tokens=8, eval_samples_per_prompt=1, engine=engine_kind)
    forwards: list[tuple[Tensor, Tensor]] = []
    experiences: list[dict] = []
    logprobs, step_row = module_file.logprobs_and_entropy, module_file.rollout_step_row

    def recorded_logprobs(model, mb, temperature, cp=None):
        logp, entropy = logprobs(model, mb, temperature, cp)
        forwards.append((logp.detach().clone(), None if entropy is None else entropy.detach().clone()))
        return logp, entropy

    def recorded_row(batch, exp, *args, **kwargs):
        fields = {f.name: getattr(exp, f.name) for f in dataclasses.fields(exp)}
        experiences.append({k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in fields.items()})
        return step_row(batch, exp, *args, **kwargs)

    module_file.logprobs_and_entropy = recorded_logprobs
    module_file.rollout_step_row = recorded_row
    try:
        torch.manual_seed(0)
        trainer, module, datamodule, plan = build_run(
            model_dir,
            None if engine_kind == "hf" else engine,
            files,
            out / name,
            total_rollout_steps=2,
            rollout=rollout,
            reward_fn=half_reward,
            lora=lora,
            **{**BASE, **settings},
        )
        trainer.fit(module, datamodule=datamodule)
    finally:
        module_file.logprobs_and_entropy = logprobs
        module_file.rollout_step_row = step_row
    rows = [comparable(row) for row in module.history]
    weights = {f"actor.{k}": v.detach().clone() for k, v in module.actor.state_dict().items()}
    if module.critic is not None:
        weights.update({f"critic.{k}": v.detach().clone() for k, v in module.critic.state_dict().items()})
    print(f"{name}: {len(forwards)} forwards, {len(rows)} rows, {plan.old_logprobs.source}", flush=True)
    return {"forwards": forwards, "experiences": experiences, "rows": rows, "weights": weights}


def record(path: Path, names: list[str]) -> None:
    from lit_ppo.rollout.engine import VLLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = tiny_model_dir(root)
        files = data_files(root)
        engine = VLLMEngine(model_dir, max_model_len=128, seed=0)
        results = {name: record_run(name, RUNS[name], model_dir, engine, files, root) for name in names}
    torch.save(results, path)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        # A field one side lacks is the same as one the other holds as None: a new, unused field (e.g. the teacher's
        # log-probs of a run without a teacher) carries no number that could differ.
        keys = a.keys() | b.keys()
        return all(same(a.get(k), b.get(k)) for k in keys)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def one_sided_keys(a: list[dict], b: list[dict]) -> set[str]:
    """The keys (with a value) of the dicts of `a` or `b` that the other side lacks, removed from both: a new metric
    column or experience field (e.g. the numerics metrics of issue 51) is not a change of the step's numbers."""
    keys_a = {k for row in a for k, v in row.items() if v is not None}
    keys_b = {k for row in b for k, v in row.items() if v is not None}
    only = keys_a ^ keys_b
    for row in a + b:
        for k in only:
            row.pop(k, None)
    return only


def compare(before: Path, after: Path) -> int:
    a, b = torch.load(before, weights_only=False), torch.load(after, weights_only=False)
    failures = 0
    for name in sorted(a.keys() | b.keys()):
        if name not in a or name not in b:
            print(f"{name}: recorded in one file only")
            failures += 1
            continue
        for result in (a[name], b[name]):
            result["rows"] = [comparable(row) for row in result["rows"]]
        for part in ("rows", "experiences"):  # a metric or field one side has not yet: new, named, not a difference
            if only := one_sided_keys(a[name][part], b[name][part]):
                print(f"{name}: {part} in one file only (left out): {', '.join(sorted(only))}")
        differ = [
            part for part in ("forwards", "experiences", "rows", "weights") if not same(a[name][part], b[name][part])
        ]
        print(f"{name}: {'identical' if not differ else 'DIFFERENT: ' + ', '.join(differ)}")
        failures += bool(differ)
    return 1 if failures else 0


def compare_runs(before: Path, after: Path) -> int:
    import csv

    from safetensors.torch import load_file

    def run(directory: Path) -> dict:
        with open(directory / "metrics.csv") as f:
            rows = [comparable(row) for row in csv.DictReader(f)]
        [last] = sorted((directory / "checkpoints").glob("*.ckpt"))[-1:]
        return {
            "rows": rows,
            "actor": load_file(directory / "actor" / "model.safetensors"),
            "checkpoint": torch.load(last, weights_only=False, map_location="cpu")["state_dict"],
        }

    a, b = run(before), run(after)
    differ = [part for part in a if not same(a[part], b[part])]
    print(f"{before} vs {after}: {'identical' if not differ else 'DIFFERENT: ' + ', '.join(differ)}")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("out", type=Path)
    rec.add_argument("--runs", nargs="*", default=list(RUNS), choices=list(RUNS))
    cmp = sub.add_parser("compare")
    cmp.add_argument("before", type=Path)
    cmp.add_argument("after", type=Path)
    runs = sub.add_parser("compare-runs")
    runs.add_argument("before", type=Path)
    runs.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "record":
        record(args.out, args.runs)
        return 0
    if args.command == "compare-runs":
        return compare_runs(args.before, args.after)
    return compare(args.before, args.after)


if __name__ == "__main__":
    raise SystemExit(main())
