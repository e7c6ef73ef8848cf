"""The engine contract (lit_ppo/contract.py): every rollout engine implements `RolloutEngine`, and the trainer hands
each the same typed `WeightUpdate` without asking which engine it holds."""

from __future__ import annotations

import ast
import inspect
import itertools
import textwrap

import pytest
import torch

from lit_ppo.contract import (
    AdapterWeights,
    AheadOfTimePool,
    GenerateRequest,
    RolloutEngine,
    WeightUpdate,
    WorkerWeightTransfer,
)
from lit_ppo.rollout.context_group import FollowerEngine
from lit_ppo.rollout.engine import VLLMEngine
from lit_ppo.rollout.episodes import EpisodeRequest
from lit_ppo.rollout.hf_engine import HFEngine
from lit_ppo.rollout.workers.client import RolloutWorkers
from lit_ppo.rollout.workers.ranks import DataParallelWorkers
from lit_ppo.rollout.workers.servers import ServerWorkers
from lit_ppo.testing import NullEngine
from tests.helpers import ROOT

IMPLEMENTATIONS = {
    RolloutEngine: [
        VLLMEngine,
        HFEngine,
        RolloutWorkers,
        DataParallelWorkers,
        ServerWorkers,
        NullEngine,
        FollowerEngine,
    ],
    AheadOfTimePool: [RolloutWorkers, DataParallelWorkers, ServerWorkers],
    WorkerWeightTransfer: [VLLMEngine, HFEngine],
}
CASES = [(protocol, cls) for protocol, classes in IMPLEMENTATIONS.items() for cls in classes]


def instance_attributes(cls) -> set[str]:
    """Names a class's methods assign on `self` (`self.x = ...`, `self.x: T = ...`), its bases' included."""
    names = set()
    for klass in cls.__mro__[:-1]:
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(klass)))):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        names.add(t.attr)
    return names


def nonconformance(protocol, cls) -> list[str]:
    """Where `cls` differs from `protocol`: a member missing; a method whose parameters are not the Protocol's (the
    same names, kinds and required ones, in order; more only if optional); a property that is a method."""
    wrong = []
    members = {
        n: m for n, m in vars(protocol).items() if not n.startswith("_") and (callable(m) or isinstance(m, property))
    }
    for name, member in members.items():
        theirs = inspect.getattr_static(cls, name, None)
        if isinstance(member, property):
            if theirs is None and name not in instance_attributes(cls):
                wrong.append(f"{name}: missing")
            elif callable(theirs) and not isinstance(theirs, property):
                wrong.append(f"{name}: a method where the Protocol has an attribute")
            continue
        if not callable(theirs):
            wrong.append(f"{name}: missing")
            continue
        ours = list(inspect.signature(member).parameters.values())
        their = list(inspect.signature(theirs).parameters.values())
        for o, t in itertools.zip_longest(ours, their):
            if t is None:
                wrong.append(f"{name}: lacks parameter {o.name}")
            elif o is None:
                if t.default is t.empty and t.kind not in (t.VAR_POSITIONAL, t.VAR_KEYWORD):
                    wrong.append(f"{name}: requires {t.name}, which the Protocol does not pass")
            elif (o.name, o.kind, o.default is o.empty) != (t.name, t.kind, t.default is t.empty):
                wrong.append(f"{name}: parameter {t.name} ({t.kind.description}) where the Protocol has {o.name}")
    return wrong


@pytest.mark.parametrize("protocol, cls", CASES, ids=lambda c: c.__name__)
def test_every_implementation_has_its_protocols_signatures(protocol, cls):
    assert nonconformance(protocol, cls) == []


def test_the_conformance_check_sees_a_wrong_signature_and_a_missing_member():
    class Wrong:
        adapter_version = 0

        def generate(self, prompt_token_ids, **params): ...

        def update_weights(self, update, extra) -> int: ...

        def sleep(self): ...

        def wake_up(self): ...

    assert nonconformance(RolloutEngine, Wrong) == [
        "generate: parameter prompt_token_ids (positional or keyword) where the Protocol has request",
        "update_weights: requires extra, which the Protocol does not pass",
        "close: missing",
    ]


def classes_defining(method: str) -> set[str]:
    """Every class of lit_ppo/ that defines `method`."""
    found = set()
    for path in (ROOT / "lit_ppo").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(f, ast.FunctionDef) and f.name == method for f in node.body
            ):
                found.add(node.name)
    return found


@pytest.mark.parametrize(
    "protocol, method",
    [(RolloutEngine, "wake_up"), (AheadOfTimePool, "submit"), (WorkerWeightTransfer, "open_weight_transfer")],
    ids=lambda x: getattr(x, "__name__", x),
)
def test_every_class_with_a_protocols_method_is_among_its_implementations(protocol, method):
    """A new engine, pool or worker engine joins the conformance test above (ServerWorkers once was missing)."""
    assert classes_defining(method) - {"Protocol", protocol.__name__} == {c.__name__ for c in IMPLEMENTATIONS[protocol]}


def test_a_request_shares_its_prompts_and_wants_one_seed_per_prompt():
    """A worker's contiguous share of a request: its prompts' ids, seeds and token limits (one limit for all stays)."""
    request = GenerateRequest([[1], [2], [3]], n=2, temperature=1.0, top_p=1.0, max_tokens=[4, 5, 6], seeds=[7, 8, 9])
    share = request.share(1, 3)
    assert (share.prompt_token_ids, share.max_tokens, share.seeds, share.n) == ([[2], [3]], [5, 6], [8, 9], 2)
    assert GenerateRequest([[1], [2]], n=1, temperature=0.0, top_p=1.0, max_tokens=3).share(1, 2).limits == [3]
    episodes = EpisodeRequest(["a", "b", "c"], [4, 5, 6], 2, 1.0, 1.0, "eval", "evaluation").share(0, 1)
    assert (episodes.prompts, episodes.positions, episodes.prompt_count) == (["a"], [4], 1)
    with pytest.raises(ValueError, match="2 seeds for 3 prompts; give one seed per prompt"):
        GenerateRequest([[1], [2], [3]], n=1, temperature=1.0, top_p=1.0, max_tokens=1, seeds=[1, 2])


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
