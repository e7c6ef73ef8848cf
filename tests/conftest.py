"""Shared fixtures: one tiny model and one vLLM engine per test process (vLLM is heavy to start)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture
def no_training(monkeypatch):
    """Replace lit_ppo.run.train so that a test can never start a real run; records the calls instead (a check that
    lets a config through reaches it)."""
    import types

    calls = []
    fake = types.ModuleType("lit_ppo.run.train")
    fake.train = lambda cfg, output_dir, **kwargs: calls.append(output_dir) or {"fake": True}
    monkeypatch.setitem(sys.modules, "lit_ppo.run.train", fake)
    return calls


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from tests.helpers import save_fixture_model

    return save_fixture_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def engine(tiny_model_dir):
    from lit_ppo.rollout.engine import VLLMEngine

    return VLLMEngine(tiny_model_dir, max_model_len=128, seed=0)


@pytest.fixture(scope="session")
def arithmetic_files(tmp_path_factory):
    from lit_ppo.demo.arithmetic import make_problems, write_jsonl

    train, evaluation = make_problems(seed=0, max_operand=20, n_train=64, n_eval=16)
    root = tmp_path_factory.mktemp("data")
    return write_jsonl(train, root / "train.jsonl"), write_jsonl(evaluation, root / "eval.jsonl")


@pytest.fixture(scope="module")
def long_prompt_files(tmp_path_factory):
    """Arithmetic questions padded with a preamble to about PROMPT_TOKENS characters (= tokens: a character
    tokenizer), so prefill spans realistic lengths: 16 training prompts, 4 held out."""
    from tests.helpers.prompts import PROMPT_TOKENS

    root = tmp_path_factory.mktemp("long_prompts")
    preamble = "You are a careful calculator. Read the question, add the two numbers and write only the sum. "
    paths = []
    for name, count in (("train", 16), ("eval", 4)):
        records = []
        for i in range(count):
            a, b = (7 * i + 3) % 50, (11 * i + 5) % 50
            question = f"Question {i}: {a}+{b}="
            records.append({"prompt": (preamble * 2)[: PROMPT_TOKENS - len(question)] + question, "answer": str(a + b)})
        path = root / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        paths.append(path)
    return paths


@pytest.fixture
def sigint_handled():
    """SIGINT handled by other than Python's default handler, as during a run (lit_ppo.signals, lit_ppo.preemption):
    a KeyboardInterrupt is then raised by code, never by a Ctrl-C (`signals.raised_by_code`)."""
    previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
    yield
    signal.signal(signal.SIGINT, previous)
