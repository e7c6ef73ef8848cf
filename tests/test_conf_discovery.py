"""Every YAML under conf/ is tested because it is on disk, not because a test names it: each experiment is composed
and planned as `python train.py +experiment=NAME mode=plan` does, and every option of every other group is composed
on top of the default config. The PPO presets also train for two rollout steps:
`test_every_preset_completes_two_rollout_steps` in tests/end_to_end/test_train.py globs conf/ppo/."""

from __future__ import annotations

import json

import pytest
import yaml
from omegaconf import OmegaConf

from lit_ppo.run import entry as run_module
from tests.helpers import CONF, compose_config

EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
# (group, option) for every other group (conf/experiment is planned on its own, above).
GROUP_OPTIONS = sorted((p.parent.name, p.stem) for p in CONF.glob("*/*.yaml") if p.parent.name != "experiment")
# Groups the root config.yaml chooses a default for are switched with `group=option`; the others are added with `+`.
DEFAULT_GROUPS = {
    next(iter(entry))
    for entry in yaml.safe_load((CONF / "config.yaml").read_text())["defaults"]
    if isinstance(entry, dict)
}


def test_discovery_sees_the_files():
    """A wrong path would make the parametrized tests below collect nothing and pass."""
    assert {"qwen7b", "qwen1.5b", "qwen0.5b", "gsm8k_tools", "tool_arithmetic"} <= set(EXPERIMENTS)
    assert {"model", "data", "reward", "ppo", "strategy", "logger", "rollout", "recipe"} <= {
        g for g, _ in GROUP_OPTIONS
    }


def leaves(tree: dict, prefix: str = "") -> dict:
    """{"a.b.c": value} for every non-dict value of a nested dict."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes_and_plans(name, tmp_path):
    cfg = compose_config(f"+experiment={name}", "mode=plan", f"output_dir={tmp_path}")
    # `+experiment` comes after the root's _self_, so the experiment's own values win over the root's and the
    # groups' (trainer.total_rollout_steps, strategy.devices, ...): each value the file sets is the composed one.
    own = yaml.safe_load((CONF / "experiment" / f"{name}.yaml").read_text())
    own.pop("defaults", None)
    composed = leaves(OmegaConf.to_container(cfg, resolve=False))
    for key, value in leaves(own).items():
        assert composed.get(key) == value, (
            f"conf/experiment/{name}.yaml sets {key}={value!r}, composed: {composed.get(key)!r}"
        )

    assert run_module.main(cfg) is None  # mode=plan: the plan from the config alone, no weights, data or GPU
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["counts"]["total_optimizer_steps"] > 0 and plan["counts"]["samples_per_rollout_step"] > 0
    assert plan["memory"] is not None, (
        f"mode=plan cannot estimate {name}'s memory; fix: give the experiment a "
        "model.architecture block (see conf/experiment/qwen7b.yaml)"
    )


@pytest.mark.parametrize("group, option", GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_group_option_composes_with_the_default_config(group, option, tmp_path):
    sign = "" if group in DEFAULT_GROUPS else "+"
    cfg = compose_config(f"{sign}{group}={option}", f"output_dir={tmp_path}")
    # Every interpolation resolves. Planning is left to the experiments: an option alone need not plan on top of
    # the defaults (strategy=fsdp's 8 ranks do not divide the default train batch; data=file needs data.path).
    OmegaConf.to_container(cfg, resolve=True)


def test_help_says_what_lit_ppo_is_and_lists_every_group_with_its_options(tmp_path):
    """`python train.py --help` was Hydra's bare template ("train is powered by Hydra")."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        result.stdout.startswith("lit-ppo: PPO-family reinforcement learning")
        and "powered by Hydra" not in result.stdout
    )
    assert "python train.py mode=plan" in result.stdout and "output_dir=runs/exp1 resume=auto" in result.stdout
    for group in {g for g, _ in GROUP_OPTIONS} | {"experiment"}:
        options = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
        assert f"{group}: {', '.join(options)}" in result.stdout, group
    assert not list(tmp_path.iterdir())  # --help makes no run directory
