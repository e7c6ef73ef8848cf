"""`mode=eval` (lit_ppo/run/evaluate.py): a model evaluated on the held-out prompts with the run's reward and sampling,
no training; the same evaluation as a training run's (its last row reproduced), refusals in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lit_ppo.errors import ConfigError
from lit_ppo.run import entry
from tests.helpers import FIXTURE_MODEL, compose_run_config, read_csv

SETTINGS = [
    *FIXTURE_MODEL,
    "model.warm_start.enabled=false",
    "strategy.precision=32-true",  # exact comparisons: float32 whatever `auto` picks on this machine
]
ARITHMETIC = ["data.n_train=64", "data.n_eval=8"]


def files_of(directory: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in directory.rglob("*") if p.is_file()}


def eval_config(tmp_path: Path, output_dir: Path, *overrides: str):
    data = [] if "data=file" in overrides else ARITHMETIC
    return compose_run_config(
        "mode=eval", *SETTINGS, *data, f"cache_dir={tmp_path / 'cache'}", f"output_dir={output_dir}", *overrides
    )


def final_evaluation(summary: dict) -> dict:
    """The run's last evaluation as summary.json has it, with metrics.csv's keys."""
    return {f"eval/{k[len('eval_final/') :]}": v for k, v in summary.items() if k.startswith("eval_final/")}


def test_eval_of_another_model_writes_eval_json_and_the_table(tiny_model_dir, tmp_path, capsys):
    """Any model path (here with the HF engine: no vLLM start), into a directory of its own; nothing a training run
    writes."""
    out = tmp_path / "eval"
    record = entry.run(eval_config(tmp_path, out, f"model.path={tiny_model_dir}", "rollout.engine=hf"), out)
    written = json.loads((out / "eval.json").read_text())
    assert written == record
    assert written["model"] == f"model.path={tiny_model_dir}" and written["checkpoint"] is None
    assert written["seed"] == 0 and written["eval_prompts"] == 8 and written["samples_per_prompt"] == 4
    assert set(written["metrics"]) == {"eval/reward", "eval/response_length", "eval/pass@4"}
    assert 0.0 <= written["metrics"]["eval/reward"] <= 1.0 and len(written["samples"]) == 8
    assert sorted(p.name for p in out.iterdir()) == ["eval.json", "eval_data"]  # no config.yaml, metrics.csv, actor/
    console = capsys.readouterr().out
    assert "Evaluation (mode=eval)" in console and "Hugging Face generate" in console
    assert "Step plan" not in console  # the training run's plan is not what this run does
    assert "reward  prompt  response" in console and "evaluation finished: eval/reward" in console


def another_tiny_model(directory: Path) -> Path:
    """The tiny model of the shared engine's shape with other weights: what the engine holds before an evaluation must
    not be what it evaluates. (A random tiny model's greedy response repeats the prompt's last token, "=": this one's
    embedding of "7" is ten times that of "=", so it answers "77777777".)"""
    import torch

    from lit_ppo.demo.tiny import build_char_tokenizer, build_tiny_model, save_model_dir

    tokenizer = build_char_tokenizer()
    shape = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    model = build_tiny_model(tokenizer, max_position_embeddings=128, seed=0, **shape)
    embedding = model.get_input_embeddings().weight  # tied: the LM head's too
    with torch.no_grad():
        embedding[tokenizer.convert_tokens_to_ids("7")] = 10 * embedding[tokenizer.convert_tokens_to_ids("=")]
    return save_model_dir(model, tokenizer, directory)


@pytest.mark.slow
def test_eval_of_a_trained_run_reproduces_its_evaluations(engine, tmp_path):
    """A two-step run, then mode=eval with the same seed and the same engine: of its actor/ and of its final
    checkpoint (resume=auto in the run's own directory, which keeps every file of the run as it was) the run's last
    evaluation, metrics and greedy samples exactly; of the initial model its rollout_step 0 row. Before each, the
    engine holds another model's weights: each evaluation pushes its own."""
    run_dir = tmp_path / "run"
    train = compose_run_config(
        *SETTINGS,
        *ARITHMETIC,
        "trainer.total_rollout_steps=2",
        "trainer.eval_every=0",
        "trainer.checkpoint_every=1",
        f"cache_dir={tmp_path / 'cache'}",
        f"output_dir={run_dir}",
    )
    summary = entry.run(train, run_dir, engine=engine)
    rows = read_csv(run_dir / "metrics.csv")
    last = final_evaluation(summary)
    assert rows[-1]["rollout_step"] == "2" and float(rows[-1]["eval/reward"]) == pytest.approx(last["eval/reward"])
    run_files = files_of(run_dir)
    other_model = another_tiny_model(tmp_path / "other_model")

    def evaluate_other_model() -> None:
        out = tmp_path / "other"
        other = entry.run(eval_config(tmp_path, out, f"model.path={other_model}"), out, engine=engine)
        assert other["model"] == f"model.path={other_model}"
        assert other["samples"] != summary["eval_samples_final"]  # another model: other responses

    evaluate_other_model()
    out = tmp_path / "actor"
    actor = entry.run(eval_config(tmp_path, out, f"model.path={run_dir / 'actor'}"), out, engine=engine)
    assert actor["metrics"] == last and actor["samples"] == summary["eval_samples_final"]

    evaluate_other_model()
    checkpoint = entry.run(eval_config(tmp_path, run_dir, "resume=auto"), run_dir, engine=engine)
    assert checkpoint["metrics"] == last and checkpoint["samples"] == summary["eval_samples_final"]
    assert checkpoint["rollout_step"] == 2 and checkpoint["checkpoint"].endswith("rollout_step_000002.ckpt")
    assert {p: t for p, t in files_of(run_dir).items() if p in run_files} == run_files  # none rewritten

    evaluate_other_model()
    initial = entry.run(eval_config(tmp_path, tmp_path / "initial"), tmp_path / "initial", engine=engine)
    first = {k: float(v) for k, v in rows[0].items() if k.startswith("eval/") and v != ""}
    assert initial["metrics"] == pytest.approx(first, rel=1e-6)  # metrics.csv's digits


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.n_eval=0"], "mode=eval: no evaluation prompts (data.n_eval=0); fix: data.n_eval="),
        (
            ["data=file", "data.path={train}", "data.eval_path=null"],
            "mode=eval: no evaluation prompts (data.eval_path is not set); fix: data.eval_path=",
        ),
        (
            ["data=file", "data.path={train}", "data.eval_path={missing}"],
            "does not exist; fix: point data.eval_path",
        ),
        (["resume=auto"], "mode=eval resume=auto: no checkpoint in"),
        (  # data.expected_prompts stands for a training file in mode=plan only (a traceback here before)
            ["data=file", "data.path={missing}", "data.eval_path={train}", "data.expected_prompts=64"],
            "missing.jsonl does not exist; fix: point data.path at your prompt file",
        ),
        (["model.path={empty}"], "is a directory without config.json"),
        (["model.path={run}"], "is a run's directory, not a model; fix: model.path="),
        (["model.path={adapter}"], "is a LoRA adapter (adapter_config.json), not a whole model; fix:"),
    ],
)
def test_eval_refusals_are_one_line_before_any_model_loads(overrides, message, arithmetic_files, tmp_path, monkeypatch):
    from lit_ppo.run import evaluate

    evaluated = []  # the evaluation itself is never reached
    monkeypatch.setattr(evaluate, "evaluate", lambda *args, **kwargs: evaluated.append(args))
    train_file, _ = arithmetic_files
    (tmp_path / "empty").mkdir()
    (tmp_path / "run" / "actor").mkdir(parents=True)
    (tmp_path / "run" / "actor" / "config.json").write_text("{}")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    names = dict(
        train=train_file,
        missing=tmp_path / "missing.jsonl",
        empty=tmp_path / "empty",
        run=tmp_path / "run",
        adapter=tmp_path / "adapter",
    )
    out = tmp_path / "out"
    config = eval_config(tmp_path, out, *(o.format(**names) for o in overrides))
    with pytest.raises(ConfigError) as error:
        entry.run(config, out)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not (out / "eval.json").exists() and evaluated == []


def test_eval_of_a_distillation_config_never_reads_or_loads_the_teacher(tiny_model_dir, tmp_path, monkeypatch):
    """`mode=eval` with ppo=distill evaluates the student alone: the teacher (here a directory that is no model, which
    a training run's pre-flight refuses) is neither checked nor in the plan the module is built from (no teacher to
    load: `load_teacher` returns None for it)."""
    from lit_ppo.run import evaluate

    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text("{}")  # no tokenizer: the teacher's pre-flight would refuse it
    built = []

    class Built(Exception):
        pass

    def build_run(config, plan, **kwargs):
        built.append(plan)
        raise Built  # the evaluation itself is not this test's

    monkeypatch.setattr(evaluate, "build_run", build_run)
    out = tmp_path / "eval"
    overrides = ("ppo=distill", f"model.teacher.path={teacher}", f"model.path={tiny_model_dir}", "rollout.engine=hf")
    config = eval_config(tmp_path, out, *overrides)
    with pytest.raises(Built):
        entry.run(config, out)
    assert len(built) == 1 and built[0].teacher is None
    training = compose_run_config(*SETTINGS, *ARITHMETIC, *overrides)
    with pytest.raises(ConfigError, match="its tokenizer cannot be loaded"):
        entry.run(training, tmp_path / "train")
