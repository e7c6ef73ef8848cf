"""Proof by random kills (issue 36 item 6): a run SIGKILLed at seeded random points (the trainer, or a rollout worker)
and resumed each time with resume=auto ends with the uninterrupted run's weights, bit for bit, and trains every
prompt of the plan exactly once, each in the same rollout step. The harness is bench/random_kills.py (also a script:
`python bench/random_kills.py --case colocated --kills 3 --seed 0`)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.resume import random_kills


def prove(case: str, kills: int, seed: int, tmp_path) -> None:
    result = random_kills.run_case(case, kills, seed, tmp_path)
    print(result.report())
    assert any(k.done for k in result.kills), f"no kill landed before the run ended:\n{result.report()}"
    assert not result.findings, result.report()


@pytest.mark.slow  # three train.py runs (uninterrupted, killed, resumed): 134 s alone on 2 cores, over make test's budget
def test_a_colocated_run_killed_and_resumed_ends_as_the_uninterrupted_one(tmp_path):
    prove("colocated_short", kills=1, seed=0, tmp_path=tmp_path)
    # The checks can fail: a step's record lost and a weight changed by one ulp are each found.
    case, reference, killed = random_kills.CASES["colocated_short"], tmp_path / "uninterrupted", tmp_path / "killed"
    (killed / "trained_prompts" / "rollout_step=000001.rank0.pt").unlink()
    actor = killed / "actor" / "model.safetensors"
    tensors = load_file(actor)
    name = sorted(tensors)[0]
    tensors[name].view(-1)[0] = torch.nextafter(tensors[name].view(-1)[0], torch.tensor(float("inf")))
    save_file(tensors, actor)
    findings = random_kills.compare(reference, killed, case)
    assert "rollout steps recorded [1, 3], planned 1..3" in findings
    assert any(f.startswith("rollout step 2 trained other prompts than uninterrupted: missing [") for f in findings)
    assert any(f.startswith("1 of ") and f"actor/model.safetensors:{name}" in f for f in findings)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        "colocated",
        "disaggregated_k1",
        "disaggregated_k2",
        "disaggregated_k1_worker",
        "disaggregated_k2_worker",
        "lora",
        "dynamic_sampling",
        "dynamic_sampling_k1",
        "dynamic_sampling_k1_refill",
        "tool_episodes",
        "tool_episodes_disaggregated_k1_worker",
        "hf_disaggregated_k1",
        "server_k1",
    ],
)
def test_runs_killed_three_times_and_resumed_end_as_the_uninterrupted_ones(case, tmp_path):
    prove(case, kills=3, seed=0, tmp_path=tmp_path)
