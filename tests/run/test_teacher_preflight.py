"""The pre-flight of on-policy distillation's teacher (lit_ppo/run/teacher_preflight.py), before any model loads: a
teacher with fewer embedding rows than the student refused, a LoRA run's adapter named with its merged model, and the
packing and shared-prefix layout chosen for the teacher's model too (null: off where it cannot; true: refused)."""

from __future__ import annotations

import json

import pytest

from lit_ppo.demo.tiny import build_char_tokenizer
from lit_ppo.errors import ConfigError
from lit_ppo.run.entry import compose_run_config
from lit_ppo.run.prepare import preflight
from lit_ppo.run.teacher_preflight import check_teacher_files


@pytest.fixture
def no_model(monkeypatch):
    """Any model load fails the test: these checks run before one."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the teacher was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def teacher_files(tmp_path, **config) -> str:
    """A teacher directory: the tiny model's tokenizer (the student's) and a config.json of `config`."""
    directory = tmp_path / "teacher"
    build_char_tokenizer().save_pretrained(directory)
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2", **config}))
    return str(directory)


def distill_preflight(tmp_path, teacher: str, *overrides: str):
    config = compose_run_config(
        "ppo=distill", f"model.teacher.path={teacher}", "model.warm_start.enabled=false", *overrides
    )
    return preflight(config, tmp_path / "run").config


def test_a_teacher_with_fewer_embedding_rows_than_the_student_is_refused(tmp_path, no_model):
    """The tiny student has 128 embedding rows for its 101 tokens (a padded vocabulary, as Qwen2.5's 152064 for
    151665): a teacher of the same tokenizer with 101 rows would have no log-prob for a sampled id beyond them."""
    assert len(build_char_tokenizer()) == 101
    with pytest.raises(ConfigError) as error:
        distill_preflight(tmp_path, teacher_files(tmp_path, vocab_size=101))
    message = str(error.value)
    assert "its embedding has 101 rows (config.json vocab_size), fewer than the student's 128" in message
    assert "\n" not in message
    distill_preflight(tmp_path, teacher_files(tmp_path, vocab_size=128))  # as many rows: the student's ids fit


@pytest.mark.parametrize(
    "layout, fix",
    [
        (lambda root: root / "actor", "model.teacher.path={root}/actor_merged (the run's merged model"),
        (
            lambda root: root,
            "a LoRA run's directory (its actor/ is an adapter); fix: model.teacher.path={root}/actor_merged",
        ),
    ],
    ids=["its-actor", "the-run"],
)
def test_a_lora_runs_teacher_names_its_merged_model(tmp_path, layout, fix):
    root = tmp_path / "lora_run"
    (root / "actor").mkdir(parents=True)
    (root / "actor" / "adapter_config.json").write_text("{}")
    with pytest.raises(ConfigError) as error:
        check_teacher_files(str(layout(root)), build_char_tokenizer(), "the tiny model", training=True)
    assert fix.format(root=root) in str(error.value) and "\n" not in str(error.value)


def test_the_layout_is_chosen_for_the_teacher_too_before_any_model_loads(tmp_path, no_model, capsys):
    """The student (Qwen2) packs and shares prefixes; a teacher whose model cannot pack (a Mamba config.json) turns
    null packing off with a line, and ppo.packing=true is refused naming the teacher; a teacher with sliding-window
    layers turns the null shared prefix off (packing stays on)."""
    student = preflight(compose_run_config("ppo=grpo", "model.warm_start.enabled=false")).config.ppo
    assert student.packing is True and student.shared_prefix is None  # null: on where exact (the plan's)
    cannot_pack = teacher_files(tmp_path, model_type="mamba")
    ppo = distill_preflight(tmp_path, cannot_pack).ppo
    assert ppo.packing is False
    assert "packing: off, the teacher's transformers' mamba models" in capsys.readouterr().out
    with pytest.raises(ConfigError) as error:
        distill_preflight(tmp_path, cannot_pack, "ppo.packing=true")
    assert f"model.teacher.path={cannot_pack} with ppo.packing=true: transformers' mamba" in str(error.value)
    windowed = teacher_files(tmp_path, use_sliding_window=True, sliding_window=16, max_window_layers=0)
    ppo = distill_preflight(tmp_path, windowed).ppo
    assert ppo.packing is True and ppo.shared_prefix is False
    assert "shared prefix: off, the teacher's the qwen2 model has sliding-window layers" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"with ppo\.shared_prefix=true: the qwen2 model has sliding-window"):
        distill_preflight(tmp_path, windowed, "ppo.shared_prefix=true")
    ppo = distill_preflight(tmp_path, teacher_files(tmp_path)).ppo  # a teacher like the student: both on
    assert ppo.packing is True and ppo.shared_prefix is None
