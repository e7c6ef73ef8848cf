"""Every experiment's and every config group's step plan, written as `python train.py mode=plan` writes it: one
directory per case with the printed table (table.txt) and plan.json, so that a change to the plan's code can be
checked by `diff -r` of two such directories (the tables identical; plan.json's values identical). No model loads.

    python bench/plan_tables.py /tmp/plans_before      # before the change
    python bench/plan_tables.py /tmp/plans_after       # after it
    diff -r /tmp/plans_before /tmp/plans_after

`--flat` flattens plan.json by section (`{"counts": {"x": 1}}` -> `{"x": 1}`, plan_json_flat.json beside plan.json).
`--compare BEFORE AFTER` checks, case by case, that the printed tables are the same and that plan.json's values are:
a plan written before the plan had sections (flat) is mapped to its sections by `lit_ppo.plan.sections_of` (the
mapping, RENAMED_FLAT_KEYS) and must then equal the one written after, the memory estimate included.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONF = ROOT / "conf"

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from lit_ppo.plan import sections_of  # noqa: E402
from lit_ppo.run import entry  # noqa: E402

OmegaConf.register_new_resolver("lit_ppo_run_dir", lambda output_dir, default: output_dir or default, replace=True)

# Groups the root config.yaml chooses a default for are switched with `group=option`; the others are added with `+`.
DEFAULT_GROUPS = ("model", "rollout", "data", "reward", "ppo", "strategy", "logger")

# The features, each on (or off) alone and in the pairs the plan's sections meet in.
FEATURES = {
    "disaggregated": ["rollout.mode=disaggregated"],
    "disaggregated_k2_workers2": ["rollout.mode=disaggregated", "rollout.max_staleness=2", "rollout.workers.count=2"],
    "disaggregated_external": [
        "rollout.mode=disaggregated",
        "rollout.workers.launch=external",
        "rollout.workers.trainer_host=node7",
        "rollout.workers.port=29611",
    ],
    "disaggregated_lora": ["rollout.mode=disaggregated", "model.lora.rank=8"],
    "lora": ["model.lora.rank=8"],
    "lora_bf16": ["model.lora.rank=16", "strategy.precision=bf16-mixed", "ppo.kl_coef=0.01"],
    "dapo": ["ppo=dapo"],
    "dapo_ddp": ["ppo=dapo", "strategy=ddp", "strategy.devices=2"],
    "dapo_prompts_per_round": ["ppo=dapo", "ppo.dynamic_sampling.prompts_per_round=32"],
    "episodes": ["+experiment=tool_arithmetic"],
    "episodes_ddp": ["+experiment=tool_arithmetic", "strategy=ddp", "strategy.devices=2"],
    "packing_off": ["ppo.packing=false"],
    "packing_off_ddp": ["ppo.packing=false", "strategy=ddp", "strategy.devices=2"],
    "ddp": ["strategy=ddp", "strategy.devices=2"],
    "token_budget": ["ppo.micro_train_max_tokens=256"],
    "token_budget_padded": ["ppo.micro_train_max_tokens=256", "ppo.packing=false"],
    "hf_engine": ["rollout.engine=hf"],
    "hf_engine_vllm_settings": ["rollout.engine=hf", "rollout.vllm.kv_cache_gib=2"],
    "old_logprobs_rollout": ["ppo.old_logprobs=rollout"],
    "on_policy": ["ppo=grpo", "ppo.train_batch_size=64", "ppo.micro_train_batch_size=8"],
    "data_epochs": ["trainer.total_rollout_steps=null", "trainer.data_epochs=1.5"],
    "top_p": ["rollout.top_p=0.9"],
    "bf16_true": ["strategy.precision=bf16-true"],
    "flash": ["model.attn_implementation=flash_attention_2"],
    # the groups whose options need a value set on the command line
    "data_file_set": ["data=file", "data.path=/nonexistent/prompts.jsonl", "data.expected_prompts=5000"],
    "data_gsm8k_set": ["data=gsm8k", "data.expected_prompts=7473"],
    "reward_reward_model_set": ["reward=reward_model", "reward.fn.model_dir=/nonexistent/rm"],
    "strategy_fsdp_set": ["strategy=fsdp", "ppo.micro_train_batch_size=8"],
    "ppo_distill_set": ["ppo=distill", "model.teacher.path=/nonexistent/teacher"],
    "distill_reward_ddp": [
        "ppo=distill",
        "model.teacher.path=/nonexistent/teacher",
        "ppo.distill.reward_coef=0.5",
        "strategy=ddp",
        "strategy.devices=2",
    ],
}


def cases() -> dict[str, list[str]]:
    """Case name -> the overrides of `python train.py <overrides> mode=plan`."""
    found = {"default": []}
    for path in sorted((CONF / "experiment").glob("*.yaml")):
        found[f"experiment_{path.stem}"] = [f"+experiment={path.stem}"]
    for path in sorted(CONF.glob("*/*.yaml")):
        group = path.parent.name
        if group != "experiment":
            found[f"{group}_{path.stem}"] = [f"{'' if group in DEFAULT_GROUPS else '+'}{group}={path.stem}"]
    found.update(FEATURES)
    return found


def flat(record: dict) -> dict:
    """plan.json with its sections' values at the top (the memory estimate stays a dict of its own)."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict) and key not in ("memory", "prompt_stats"):
            out.update(value)
        else:
            out[key] = value
    return out


def compare(before: Path, after: Path) -> int:
    """Print each case whose table or plan.json values differ between two directories; the number of such cases."""
    differing = 0
    for case in sorted(p.name for p in before.iterdir()):
        old, new = before / case, after / case
        if (old / "error.txt").exists() or (new / "error.txt").exists():
            same = (
                all((d / "error.txt").exists() for d in (old, new))
                and (old / "error.txt").read_text() == (new / "error.txt").read_text()
            )
            print(f"{case}: {'refused the same way' if same else 'REFUSED DIFFERENTLY'}")
            differing += not same
            continue
        table_same = (old / "printed.txt").read_text() == (new / "printed.txt").read_text()
        old_plan, new_plan = (json.loads((d / "plan.json").read_text()) for d in (old, new))
        values_same = {**sections_of(old_plan), "memory": old_plan.get("memory")} == new_plan
        print(
            f"{case}: table {'same' if table_same else 'DIFFERS'}, plan.json values {'same' if values_same else 'DIFFER'}"
        )
        differing += not (table_same and values_same)
    print(f"{differing} case(s) differ")
    return differing


def main() -> None:
    if sys.argv[1:2] == ["--compare"]:
        sys.exit(1 if compare(Path(sys.argv[2]), Path(sys.argv[3])) else 0)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--flat", action="store_true", help="also write plan_json_flat.json (sections flattened)")
    parser.add_argument("--only", nargs="*", help="case names to write (default: all)")
    args = parser.parse_args()
    for name, overrides in cases().items():
        if args.only and name not in args.only:
            continue
        where = args.out / name
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose(config_name="config", overrides=[*overrides, "mode=plan", f"output_dir={where}"])
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                entry.main(cfg)
        except Exception as error:  # a case the config refuses: its one line is the result
            where.mkdir(parents=True, exist_ok=True)
            (where / "error.txt").write_text(f"{type(error).__name__}: {error}\n")
            print(f"{name}: {type(error).__name__}: {error}")
            continue
        (where / "overrides.txt").write_text(" ".join(overrides) + "\n")
        (where / "printed.txt").write_text(printed.getvalue().replace(str(where), "<output_dir>"))
        if args.flat:
            record = json.loads((where / "plan.json").read_text())
            (where / "plan_json_flat.json").write_text(json.dumps(flat(record), indent=2, sort_keys=True))
        print(f"{name}: {where}")


if __name__ == "__main__":
    main()
