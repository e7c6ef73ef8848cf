"""The pre-flight checks (lit_ppo/run/preflight.py): every input a user can get wrong is refused before the plan and
before any model loads, in one line naming the key or file:line and the fix (exit 2 from train.py).

Through `lit_ppo.run.entry.main` in this process (`no_training` makes sure nothing would train), and through `train.py`
where the exit code and the single line are the point."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lit_ppo.errors import ConfigError, UserError
from lit_ppo.run import entry as run_module
from tests.helpers import ROOT, compose_config, compose_run_config
from tests.helpers.cli_runs import train_py

REPO = ROOT


@pytest.fixture
def import_path(monkeypatch):
    """sys.path restored after the test (the pre-flight puts the working directory on it)."""
    monkeypatch.setattr(sys, "path", list(sys.path))


def refused(tmp_path, *overrides, error=UserError) -> str:
    cfg = compose_config(f"output_dir={tmp_path / 'out'}", *overrides)
    with pytest.raises(error) as info:
        run_module.main(cfg)
    message = str(info.value)
    assert "\n" not in message, message
    assert not (tmp_path / "out" / "plan.json").exists()  # refused before the plan
    return message


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ------------------------------------------------------------------ lengths against max_model_len and the model


def test_response_longer_than_the_model_is_refused_not_cut(tmp_path):
    """The issue's run: max_response_tokens=200 on a 128-position model exited 0 with responses cut at 76."""
    line = one_error_line(train_py(tmp_path, "rollout.max_response_tokens=200", f"output_dir={tmp_path / 'out'}"))
    assert "rollout.max_response_tokens=200" in line and "rollout.max_model_len=128" in line and "fix:" in line
    assert not (tmp_path / "out" / "plan.json").exists()


def test_max_model_len_above_the_models_positions(tmp_path, tiny_model_dir, no_training):
    message = refused(tmp_path, "mode=train", f"model.path={tiny_model_dir}", "rollout.max_model_len=256")
    assert "rollout.max_model_len=256 exceeds the model's 128 positions" in message
    assert f"{tiny_model_dir}/config.json" in message and "fix: set rollout.max_model_len=128 or less" in message
    assert no_training == []
    # The tiny model's positions come from its config block, in mode=plan too.
    message = refused(tmp_path, "mode=plan", "model.tiny.max_position_embeddings=64", "rollout.max_model_len=128")
    assert "exceeds the model's 64 positions (max_position_embeddings in model.tiny)" in message


def test_prompts_longer_than_max_model_len_found_in_the_data(tmp_path, tiny_model_dir, no_training):
    """data=file's defaults (max_prompt_length 512) with max_model_len 128: found by vLLM minutes in before."""
    records = [{"prompt": "1+1=", "answer": "2"}] * 40 + [{"prompt": "1+" * 70 + "1=", "answer": "71"}]
    path = write_jsonl(tmp_path / "train.jsonl", records)
    overrides = ["data=file", f"data.path={path}", f"model.path={tiny_model_dir}", "model.warm_start.enabled=false"]
    for mode in ("plan", "train"):
        message = refused(tmp_path, f"mode={mode}", *overrides)
        assert (
            f"{path}:41: a prompt of 142 tokens + rollout.max_response_tokens=8 = 150 > rollout.max_model_len=128"
            in (message)
        )
        # no max_model_len would hold it on this model: the fix is the prompt's length, not a length above 128
        assert message.endswith(
            "= 150 > rollout.max_model_len=128, which the model's 128 positions cannot hold either; fix: "
            "data.max_prompt_length=120 (longer prompts then follow data.bad_records)"
        )
    assert no_training == []
    # Within the limit the same data plans.
    run_module.main(
        compose_config(
            f"output_dir={tmp_path / 'ok'}",
            "mode=plan",
            *overrides,
            "data.max_prompt_length=64",
            "data.bad_records=skip",
        )
    )
    assert (tmp_path / "ok" / "plan.json").exists()


def test_the_max_model_len_fix_never_names_a_length_above_the_models_positions():
    """check_lengths' fixes: a rollout.max_model_len within the model's positions where one would do, and else what
    would (a shorter prompt or response), saying the model cannot take it (issue 55 item 17)."""
    from lit_ppo.run.preflight import check_lengths

    def line(max_model_len, max_positions, response_tokens, longest_prompt) -> str:
        with pytest.raises(ConfigError) as info:
            check_lengths(
                max_model_len=max_model_len,
                max_positions=max_positions,
                positions_source="config.json",
                response_tokens=response_tokens,
                response_key="rollout.max_response_tokens",
                longest_prompt=longest_prompt,
            )
        return str(info.value)

    # within the positions: raise max_model_len to what the prompt needs
    assert line(128, 512, 8, (142, "train.jsonl:41")).endswith(
        "fix: set rollout.max_model_len=150 or more (at most 512, the model's positions), or data.max_prompt_length=120 "
        "(longer prompts then follow data.bad_records)"
    )
    # beyond them, with max_model_len below them: up to the positions with a shorter prompt, or shorter still
    assert line(128, 256, 100, (200, "train.jsonl:7")).endswith(
        "= 300 > rollout.max_model_len=128, which the model's 256 positions cannot hold either; fix: "
        "rollout.max_model_len=256 with data.max_prompt_length=156, or data.max_prompt_length=28 (longer prompts "
        "then follow data.bad_records), or lower rollout.max_response_tokens"
    )
    # at the positions already: no larger max_model_len is suggested
    assert line(128, 128, 8, (142, "train.jsonl:41")).endswith(
        "which the model's 128 positions cannot hold either; fix: data.max_prompt_length=120 (longer prompts then "
        "follow data.bad_records)"
    )
    assert line(128, 128, 200, None).endswith("fix: lower rollout.max_response_tokens")
    assert line(64, 128, 100, None).endswith(
        "fix: lower rollout.max_response_tokens or raise rollout.max_model_len (at most 128)"
    )
    assert line(64, None, 100, None).endswith("fix: lower rollout.max_response_tokens or raise rollout.max_model_len")


# ------------------------------------------------------------------ the model's files


def test_missing_model_directory_and_offline_hub_name(tmp_path, monkeypatch, no_training):
    message = refused(tmp_path, "mode=train", f"model.path={tmp_path / 'no-such-model'}")
    assert f"model.path={tmp_path / 'no-such-model'} does not exist on this machine; fix:" in message
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    message = refused(tmp_path, "mode=train", "model.path=lit-ppo-tests/no-such-model")
    assert "model.path=lit-ppo-tests/no-such-model is a hub name, not in the Hugging Face cache" in message
    assert "HF_HUB_OFFLINE=1" in message
    assert no_training == []


def model_without_pad_token(tiny_model_dir, tmp_path) -> Path:
    """The tiny model with the same tokenizer but no pad token, as many base models' tokenizers are."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": None}))
    return model


def test_a_tokenizer_without_a_pad_token_pads_with_eos_and_the_plan_says_so(tmp_path, tiny_model_dir, capsys):
    from transformers import AutoTokenizer

    model = model_without_pad_token(tiny_model_dir, tmp_path)
    assert AutoTokenizer.from_pretrained(model).pad_token is None
    run_module.main(compose_config("mode=plan", f"output_dir={tmp_path / 'out'}", f"model.path={model}"))
    assert f"tokenizer: {model} has no pad token; padding with its eos token '<|endoftext|>'" in capsys.readouterr().out


def test_a_run_with_a_tokenizer_without_a_pad_token_trains(tmp_path, tiny_model_dir, engine):
    """It crashed after vLLM started (the micro-batches are padded with the pad token's id)."""
    model = model_without_pad_token(tiny_model_dir, tmp_path)
    cfg = compose_run_config(
        f"model.path={model}",
        "trainer.total_rollout_steps=1",
        "trainer.eval_every=0",
        "data.n_train=64",
        "data.n_eval=8",
        f"output_dir={tmp_path / 'run'}",
        f"cache_dir={tmp_path / 'cache'}",
    )
    summary = run_module.run(cfg, tmp_path / "run", engine=engine)
    assert summary["rollout_steps"] == 1 and summary["optimizer_steps_actor"] == summary["expected_optimizer_steps"]


# ------------------------------------------------------------------ data files


def test_a_non_utf8_data_file_is_named_with_its_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9 1+2=", "answer": "3"}\n')
    line = one_error_line(
        train_py(tmp_path, "mode=plan", "data=file", f"data.path={path}", f"output_dir={tmp_path / 'out'}")
    )
    assert f"{path}:2: not UTF-8 (byte 0xe9 at column 16; data.path)" in line and "fix: re-encode" in line


def test_a_data_file_with_a_utf8_byte_order_mark_is_planned_and_read(tmp_path, no_training):
    """A BOM (Windows tools write one) was refused as malformed JSON, "fix: one JSON object per line"."""
    path = tmp_path / "train.jsonl"
    records = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(40)]
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in records).encode())
    for mode in ("plan", "train"):
        run_module.main(
            compose_config(f"mode={mode}", "data=file", f"data.path={path}", f"output_dir={tmp_path / mode}")
        )
    assert json.loads((tmp_path / "plan" / "plan.json").read_text())["counts"]["dataset_prompts"] == 40
    assert len(no_training) == 1


def test_a_gzip_file_named_jsonl_is_named_as_gzip_not_latin1(tmp_path):
    """It was "not UTF-8 (byte 0x8b at column 2) ... re-encode the file as UTF-8, e.g. `iconv -f latin1`"."""
    import gzip

    path = tmp_path / "train.jsonl"
    path.write_bytes(gzip.compress(b'{"prompt": "1+1=", "answer": "2"}\n' * 40))
    message = refused(tmp_path, "mode=plan", "data=file", f"data.path={path}")
    assert message.startswith(f"data.path={path}: the file is gzip-compressed (it starts with the gzip bytes 1f 8b)")
    assert f"fix: decompress it, e.g. `mv {path} {path}.gz && gunzip {path}.gz`" in message
    assert "latin" not in message


def test_the_plan_counts_the_prompts_the_run_trains_on(tmp_path, no_training):
    """48 records, one over data.max_prompt_length with data.bad_records=skip: the plan counted 48 records where the
    run trains on 47 prompts (the run's reader leaves the long one out); the plan reads them as the run does."""
    from lit_ppo.demo.tiny import build_char_tokenizer
    from lit_ppo.rollout.prompts import load_data_prompts

    records = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(47)]
    records.insert(20, {"prompt": "1+" * 20 + "1=", "answer": "21"})  # 42 tokens > 32
    path = write_jsonl(tmp_path / "train.jsonl", records)
    overrides = ["data=file", f"data.path={path}", "data.max_prompt_length=32", "data.bad_records=skip"]
    run_module.main(compose_config(f"output_dir={tmp_path / 'plan'}", "mode=plan", *overrides))
    planned = json.loads((tmp_path / "plan" / "plan.json").read_text())["counts"]["dataset_prompts"]
    trained = load_data_prompts(path, build_char_tokenizer(), compose_run_config(*overrides).data)  # a run's reading
    assert planned == len(trained) == 47 and trained.skipped == {"too_long": 1}


def test_the_pre_flight_streams_the_prompts_in_batches_and_shows_a_long_reads_progress(tmp_path, monkeypatch, capsys):
    """mode=plan of a 200,000-line file was silent for 84 s and held every prompt and its tokens (0.95 GB): the
    pre-flight tokenizes a batch per call, keeps the lengths, and draws a progress line once a read takes long
    (here at once)."""
    from lit_ppo.demo.tiny import build_char_tokenizer
    from lit_ppo.rollout import prompts
    from lit_ppo.run.prepare import prompt_lengths
    from tests.helpers.prompts import CountingTokenizer

    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(2100)])
    counting = CountingTokenizer(build_char_tokenizer())
    data = compose_run_config("data=file", f"data.path={path}").data
    lengths, longest, notes = prompt_lengths(data, counting, [path])
    assert counting.calls == [1024, 1024, 52] and len(lengths) == 2100 and notes == []
    assert longest[0] == max(lengths) == len("1000+1=")
    monkeypatch.setattr(prompts, "PROGRESS_AFTER_S", 0.0)
    run_module.main(compose_config(f"output_dir={tmp_path / 'plan'}", "mode=plan", "data=file", f"data.path={path}"))
    assert f"reading data.path={path}: 2,100 of ~2,100 records" in capsys.readouterr().out


def test_repeated_prompts_and_an_evaluation_file_equal_to_the_training_file_are_noted(tmp_path, capsys):
    """Both passed without a word; the plan now says how many repeat, and how many evaluation prompts are trained on."""
    records = [{"prompt": f"{i % 30}+1=", "answer": str(i % 30 + 1)} for i in range(40)]  # 10 repeats
    path = write_jsonl(tmp_path / "train.jsonl", records)
    overrides = ["mode=plan", "data=file", f"data.path={path}", f"data.eval_path={path}"]
    run_module.main(compose_config(f"output_dir={tmp_path / 'plan'}", *overrides))
    out = capsys.readouterr().out
    assert f"data.path={path}: 10 of 40 training prompts repeat an earlier one" in out
    assert f"data.eval_path={path}: 40 of 40 evaluation prompts are also training prompts (data.path={path})" in out


def test_a_prompt_key_that_names_no_field_is_answered_with_the_key_to_set(tmp_path):
    """It was answered "fix: repair the record or set data.bad_records=skip", which would skip every record."""
    path = write_jsonl(tmp_path / "train.jsonl", [{"question": "1+1=", "answer": "2"}] * 40)
    message = refused(tmp_path, "mode=plan", "data=file", f"data.path={path}", error=ConfigError)
    assert f"{path}:1: data.prompt_key='prompt' is not a field of the records" in message
    assert "['answer', 'question']" in message and "fix: set data.prompt_key to the field" in message
    assert "bad_records" not in message


# ------------------------------------------------------------------ reward functions and environments

REWARDS = """
def texts_and_gold(texts, gold):
    return [0.0 for _ in texts]


def two_lists(prompts, responses):
    return [0.0 for _ in responses]


def needs_a_threshold(prompts, completions, answer, *, threshold):
    return [0.0 for _ in completions]


def score(prompts, responses, references, extras):
    return [float(r.strip() == ref) for r, ref in zip(responses, references)]
"""


@pytest.mark.parametrize(
    "function, expected",
    [
        ("texts_and_gold", "reward.signature=auto cannot tell how to call my_rewards.texts_and_gold(texts, gold)"),
        ("two_lists", "my_rewards.two_lists(prompts, responses) cannot be called as the lit_ppo convention calls it"),
        ("needs_a_threshold", "missing a required argument: 'threshold'"),
    ],
)
def test_a_reward_function_in_neither_convention_is_refused_without_calling_it(
    tmp_path, monkeypatch, import_path, no_training, function, expected
):
    """Bound against the convention it will be called with, before the run: it used to fail at the first
    rollout, with a message suggesting reward.on_error=zero (which would score every sample 0)."""
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    monkeypatch.chdir(tmp_path)  # my_rewards.py is in the working directory
    message = refused(tmp_path, "mode=train", "reward=custom_example", f"reward.fn._target_=my_rewards.{function}")
    assert expected in message and "fix:" in message and "on_error" not in message
    assert no_training == []


def test_a_misspelt_keyword_of_the_reward_function_is_named_not_taken_for_a_signature_problem(
    tmp_path, monkeypatch, import_path, no_training
):
    """`reward.fn.threshhold=0.5` was reported as the function not fitting the TRL convention ("missing a required
    argument: 'threshold'; fix: give it those parameters ... or set reward.signature"); with math_reward's
    format_wieght, mode=plan passed and the run failed at its first rollout."""
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    monkeypatch.chdir(tmp_path)
    custom = ["reward=custom_example", "reward.fn._target_=my_rewards.needs_a_threshold"]
    message = refused(tmp_path, "mode=train", *custom, "+reward.fn.threshhold=0.5", error=ConfigError)
    assert message == (
        "reward.fn.threshhold: my_rewards.needs_a_threshold has no parameter 'threshhold' (its parameters: prompts, "
        "completions, answer, threshold); fix: correct it to reward.fn.threshold"
    )
    message = refused(tmp_path, "mode=plan", "reward=math", "+reward.fn.format_wieght=0.1", error=ConfigError)
    assert message.startswith("reward.fn.format_wieght: lit_ppo.rewards.math_verifier.math_reward has no parameter")
    assert message.endswith("fix: correct it to reward.fn.format_weight")
    run_module.main(compose_config(f"output_dir={tmp_path / 'ok'}", *custom, "+reward.fn.threshold=0.5"))
    assert len(no_training) == 1


def test_the_working_directory_is_importable_and_a_missing_module_names_the_path(tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    proc = train_py(
        tmp_path,
        "mode=plan",
        "reward=custom_example",
        "reward.fn._target_=my_rewards.score",
        f"output_dir={tmp_path / 'a'}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = one_error_line(
        train_py(
            tmp_path,
            "mode=plan",
            "reward=custom_example",
            "reward.fn._target_=not_here.score",
            f"output_dir={tmp_path / 'b'}",
        )
    )
    assert "reward.fn._target_=not_here.score: no module 'not_here' on the import path (searched " in line
    assert str(tmp_path) in line and "PYTHONPATH" in line


ENVIRONMENTS = """
class NoAction:
    def reset(self, record):
        return None

    def step(self):
        return None, 0.0, True, {}


class NoReset:
    def step(self, action):
        return None, 0.0, True, {}


class Tool:
    def __init__(self, digits=3):
        self.digits = digits

    def reset(self, record):
        return None

    def step(self, action):
        return None, 0.0, True, {}
"""


@pytest.mark.parametrize(
    "target, extra, expected",
    [
        ("my_environments.NoAction", [], "my_environments.NoAction.step cannot be called as step(action)"),
        ("my_environments.NoReset", [], "my_environments.NoReset has no reset(record) method"),
        (
            "my_environments.Tool",
            ["+rollout.episodes.environment.digit=4"],
            "my_environments.Tool cannot be built from the arguments ['digit']",
        ),
    ],
)
def test_an_environment_is_bound_against_the_protocol_without_building_it(
    tmp_path, monkeypatch, import_path, target, extra, expected
):
    (tmp_path / "my_environments.py").write_text(ENVIRONMENTS)
    monkeypatch.chdir(tmp_path)
    overrides = ["mode=plan", "+experiment=tool_arithmetic", f"rollout.episodes.environment._target_={target}"]
    for key in ("call_start", "call_end", "result_format", "error_format", "max_calls"):
        overrides.append(f"~rollout.episodes.environment.{key}")
    message = refused(tmp_path, *overrides, *extra, error=ConfigError)
    assert expected in message and "fix:" in message
    # The protocol's own signatures pass.
    run_module.main(
        compose_config(
            f"output_dir={tmp_path / 'ok'}",
            *overrides[:2],
            "rollout.episodes.environment._target_=my_environments.Tool",
            *overrides[3:],
        )
    )
    assert (tmp_path / "ok" / "plan.json").exists()


def test_an_environment_given_as_a_dotted_path_is_its_class(tmp_path, no_training):
    """`rollout.episodes.environment=<dotted path>` (a string) gave an AttributeError traceback, then a refusal whose fix was
    rollout.episodes.environment=null."""
    calculator = "lit_ppo.environments.CalculatorEnvironment"
    config = compose_run_config(f"rollout.episodes.environment={calculator}", "rollout.episodes.max_turns=3")
    assert config.rollout.episodes.environment == {"_target_": calculator}
    line = one_error_line(
        train_py(
            tmp_path,
            "mode=plan",
            "rollout.episodes.environment=lit_ppo.environments.Calculator",
            "rollout.episodes.max_turns=3",
        )
    )
    assert line.startswith(
        "error: rollout.episodes.environment._target_=lit_ppo.environments.Calculator: lit_ppo.environments"
    )
    run_module.main(
        compose_config(
            "mode=train",
            f"rollout.episodes.environment={calculator}",
            "rollout.episodes.max_turns=3",
            f"output_dir={tmp_path}",
        )
    )
    assert len(no_training) == 1


def test_an_environment_with_one_turn_is_refused(tmp_path):
    message = refused(
        tmp_path, "mode=plan", "+experiment=tool_arithmetic", "rollout.episodes.max_turns=1", error=ConfigError
    )
    assert (
        "rollout.episodes.environment is set but rollout.episodes.max_turns=1" in message
        and "fix: set rollout.episodes.max_turns" in message
    )


# ------------------------------------------------------------------ values read by their field's type (issue 40)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("ppo.packing=maybe", "error: ppo.packing='maybe' is not true or false (also yes/no, on/off), or null"),
        ("rollout.temperature=hot", "error: rollout.temperature='hot' is not a number in [0.01, 2]"),
    ],
)
def test_a_value_its_field_does_not_accept_exits_2_with_one_line_in_plan_mode(tmp_path, override, expected):
    """`ppo.packing=maybe` trained with packing on (exit 0); `rollout.temperature=hot` passed mode=plan."""
    line = one_error_line(train_py(tmp_path, "mode=plan", override, f"output_dir={tmp_path / 'out'}"))
    assert line.startswith(expected) and "fix: " in line
    assert not (tmp_path / "out" / "plan.json").exists()


def test_packing_off_plans_off(tmp_path, capsys):
    """`ppo.packing=off` planned "packing on": the string "off" tested true."""
    run_module.main(compose_config("mode=plan", "ppo.packing=off", f"output_dir={tmp_path}"))
    assert json.loads((tmp_path / "plan.json").read_text())["layout"]["packing"] is False
    assert any(line.split()[:2] == ["packing", "off"] for line in capsys.readouterr().out.splitlines())


@pytest.mark.parametrize("mode", ["plan", "train"])
@pytest.mark.parametrize(
    "override, expected",
    [
        ("rollout.max_response_tokens=8.5", "rollout.max_response_tokens=8.5 is not an integer >= 1"),
        ("rollout.max_response_tokens=0", "rollout.max_response_tokens=0 is not an integer >= 1"),
        ("rollout.temperature=0", "rollout.temperature=0 is not a number in [0.01, 2]"),
        ("reward.on_error=skip", "reward.on_error='skip' is not one of raise, zero; fix: e.g. reward.on_error=raise"),
        ("reward.overlong_buffer_tokens=8", "reward.overlong_buffer_tokens=8 must lie in (0, 8)"),
    ],
)
def test_refused_in_plan_mode_as_in_a_run_before_any_engine_starts(tmp_path, no_training, mode, override, expected):
    """8.5 tokens ran and was recorded; temperature 0 and 0 tokens gave vLLM's tracebacks after the engine started;
    on_error=skip and an overlong buffer over the budget passed mode=plan and were refused by the run's scorer."""
    message = refused(tmp_path, f"mode={mode}", override, error=ConfigError)
    assert message.startswith(expected) and "fix: " in message
    assert no_training == []


# ------------------------------------------------------------------ LoRA targets against the model's modules

TINY_LINEAR = "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head"


def test_a_lora_target_that_names_no_module_is_refused_with_the_modules_that_exist(tmp_path):
    """`[q_proj,v_prj]` trained q_proj alone (adapter_config.json still listing v_prj) and mode=plan passed it."""
    line = one_error_line(
        train_py(
            tmp_path,
            "mode=plan",
            "model.lora.rank=8",
            "model.lora.target_modules=[q_proj,v_prj]",
            f"output_dir={tmp_path / 'out'}",
        )
    )
    assert line.startswith(
        "error: model.lora.target_modules=[q_proj,v_prj]: v_prj matches no linear module of the tiny model "
        f"(model.tiny), whose linear modules are {TINY_LINEAR}; fix: correct v_prj (did you mean v_proj?)"
    )
    assert not (tmp_path / "out" / "plan.json").exists()


def test_a_run_matches_the_lora_targets_on_its_model_before_it_loads(tmp_path, tiny_model_dir, no_training):
    """`[q_prj]` gave peft's NoMatchingPeftModuleError after the model load."""
    lora = ["model.lora.rank=8", f"model.path={tiny_model_dir}", "model.warm_start.enabled=false"]
    for mode in ("plan", "train"):
        message = refused(tmp_path, f"mode={mode}", *lora, "model.lora.target_modules=[q_prj]", error=ConfigError)
        assert message.startswith(
            f"model.lora.target_modules=[q_prj]: q_prj matches no linear module of model.path={tiny_model_dir} "
            f"({tiny_model_dir}/config.json), whose linear modules are {TINY_LINEAR}"
        )
    # a string is a regular expression to peft: refused, whatever the model
    message = refused(tmp_path, "mode=plan", *lora, "model.lora.target_modules=q_proj", error=ConfigError)
    assert message.startswith("model.lora.target_modules='q_proj' is a string, which peft reads as a regular")
    assert "fix: a list, model.lora.target_modules=[q_proj], or all-linear" in message
    assert no_training == []
    # whole names and all-linear are matched
    run_module.main(
        compose_config(
            f"output_dir={tmp_path / 'ok'}", "mode=train", *lora, "model.lora.target_modules=[self_attn.q_proj,v_proj]"
        )
    )
    run_module.main(compose_config(f"output_dir={tmp_path / 'ok'}", "mode=train", *lora))
    assert len(no_training) == 2


# ------------------------------------------------------------------ ranks


def test_several_devices_under_strategy_single_are_refused_before_any_model_loads(tmp_path):
    """`strategy.devices=2` on the default strategy=single would start both ranks' engines and fail in the first
    backward with DDP's unused-parameters traceback; it is refused in one line with the fix, exit 2, in a training
    run too (before the warm start or any model: the run's directory gets no plan.json)."""
    line = one_error_line(train_py(tmp_path, "mode=plan", "strategy.devices=2", f"output_dir={tmp_path / 'plan'}"))
    assert line == (
        "error: strategy=single runs one process, but strategy.devices=2 asks for 2 ranks; fix: strategy=ddp "
        "strategy.devices=2 (or strategy=fsdp), or strategy.devices=1"
    )
    line = one_error_line(train_py(tmp_path, "strategy.num_nodes=2", f"output_dir={tmp_path / 'run'}"))
    assert "strategy.devices=1 strategy.num_nodes=2 asks for 2 ranks; fix: strategy=ddp" in line
    assert not (tmp_path / "run" / "plan.json").exists()
    for ok in (["strategy=ddp", "strategy.devices=2"], ["strategy.devices=1"]):
        compose_run_config(*ok)  # the settings themselves are fine; only the pair is refused
        assert run_module.main(compose_config("mode=plan", f"output_dir={tmp_path / 'ok'}", *ok)) is None


class SpawningDDP:
    """A strategy class whose own default starts the ranks as child processes (as Lightning's ddp_spawn does)."""

    def __init__(self, start_method: str = "spawn", find_unused_parameters: bool = False):
        pass


@pytest.mark.parametrize(
    "given, method",
    [
        (["+strategy.lightning.start_method=spawn"], "spawn"),
        (["+strategy.lightning.start_method=fork"], "fork"),
        (["+strategy.lightning.start_method=forkserver"], "forkserver"),
    ],
)
def test_a_strategy_that_starts_the_ranks_as_child_processes_is_refused_before_any_model_loads(tmp_path, given, method):
    """`strategy.lightning.start_method=spawn` (or fork, forkserver: Lightning's ddp_spawn, ddp_fork, ddp_notebook):
    every child used to keep the topology's rank 0 (built before the launch) and the setup check stopped ranks > 0
    blaming torchrun's variables; with the topology rebuilt, a fork run of 2 CPU ranks trained and this process wrote
    `rollout_steps: 0` (rank 0's history stayed in its child), and spawn failed to start the ranks at all. Refused in
    one line, in mode=plan too; Lightning's default start method (popen) plans."""
    ddp = ["strategy=ddp", "strategy.accelerator=cpu", "strategy.devices=2", "ppo.micro_train_batch_size=16"]
    with pytest.raises(ConfigError) as refused:
        run_module.main(compose_config("mode=plan", f"output_dir={tmp_path / 'plan'}", *ddp, *given))
    assert str(refused.value) == (
        f"strategy.lightning.start_method={method} runs the ranks as child processes of this one, which would write "
        "the run's outputs without their training (rank 0's history and evaluations stay in its child); fix: "
        "strategy.lightning.start_method=popen (Lightning's default: each rank a copy of the command), or start the "
        "ranks with torchrun or srun"
    )
    assert not (tmp_path / "plan" / "plan.json").exists()
    ok = compose_config("mode=plan", f"output_dir={tmp_path / 'ok'}", *ddp, "+strategy.lightning.start_method=popen")
    assert run_module.main(ok) is None


def test_a_strategy_class_whose_default_starts_child_processes_is_refused_in_a_training_runs_pre_flight():
    """Without start_method, the class's own default (a subclass of DDPStrategy written with spawn) decides; read in a
    training run's pre-flight, which imports the class (`mode=plan` imports no Lightning)."""
    from lit_ppo.run.preflight import check_launcher

    spawning = {"_target_": f"{__name__}.SpawningDDP", "find_unused_parameters": True}
    with pytest.raises(ConfigError, match=r"^strategy.lightning.start_method=spawn runs the ranks as child processes"):
        check_launcher(spawning)
    check_launcher(spawning, class_default=False)  # mode=plan: not imported
    check_launcher({"_target_": "lightning.pytorch.strategies.DDPStrategy"})  # popen, Lightning's default
    check_launcher({"_target_": f"{__name__}.SpawningDDP", "start_method": "popen"})


def test_lightnings_own_choice_of_child_processes_is_refused_when_the_trainer_is_built(tiny_model_dir, tmp_path):
    """strategy.lightning null leaves the strategy to Lightning ("auto": ddp_notebook, forked ranks, in a notebook):
    build_run refuses a launcher that starts the ranks as child processes before fit, as the pre-flight does."""
    from unittest import mock

    import lightning as L

    from lit_ppo.run.build import build_run_on_files

    built = L.Trainer.__init__

    def in_a_notebook(self, *args, **kwargs):
        built(self, *args, **{**kwargs, "strategy": "ddp_fork", "devices": 2})

    prompts = tmp_path / "train.jsonl"
    prompts.write_text("".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(64)))
    config = compose_run_config("strategy.accelerator=cpu", f"output_dir={tmp_path}")
    with mock.patch.object(L.Trainer, "__init__", in_a_notebook), pytest.raises(ConfigError) as refused:
        build_run_on_files(config, tiny_model_dir, (prompts, None), scorer=None, output_dir=tmp_path)
    assert str(refused.value).startswith("strategy.lightning.start_method=fork runs the ranks as child processes")


def test_a_reward_bound_by_keyword_before_its_positional_parameters_is_checked_as_functools_partial_calls_it():
    """`reward.fn.prompts=...` with `_partial_: true` on `f(prompts, completions, answer)`: partial makes prompts and
    every parameter after it keyword-only. The check raised a raw `ValueError: wrong parameter order` instead of
    checking (or refusing in one line), because it changed the bound parameter's kind alone."""
    import inspect

    from lit_ppo.run import user_code as checks

    def reward(prompts, completions, answer, **kwargs):
        return [0.0] * len(completions)

    parameters = checks.call_parameters(reward, {"prompts": None}, partial=True)
    assert [p.kind for p in parameters.values()][:3] == [inspect.Parameter.KEYWORD_ONLY] * 3
    assert checks.check_reward_convention(parameters, "reward", "trl", "answer", []) == "trl"
    with pytest.raises(
        ConfigError, match=r"^reward.fn: reward\(prompts, completions, answer, kwargs\) cannot be called"
    ):
        checks.check_reward_convention(parameters, "reward", "lit_ppo", "answer", [])


def test_a_gpu_strategy_on_a_machine_without_a_gpu_is_refused_before_the_plan_in_a_training_run_only(
    tmp_path, monkeypatch, no_training
):
    """strategy=fsdp's preset says accelerator: gpu: without a GPU a training run passed the pre-flight, printed its
    plan, then stopped in Lightning's 30-line "No supported gpu backend found!" (issue 55 item 13). A training run is
    refused in one line with the fix before the plan; mode=plan still plans the GPU cluster's run."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    fsdp = ["strategy=fsdp", "strategy.devices=2"]
    message = refused(tmp_path, "mode=train", *fsdp, error=ConfigError)
    assert message == (
        "strategy.accelerator=gpu (strategy=fsdp) but torch finds no GPU on this machine; fix: strategy.accelerator=cpu "
        "(strategy.devices=2: 2 CPU processes), or run on a machine with a GPU (mode=plan plans for GPUs on any machine)"
    )
    message = refused(tmp_path, "mode=train", "strategy.accelerator=cuda", error=ConfigError)
    assert (
        message.startswith("strategy.accelerator=cuda (strategy=single) but torch finds no GPU")
        and "(strategy.devices" not in message
    )
    assert no_training == []
    assert run_module.main(compose_config("mode=plan", f"output_dir={tmp_path / 'plan'}", *fsdp)) is None
    assert (tmp_path / "plan" / "plan.json").exists()
    run_module.main(compose_config("mode=train", f"output_dir={tmp_path / 'cpu'}", *fsdp, "strategy.accelerator=cpu"))
    assert len(no_training) == 1
