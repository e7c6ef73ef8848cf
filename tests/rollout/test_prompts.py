"""Prompt datasets: each file format, plain and chat-formatted, down to the token ids vLLM receives; bad records."""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from lit_ppo.errors import ConfigError
from lit_ppo.rollout.prompts import DataError, load_prompts
from tests.helpers import datamodule_on, write_jsonl
from tests.helpers.prompts import CountingTokenizer

RECORDS = [
    {"prompt": "What is 2+3?", "answer": 5, "topic": "add"},
    {"prompt": "What is 7-4?", "answer": "3", "topic": "sub"},
    {"prompt": "Compute 6*7.", "answer": 42, "topic": "mul"},
    {"prompt": "What is 9/3?", "answer": "3", "topic": "div"},
]
SYSTEM = "Answer with a number."


def chat_text(prompt: str, system: str | None) -> str:
    """The tiny tokenizer's (Qwen-shaped) chat format, written out by hand."""
    head = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    return f"{head}<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def write_parquet_raw(records: list[dict], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def write_parquet(records: list[dict], path: Path) -> Path:
    # Mixed int/str answers are not one Arrow type: store them as text, as a real dataset would.
    return write_parquet_raw([{**r, "answer": str(r["answer"])} for r in records], path)


def write_saved_dataset(records: list[dict], path: Path) -> Path:
    import datasets

    datasets.Dataset.from_list([{**r, "answer": str(r["answer"])} for r in records]).save_to_disk(str(path))
    return path


WRITERS = {
    "jsonl": (write_jsonl, "train.jsonl"),
    "parquet": (write_parquet, "train.parquet"),
    "save_to_disk": (write_saved_dataset, "train_ds"),
}


def write(fmt: str, records: list[dict], root: Path) -> Path:
    writer, name = WRITERS[fmt]
    return writer(records, root / name)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


# ------------------------------------------------------------------ formats and templates


@pytest.mark.parametrize("fmt", list(WRITERS))
@pytest.mark.parametrize(
    "chat, system", [(False, None), (True, None), (True, SYSTEM)], ids=["plain", "chat", "chat+system"]
)
def test_each_format_gives_the_formatted_prompt_token_ids(fmt, chat, system, tokenizer, tmp_path):
    path = write(fmt, RECORDS, tmp_path)
    prompts = load_prompts(
        path,
        tokenizer,
        prompt_key="prompt",
        answer_key="answer",
        extra_keys=["topic"],
        chat_template=chat,
        system_prompt=system,
        max_prompt_length=128,
    )
    assert len(prompts) == len(RECORDS) and not prompts.skipped
    for prompt, record in zip(prompts.prompts, RECORDS):
        expected = chat_text(record["prompt"], system) if chat else record["prompt"]
        assert prompt.text == expected
        assert prompt.prompt_ids == tokenizer(expected, add_special_tokens=False).input_ids
        assert prompt.reference == str(record["answer"])
        assert prompt.extras == {"topic": record["topic"]}
    first = prompts.prompts[0].prompt_ids
    if chat:  # the template's markers are single special tokens, not spelled out character by character
        assert first[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
        assert first.count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == (2 if system else 1)


def test_tiny_tokenizer_keeps_spaces_and_newlines(tokenizer):
    # Reloaded from disk, AutoTokenizer picks Qwen2Tokenizer (config.json says qwen2): same ids, nothing dropped.
    text = "What is 2+3?\nA: 5"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text)  # one id per character
    assert tokenizer.decode(ids) == text


def test_custom_keys_and_no_reference(tokenizer, tmp_path):
    path = write_jsonl(
        [{"question": "Q one?", "meta": {"level": 2}}, {"question": "Q two?", "meta": None}], tmp_path / "q.jsonl"
    )
    prompts = load_prompts(path, tokenizer, prompt_key="question", answer_key=None, extra_keys=["meta"])
    assert [p.text for p in prompts.prompts] == ["Q one?", "Q two?"]
    assert [p.reference for p in prompts.prompts] == [None, None]
    assert [p.extras for p in prompts.prompts] == [{"meta": {"level": 2}}, {"meta": None}]


def test_the_engine_receives_the_prompt_token_ids(tiny_model_dir, engine, tokenizer, tmp_path, monkeypatch):
    """A chat-formatted JSONL prompt set through a real rollout: vLLM is asked with exactly the expected ids."""
    from lit_ppo.config import PPOConfig, RolloutConfig

    prompts = load_prompts(
        write_jsonl(RECORDS, tmp_path / "train.jsonl"),
        tokenizer,
        chat_template=True,
        system_prompt=SYSTEM,
        max_prompt_length=100,
    )
    ppo = PPOConfig(rollout_batch_size=4, n_samples_per_prompt=2, train_batch_size=8, micro_train_batch_size=4)
    rollout = RolloutConfig(max_response_tokens=4)
    datamodule = datamodule_on(prompts, rollout, tokenizer, tiny_model_dir, engine, ppo=ppo)
    sent, received = [], []
    original = engine.llm.generate

    def spy(requests, *args, **kwargs):
        outputs = original(requests, *args, **kwargs)
        sent.extend(r["prompt_token_ids"] for r in requests)
        received.extend(o.prompt_token_ids for o in outputs)
        return outputs

    monkeypatch.setattr(engine.llm, "generate", spy)
    batch = datamodule.produce_rollout(0)

    expected = {tuple(tokenizer(chat_text(r["prompt"], SYSTEM), add_special_tokens=False).input_ids) for r in RECORDS}
    assert {tuple(ids) for ids in sent} == {tuple(ids) for ids in received} == expected
    assert len(batch.prompt_ids) == 8 and {tuple(ids) for ids in batch.prompt_ids} == expected
    for ids, text in zip(batch.prompt_ids, batch.prompts):
        assert ids == tokenizer(text, add_special_tokens=False).input_ids


# ------------------------------------------------------------------ bad input


def test_malformed_jsonl_line_names_file_and_line(tokenizer, tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "a", "answer": 1}\n\n{"prompt": "b", "answer": 2\n')
    with pytest.raises(DataError, match=rf"{path}:3:28: malformed JSON"):
        load_prompts(path, tokenizer, bad_records="skip")  # malformed files are never skipped


def test_malformed_json_keeps_its_line_and_column(tokenizer, tmp_path):
    """The message had json's reason without its position, and told a file of one object per line to hold one."""
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "a", "answer": 1}\n{"prompt": "b" "answer": 2}\n')
    with pytest.raises(DataError) as info:
        load_prompts(path, tokenizer)
    assert str(info.value) == (
        f'{path}:2:16: malformed JSON (Expecting \',\' delimiter at line 2, column 16: \'{{"prompt": "b" "answer": 2}}\'); '
        "fix: repair that record (a JSONL file holds one JSON object per line)"
    )


def test_a_utf8_file_with_a_byte_order_mark_is_read(tokenizer, tmp_path):
    """Windows tools write one; it was refused as malformed JSON, "fix: one JSON object per line"."""
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in RECORDS).encode())
    prompts = load_prompts(path, tokenizer)
    assert [p.text for p in prompts.prompts] == [r["prompt"] for r in RECORDS]
    assert prompts.prompts[0].location == f"{path}:1"


def test_non_object_line_names_file_and_line(tokenizer, tmp_path):
    path = tmp_path / "list.jsonl"
    path.write_text('{"prompt": "a", "answer": 1}\n[1, 2]\n')
    with pytest.raises(DataError, match=rf"{path}:2: expected a JSON object, got list"):
        load_prompts(path, tokenizer)


GOOD = {"prompt": "1+1=", "answer": "2"}
BAD_CASES = {
    # name: (bad record, skip reason, what the error says)
    "missing_prompt": ({"answer": "2"}, "missing_key", r"no key\(s\) \['prompt'\]"),
    "missing_answer": ({"prompt": "1+1="}, "missing_key", r"no key\(s\) \['answer'\]"),
    "missing_extra": ({"prompt": "1+1=", "answer": "2"}, "missing_key", r"no key\(s\) \['topic'\]"),
    "empty_prompt": ({"prompt": "   ", "answer": "2"}, "empty_prompt", "'prompt' is empty"),
    "too_long": ({"prompt": "9" * 40, "answer": "2"}, "too_long", "40 tokens > data.max_prompt_length=32"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_record_error_names_file_and_line(case, tokenizer, tmp_path):
    record, _, message = BAD_CASES[case]
    good = {**GOOD, "topic": "t"}
    path = write_jsonl(
        [good, good, {**record, **({"topic": "t"} if case != "missing_extra" else {})}, good], tmp_path / "d.jsonl"
    )
    with pytest.raises(DataError, match=rf"{path}:3: .*{message}.*fix: .*data.bad_records=skip"):
        load_prompts(path, tokenizer, extra_keys=["topic"], max_prompt_length=32, bad_records="error")


@pytest.mark.parametrize("fmt", ["parquet", "save_to_disk"])
def test_bad_record_error_names_the_row(fmt, tokenizer, tmp_path):
    path = write(fmt, [GOOD, {"prompt": "", "answer": "2"}], tmp_path)
    with pytest.raises(DataError, match=rf"{path} row 1: prompt 'prompt' is empty"):
        load_prompts(path, tokenizer)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_skip_counts_each_reason_exactly(fmt, tokenizer, tmp_path):
    records = (
        [GOOD] * 3
        + [{"prompt": "", "answer": "1"}, {"prompt": "  \n", "answer": "1"}]
        + [{"prompt": "7" * 33, "answer": "1"}] * 4
        + [{"prompt": "2+2=", "answer": None}]
    )
    if fmt == "jsonl":
        records.append({"answer": "1"})  # a column missing in some rows only exists in JSONL
    path = (
        write_jsonl(records, tmp_path / "d.jsonl")
        if fmt == "jsonl"
        else write_parquet_raw(records, tmp_path / "d.parquet")
    )
    prompts = load_prompts(path, tokenizer, max_prompt_length=32, bad_records="skip")
    expected = Counter(empty_prompt=2, too_long=4, **({"missing_key": 1} if fmt == "jsonl" else {}))
    assert prompts.skipped == expected
    assert len(prompts) == 4 and [p.reference for p in prompts.prompts] == ["2", "2", "2", None]
    reasons = ", ".join(f"{k}={v}" for k, v in sorted(expected.items()))
    assert prompts.describe() == f"4 prompts from {path} (skipped {sum(expected.values())}: {reasons})"


def test_skip_counts_reach_the_log(tokenizer, tmp_path, caplog):
    from lit_ppo.run.prepare import read_prompts
    from tests.helpers import compose_run_config

    train = write_jsonl([GOOD, GOOD, {"prompt": ""}, {"prompt": "x" * 50, "answer": "1"}], tmp_path / "train.jsonl")
    evaluation = write_jsonl([GOOD, {"answer": "1"}], tmp_path / "eval.jsonl")
    cfg = compose_run_config(
        "data=file",
        f"data.path={train}",
        f"data.eval_path={evaluation}",
        "data.bad_records=skip",
        "data.max_prompt_length=32",
    )
    with caplog.at_level(logging.WARNING, logger="lit_ppo"):
        read = read_prompts(cfg.data, tokenizer, [train, evaluation], keep=True)
    train_set, eval_set = read.train, read.evaluation
    assert train_set.skipped == Counter(missing_key=1, too_long=1) and eval_set.skipped == Counter(missing_key=1)
    assert "skipped 2 train prompts ({'missing_key': 1, 'too_long': 1})" in caplog.text
    assert "skipped 1 eval prompts ({'missing_key': 1})" in caplog.text


def test_only_bad_records_is_an_error(tokenizer, tmp_path):
    path = write_jsonl([{"prompt": ""}, {"text": "x"}], tmp_path / "d.jsonl")
    with pytest.raises(DataError, match=r"no usable prompts .*skipped 2: empty_prompt=1, missing_key=1"):
        load_prompts(path, tokenizer, answer_key=None, bad_records="skip")


def test_configuration_mistakes(tokenizer, tmp_path):
    path = write_jsonl([GOOD], tmp_path / "d.jsonl")
    with pytest.raises(ConfigError, match="data.bad_records='drop'"):
        load_prompts(path, tokenizer, bad_records="drop")
    with pytest.raises(ConfigError, match="does not exist"):
        load_prompts(tmp_path / "missing.jsonl", tokenizer)
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(ConfigError, match="suffix '.csv'"):
        load_prompts(tmp_path / "d.csv", tokenizer)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ConfigError, match="not a `datasets` save_to_disk folder"):
        load_prompts(tmp_path / "empty_dir", tokenizer)
    plain = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    plain.chat_template = None
    with pytest.raises(ConfigError, match="has no chat template; fix: set data.chat_template=false"):
        load_prompts(path, plain, chat_template=True)


# ------------------------------------------------------------------ large and compressed files (issue 55 item 16)


@pytest.mark.parametrize("name", ["train.jsonl", "train.jsonl.gz"])
def test_a_gzip_file_is_named_as_compressed_with_the_command_that_decompresses_it(name, tokenizer, tmp_path):
    """It was read as text: the pre-flight told the user to re-encode it from Latin-1 (its first byte, 0x8b, is not
    UTF-8); a .jsonl.gz file was refused for its suffix with no word of gzip."""
    import gzip

    path = tmp_path / name
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in RECORDS).encode()))
    with pytest.raises(DataError) as info:
        load_prompts(path, tokenizer)
    message = str(info.value)
    assert f"{path}: the file is gzip-compressed (it starts with the gzip bytes 1f 8b)" in message
    assert "fix: decompress it, e.g. `" + ("gunzip -k" if name.endswith(".gz") else "mv") in message
    assert "latin" not in message.lower() and "\n" not in message


def test_a_file_is_tokenized_in_batches_and_streamed(tokenizer, tmp_path):
    """2,500 prompts are tokenized in 3 calls (TOKENIZE_BATCH = 1,024), with the ids of one call per prompt, and
    yielded before the end of the file is read: a reader of lengths holds one batch, not the whole file."""
    from lit_ppo.rollout.prompts import TOKENIZE_BATCH, iter_prompts

    assert TOKENIZE_BATCH == 1024
    records = [{"prompt": f"What is {i}+{i % 7}?", "answer": str(i + i % 7)} for i in range(2500)]
    path = write_jsonl(records, tmp_path / "d.jsonl")
    counting = CountingTokenizer(tokenizer)
    prompts = load_prompts(path, counting)
    assert counting.calls == [1024, 1024, 452]
    assert [p.prompt_ids for p in prompts.prompts[::499]] == [tokenizer(r["prompt"]).input_ids for r in records[::499]]
    # a malformed last line: the first 2,048 prompts were given out before it was read
    with open(path, "a") as f:
        f.write("{not json\n")
    stream, seen = iter_prompts(path, tokenizer), 0
    with pytest.raises(DataError, match=rf"{path}:2501:2: malformed JSON"):
        for _ in stream:
            seen += 1
    assert seen == 2500


def test_bad_records_are_named_in_file_order_across_a_batch(tokenizer, tmp_path):
    """A prompt too long (found once its batch is tokenized) before a malformed line (found as it is read): the
    first in the file is named, as one record at a time named it."""
    records = [GOOD] * 5 + [{"prompt": "9" * 40, "answer": "1"}] + [GOOD] * 5
    path = write_jsonl(records, tmp_path / "d.jsonl")
    with open(path, "a") as f:
        f.write("{not json\n")
    with pytest.raises(DataError, match=rf"{path}:6: prompt has 40 tokens > data.max_prompt_length=32"):
        load_prompts(path, tokenizer, max_prompt_length=32)
    with pytest.raises(DataError, match=rf"{path}:12:2: malformed JSON"):
        load_prompts(path, tokenizer, max_prompt_length=32, bad_records="skip")


def test_a_long_read_shows_its_progress_on_one_line(tokenizer, tmp_path, monkeypatch, capsys):
    """A read past PROGRESS_AFTER_S seconds (here 0) draws `reading <name>: n of ~total records (s)`, redrawn in
    place (a carriage return, no new line) and left with its last count; a shorter one prints nothing."""
    from lit_ppo.rollout import prompts as module

    records = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(3000)]
    path = write_jsonl(records, tmp_path / "d.jsonl")
    load_prompts(path, tokenizer)
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(module, "PROGRESS_AFTER_S", 0.0)
    load_prompts(path, tokenizer, name=f"data.path={path}")
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("\r") and out.endswith("\n")
    assert re.fullmatch(rf"reading data.path={path}: 3,000 of ~3,000 records \(\d+ s\)\n", out.split("\r")[-1])
    assert f"reading data.path={path}: 1,024 of ~3,000 records" in out


def test_records_estimate_counts_lines_and_rows(tmp_path):
    from lit_ppo.rollout.prompts import records_estimate

    (tmp_path / "a.jsonl").write_text('{"prompt": "a"}\n\n{"prompt": "b"}')  # no newline at the end
    assert records_estimate(tmp_path / "a.jsonl") == 3
    assert records_estimate(write_parquet(RECORDS, tmp_path / "a.parquet")) == 4


def test_repeated_prompts_and_evaluation_prompts_trained_on_are_noted():
    """Counted on the prompts' digests in file order (hand-written here): repeats of an earlier training prompt, and
    evaluation prompts that are training prompts."""
    from lit_ppo.rollout.prompts import repetition_notes

    a, b, c, d = b"a", b"b", b"c", b"d"
    assert repetition_notes([a, b, c], [d], "data.path=t", "data.eval_path=e") == []
    assert repetition_notes([a, b, a, a, c], None, "data.path=t") == [
        "data.path=t: 2 of 5 training prompts repeat an earlier one (the same text as the model sees it); each copy "
        "is drawn as a prompt of its own"
    ]
    [note] = repetition_notes([a, b, c], [c, d, a, a], "data.path=t", "data.eval_path=e")
    assert note.startswith("data.eval_path=e: 3 of 4 evaluation prompts are also training prompts (data.path=t)")


def test_dataset_dict_folder_asks_for_one_split(tokenizer, tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list([GOOD])}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ConfigError, match=r"holds splits \['train'\]; fix: point at one split's folder"):
        load_prompts(tmp_path / "dd", tokenizer)
    assert len(load_prompts(tmp_path / "dd" / "train", tokenizer)) == 1


def test_tiny_tokenizer_filled_to_a_real_vocabulary_encodes_by_character_and_decodes_every_id(tmp_path):
    """build_char_tokenizer(151936): the vocabulary of Qwen2.5 for a random-weight model of its shape (issue 28's
    end-to-end GPU run): text still encodes one token per character, the same as the plain tokenizer, and every id up
    to the last decodes to text, also once saved and loaded back with AutoTokenizer (what the trainer loads)."""
    from transformers import AutoTokenizer

    from lit_ppo.demo.tiny import build_char_tokenizer, build_tiny_model

    text = "Question: Natalia sold 48 clips in April.\nHow many? ####"
    plain, filled = build_char_tokenizer(), build_char_tokenizer(151936)
    assert len(filled) == 151936
    assert filled(text)["input_ids"] == plain(text)["input_ids"]
    assert len(filled(text)["input_ids"]) == len(text)
    filled.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(text)["input_ids"] == plain(text)["input_ids"]
    last = len(filled) - 1
    assert loaded.decode([last, filled.eos_token_id], skip_special_tokens=True) == f" w{last - len(plain)}"
    model = build_tiny_model(filled, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1, intermediate_size=8,
                             max_position_embeddings=64, seed=0)  # fmt: skip
    assert model.config.vocab_size == 151936
    with pytest.raises(ValueError, match="below the"):
        build_char_tokenizer(10)
