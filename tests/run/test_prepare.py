"""lit_ppo/run/prepare.py: a run prepared once. The pre-flight reads the prompt files once and the plan is computed
once; the training run and the evaluation start from that (`PreparedRun`), reading and planning nothing again."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lit_ppo import plan as plan_module
from lit_ppo.rollout import prompts as prompts_module
from lit_ppo.run import entry
from tests.helpers import FIXTURE_MODEL, compose_run_config

SMALL_RUN = [
    *FIXTURE_MODEL,
    "model.warm_start.enabled=false",
    "trainer.total_rollout_steps=1",
    "trainer.eval_every=0",
    "ppo.rollout_batch_size=8",
    "ppo.train_batch_size=32",
    "ppo.micro_train_batch_size=32",
    "rollout.eval_samples_per_prompt=1",
]


def counted(monkeypatch, function) -> list[tuple]:
    """The arguments of every call of `function`, under whatever name a loaded lit_ppo module holds it."""
    calls = []

    def counting(*args, **kwargs):
        calls.append(args)
        return function(*args, **kwargs)

    for module in [m for name, m in sys.modules.items() if name.startswith("lit_ppo")]:
        for name, value in list(vars(module).items()):
            if value is function:
                monkeypatch.setattr(module, name, counting)
    return calls


@pytest.mark.parametrize("mode, data", [("train", "file"), ("eval", "file"), ("train", "arithmetic")])
def test_a_run_reads_its_prompt_files_and_computes_its_plan_once(
    mode, data, engine, arithmetic_files, tmp_path, monkeypatch
):
    """It read each prompt file twice (the pre-flight, then the training run or the evaluation), scanned its bytes
    once more (the pre-flight's UTF-8 check), and planned twice; under strategy=ddp every rank did so. Now once each:
    the arithmetic task's generated prompts are not read back from the files the run writes either."""
    import lit_ppo.run.evaluate
    import lit_ppo.run.train  # noqa: F401 (loaded: their names of the counted functions are counted too)

    train_file, eval_file = arithmetic_files
    files = ["data=file", f"data.path={train_file}", f"data.eval_path={eval_file}"]
    sizes = files if data == "file" else ["data.n_train=64", "data.n_eval=16"]
    config = compose_run_config(
        f"mode={mode}", *SMALL_RUN, *sizes, f"output_dir={tmp_path}", f"cache_dir={tmp_path / 'cache'}"
    )
    plans = counted(monkeypatch, plan_module.compute_plan)
    reads = counted(monkeypatch, prompts_module._read_records)
    scans = counted(monkeypatch, prompts_module.check_utf8)  # a pass over a file's bytes (its encoding)
    result = entry.run(config, tmp_path, engine=engine)
    assert [Path(path) for path, *_ in reads] == ([train_file, eval_file] if data == "file" else [])
    assert scans == []  # the read itself names a line that is not UTF-8
    assert len(plans) == 1
    if mode == "train":
        assert result["rollout_steps"] == 1
        assert json.loads((tmp_path / "plan.json").read_text())["counts"]["dataset_prompts"] == 64
    else:
        assert result["eval_prompts"] == 16


def test_the_arithmetic_prompts_of_a_run_are_those_its_written_files_hold(tmp_path):
    """A run's arithmetic prompts come from the generated records, not read back from the data/ files it writes:
    prompt for prompt (ids, text, reference, file:line) what reading those files gives, in the order written."""
    from lit_ppo.demo.tiny import build_char_tokenizer
    from lit_ppo.rollout.prompts import load_data_prompts
    from lit_ppo.run.prepare import PreparedRun, read_run_prompts
    from lit_ppo.run.train import write_generated_data

    config = compose_run_config("data.n_train=40", "data.n_eval=8", "data.chat_template=true")
    tokenizer = build_char_tokenizer()
    read = read_run_prompts(config.data, tokenizer, tmp_path, "data")
    assert not list((tmp_path / "data").glob("*"))  # nothing written by the pre-flight
    write_generated_data(PreparedRun(config, None, "", records=read.records), tmp_path, "data")
    for prompt_set, name in ((read.train, "train.jsonl"), (read.evaluation, "eval.jsonl")):
        from_file = load_data_prompts(tmp_path / "data" / name, tokenizer, config.data)
        assert prompt_set.prompts == from_file.prompts and prompt_set.source == from_file.source
    assert len(read.train) == 40 and read.lengths == [len(p.prompt_ids) for p in read.train.prompts]
