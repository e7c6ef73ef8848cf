"""The engine contract (lit_ppo/contract.py): every rollout engine implements `RolloutEngine`, and the trainer hands
each the same typed `WeightUpdate` without asking which engine it holds."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

from lit_ppo.contract import AdapterWeights, RolloutEngine, WeightUpdate
from lit_ppo.rollout.engine import VLLMEngine
from lit_ppo.rollout.hf_engine import HFEngine
from lit_ppo.rollout.workers.client import RolloutWorkers
from lit_ppo.rollout.workers.ranks import DataParallelWorkers
from lit_ppo.testing import NullEngine
from tests.helpers import ROOT

ENGINES = [VLLMEngine, HFEngine, RolloutWorkers, DataParallelWorkers, NullEngine]
METHODS = ["generate", "update_weights", "sleep", "wake_up", "close"]


@pytest.mark.parametrize("engine_class", ENGINES, ids=lambda c: c.__name__)
def test_every_engine_class_implements_the_contract(engine_class):
    """Each of the contract's methods, with the contract's parameters (an engine may add optional ones), and the
    adapter version it serves."""
    assert hasattr(engine_class, "adapter_version"), engine_class
    for name in METHODS:
        ours = inspect.signature(getattr(RolloutEngine, name)).parameters
        named = [n for n, p in ours.items() if p.kind is p.POSITIONAL_OR_KEYWORD]  # `**params`: any keywords
        theirs = inspect.signature(getattr(engine_class, name)).parameters
        required = [n for n, p in theirs.items() if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
        assert list(theirs)[: len(named)] == named, (engine_class.__name__, name, list(theirs))
        assert required == named[: len(required)] and len(required) <= len(named), (engine_class.__name__, name)


def test_engines_built_here_are_instances_of_the_contract(engine, tiny_model_dir):
    """The shared vLLM engine, an HF engine on the tiny model and the stand-in, checked at run time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    hf = HFEngine(model, AutoTokenizer.from_pretrained(tiny_model_dir))
    for built in (engine, hf, NullEngine()):
        assert isinstance(built, RolloutEngine), type(built)
        assert built.adapter_version == 0


def test_the_vllm_engine_takes_full_weights_through_the_update_and_counts_their_bytes(engine, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    moved = engine.update_weights(WeightUpdate(1, tensors=iter(state.items())))
    assert moved == sum(t.numel() * t.element_size() for t in state.values())


def test_an_update_is_either_full_weights_or_an_adapter():
    adapter = AdapterWeights({"a": torch.zeros(1)}, {}, 1)
    with pytest.raises(ValueError, match="either tensors"):
        WeightUpdate(1, tensors=[], adapter=adapter)
    with pytest.raises(ValueError, match="either tensors"):
        WeightUpdate(1)
    assert NullEngine().update_weights(WeightUpdate(1, adapter=adapter)) == 0


def engine_probes(path) -> list[str]:
    """`hasattr(engine, ...)` / `getattr(engine, ...)` in a module's source: a branch on which engine it holds."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr"):
            target = node.args[0] if node.args else None
            text = ast.unparse(target) if target is not None else ""
            if "engine" in text:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_asks_an_engine_what_it_is(tmp_path):
    branching = tmp_path / "branching.py"
    branching.write_text('if hasattr(engine, "sync_adapter"):\n    getattr(self.engine, "versioned", False)\n')
    assert len(engine_probes(branching)) == 2  # the check sees a branch on the engine
    modules = [ROOT / "lit_ppo" / p for p in ("training/module.py", "rollout/datamodule.py", "rollout/episodes.py")]
    assert [f for path in modules for f in engine_probes(path)] == []
