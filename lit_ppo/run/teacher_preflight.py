"""The pre-flight of on-policy distillation's teacher (`model.teacher`), before any model loads: an in-process teacher's
directory, embedding rows and tokenizer against the student's (`check_teacher_files`), a server teacher's answers
(`training.teacher_server.check_teacher_server`), and the micro-batch layout (packing, shared prefix) that the teacher's
model takes too (`teacher_layout`). `mode=eval` never reads the teacher (it evaluates the student alone)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from lit_ppo.config import RunConfig, check_teacher_tokenizer
from lit_ppo.console import show
from lit_ppo.errors import ConfigError, first_line


def check_teacher(
    config: RunConfig, student_tokenizer, student_config, training: bool, longest_sequence: int | None
) -> None:
    """The teacher's checks (none in mode=eval, none without a teacher): a server's where the run trains (mode=plan
    contacts no server), else the teacher's files (`check_teacher_files`). `student_config`: the student's
    transformers config or config.json's directory (None: not on this machine); `longest_sequence`: the longest prompt
    plus the response budget, in tokens (None: unknown)."""
    teacher = config.model.teacher
    if teacher is None or config.mode == "eval" or student_tokenizer is None:
        return
    student_name = config.model.path or "the tiny model"
    if teacher.on_server:
        if training:
            from lit_ppo.training.teacher_server import check_teacher_server

            check_teacher_server(teacher.url, student_tokenizer, student_name, longest_sequence)
        return
    student_rows = getattr(model_config_of(student_config), "vocab_size", None) if student_config else None
    check_teacher_files(teacher.path, student_tokenizer, student_name, training, student_rows)


def model_config_of(architecture) -> SimpleNamespace | object:
    """A transformers config as it is, or a directory's config.json read as attributes (no transformers import)."""
    if hasattr(architecture, "model_type"):
        return architecture
    return SimpleNamespace(**json.loads((Path(architecture) / "config.json").read_text()))


def check_teacher_files(
    teacher_path: str, student_tokenizer, student_name: str, training: bool, student_rows: int | None = None
) -> None:
    """An in-process teacher: its directory (a run's directory or a LoRA adapter named with the fix), its embedding
    rows (config.json's vocab_size) no fewer than the student's (a sampled id beyond them would fail the teacher's
    forward), and its tokenizer against the student's (`config.check_teacher_tokenizer`), read from the files. A run
    needs the teacher's files; `mode=plan` checks them where they are on this machine."""
    path = Path(teacher_path).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        raise ConfigError(f"model.teacher.path={teacher_path} is {not_a_model(path)}")
    if not path.is_dir() and not training:
        return
    config_file = path / "config.json"
    if student_rows and config_file.is_file():
        rows = json.loads(config_file.read_text()).get("vocab_size")
        if rows is not None and rows < student_rows:
            raise ConfigError(
                f"model.teacher.path={teacher_path}: its embedding has {rows} rows (config.json vocab_size), fewer "
                f"than the student's {student_rows}: a sampled id beyond them has no teacher log-prob; fix: a teacher "
                "with at least the student's vocab_size (the same model family)"
            )
    from transformers import AutoTokenizer

    try:
        teacher_tokenizer = AutoTokenizer.from_pretrained(teacher_path)
    except Exception as e:
        raise ConfigError(
            f"model.teacher.path={teacher_path}: its tokenizer cannot be loaded ({type(e).__name__}: "
            f"{first_line(e, type(e).__name__)}); fix: "
            "point model.teacher.path at a model directory with its tokenizer (or a hub name)"
        ) from None
    check_teacher_tokenizer(student_tokenizer, teacher_tokenizer, student_name, teacher_path)


def not_a_model(path: Path) -> str:
    """What a directory without config.json is, and the fix: a LoRA run's adapter, a run's directory, or neither."""
    if (path / "adapter_config.json").is_file():  # a LoRA run's actor/
        return (
            f"a LoRA adapter (adapter_config.json), not a whole model; fix: model.teacher.path="
            f"{path.parent / 'actor_merged'} (the run's merged model, written with model.lora.save_merged=true)"
        )
    if (path / "actor" / "adapter_config.json").is_file():
        return (
            f"a LoRA run's directory (its actor/ is an adapter); fix: model.teacher.path={path / 'actor_merged'} (the "
            "run's merged model, written with model.lora.save_merged=true)"
        )
    if (path / "actor").is_dir():
        return f"a directory without config.json; fix: model.teacher.path={path / 'actor'} (the run's final policy)"
    return "a directory without config.json; fix: a saved Hugging Face model (save_pretrained)"


def teacher_layout(config: RunConfig, packing: bool | None, shared_prefix: bool | None) -> tuple:
    """(packing, shared_prefix) as resolved for the student, for an in-process teacher whose config.json is here also
    for the teacher's model: null becomes off (with a line saying why) where its model cannot take the layout, true
    is refused in one line naming the teacher. A teacher elsewhere (a hub name) is checked where it loads."""
    teacher = config.model.teacher
    if teacher is None or teacher.on_server or config.mode == "eval" or not teacher.path:
        return packing, shared_prefix
    directory = Path(teacher.path).expanduser()
    if not (directory / "config.json").is_file():
        return packing, shared_prefix
    from lit_ppo.training.packing import packing_unsupported, shared_prefix_unsupported

    model_config = model_config_of(directory)
    attention = config.model.attn_implementation or "sdpa"
    if not getattr(model_config, "model_type", None):  # checked where it loads
        return packing, shared_prefix
    if packing is not False and (reason := packing_unsupported(model_config.model_type)):
        if config.ppo.packing:
            raise ConfigError(
                f"model.teacher.path={teacher.path} with ppo.packing=true: {reason}; fix: ppo.packing=false"
            )
        show(f"packing: off, the teacher's {reason} (ppo.packing=null); micro-batches are padded")
        return False, shared_prefix
    if packing and shared_prefix is not False and (reason := shared_prefix_unsupported(model_config, attention)):
        if config.ppo.shared_prefix:
            raise ConfigError(
                f"model.teacher.path={teacher.path} with ppo.shared_prefix=true: {reason}; fix: ppo.shared_prefix=false"
            )
        show(f"shared prefix: off, the teacher's {reason} (ppo.shared_prefix=null); every sample's prompt is laid out")
        return packing, False
    return packing, shared_prefix
