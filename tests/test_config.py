"""The config dataclasses' defaults are the YAML defaults, so code that builds a config without Hydra
(tests, notebooks, bench/) trains what `python train.py` trains."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import yaml

from lit_ppo.config import PPOConfig, RolloutConfig
from lit_ppo.precision import resolve_precision, resolve_rollout_dtype
from lit_ppo.rollout.engine import VLLMEngine

CONF = Path(__file__).resolve().parents[1] / "conf"


def dataclass_defaults(cls: type) -> dict:
    """Each field's default, nested config sections as dicts."""
    defaults = {}
    for f in dataclasses.fields(cls):
        value = f.default_factory() if f.default is dataclasses.MISSING else f.default
        defaults[f.name] = dataclass_defaults(type(value)) if dataclasses.is_dataclass(value) else value
    return defaults


@pytest.mark.parametrize(
    "cls, yaml_file", [(PPOConfig, "ppo/ppo.yaml"), (RolloutConfig, "rollout/vllm.yaml")], ids=["ppo", "rollout"]
)
def test_dataclass_defaults_equal_the_default_yaml(cls, yaml_file):
    from_yaml = yaml.safe_load((CONF / yaml_file).read_text())
    assert dataclass_defaults(cls) == from_yaml  # same keys, same values (a new key needs both)


def test_engine_defaults_equal_the_rollout_config():
    """VLLMEngine built without Hydra (tests, bench/) gets the engine `rollout: vllm` gives."""
    rollout = dataclass_defaults(RolloutConfig)
    engine = {name: p.default for name, p in inspect.signature(VLLMEngine).parameters.items() if name in rollout}
    # rollout.dtype null means "resolved from strategy.precision"; the engine takes the resolved dtype.
    assert engine.pop("dtype") == resolve_rollout_dtype(resolve_precision("32-true", "cpu"), rollout["dtype"])
    assert engine and engine == {name: rollout[name] for name in engine}


def test_configs_and_plan_are_frozen():
    """Everything reads the plan and the configs; nothing may change them after the plan is stated."""
    from lit_ppo.plan import StepPlan

    for cls in (PPOConfig, RolloutConfig, StepPlan):
        assert cls.__dataclass_params__.frozen, cls
    with pytest.raises(dataclasses.FrozenInstanceError):
        PPOConfig().ppo_epochs = 2
