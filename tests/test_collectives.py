"""Collectives run on the trained models' device. An NCCL process group has no CPU backend, so a CPU tensor
given to a collective on GPUs fails ("No backend type associated with device type cpu"); the gloo group of the
CPU tests accepts anything and cannot show it. Here two CPU processes run the rank code under a device-strict
check: every tensor given to a collective must be on the models' device (CPU here), and tensors made without
an explicit device land on the `meta` device (torch.set_default_device), as they land on the CPU beside a GPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import ROOT
from tests.helpers.ranks import start_ranks

COLLECTIVES = ["all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "reduce"]


def strict_collectives(device: torch.device) -> list[str]:
    """Wrap torch.distributed's collectives: a tensor off `device` fails as NCCL fails a CPU tensor. Returns the
    list the wrappers append each call's name to."""
    calls: list[str] = []
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def strict(*args, _name=name, _original=original, **kwargs):
            tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
            for tensor in tensors:
                if tensor.device != device:
                    raise RuntimeError(f"{_name}: No backend type associated with device type {tensor.device.type}")
            calls.append(_name)
            return _original(*args, **kwargs)

        setattr(dist, name, strict)
    return calls


def _rank(rank: int, world: int, model_dir: str, eval_path: str, out: str) -> None:
    sys.path.insert(0, str(ROOT))
    # A file rendezvous: no port to race other tests for.
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=world)
    from transformers import AutoTokenizer

    from lit_ppo.config import PPOConfig, RolloutConfig
    from lit_ppo.rewards import RewardScorer
    from lit_ppo.rollout.datamodule import RolloutDataModule
    from lit_ppo.rollout.prompts import load_prompts
    from lit_ppo.topology import RankTopology
    from tests.helpers import LastTokenEngine, plan_of

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = load_prompts(eval_path, tokenizer)
    plan = plan_of(
        len(prompts),
        ppo=PPOConfig(rollout_batch_size=4, n_samples_per_prompt=2, train_batch_size=8, micro_train_batch_size=4),
        dp=world,
        rollout=RolloutConfig(max_response_tokens=4),
    )
    # Reward 1 for the response "1": each prompt's second pass@2 sample solves it, no greedy response does.
    scorer = RewardScorer(fn=lambda prompts, responses, references, extras: [float(r == "1") for r in responses])
    datamodule = RolloutDataModule(
        plan=plan,
        train_prompts=prompts,
        eval_prompts=prompts,
        rollout=RolloutConfig(max_response_tokens=4, eval_samples_per_prompt=2),
        scorer=scorer,
        tokenizer=tokenizer,
        model_dir=model_dir,
        seed=0,
        topology=RankTopology(rank=rank, world_size=world),
        engine=LastTokenEngine(),
    )
    calls = strict_collectives(torch.device("cpu"))
    torch.set_default_device("meta")
    try:
        result = datamodule.evaluate()
        error = None
    except Exception as e:  # reported to the test, which runs in the parent
        result, error = {}, f"{type(e).__name__}: {e}"
    finally:
        torch.set_default_device(None)
    result.pop("eval/samples", None)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"result": result, "error": error, "calls": calls}))
    dist.destroy_process_group()


def test_evaluation_reduces_on_the_models_device(tiny_model_dir, tmp_path):
    eval_path = tmp_path / "eval.jsonl"
    eval_path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(6)))
    start_ranks(_rank, 2, 2, tiny_model_dir, str(eval_path), str(tmp_path))
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["error"] is None, report["error"]
        assert report["calls"] == ["all_reduce"]
        # Global figures on every rank: 6 prompts, greedy responses "0" (1 token, reward 0), pass@2 = 1.
        assert report["result"] == pytest.approx({"eval/reward": 0.0, "eval/response_length": 1.0, "eval/pass@2": 1.0})
