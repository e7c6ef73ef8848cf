"""Prompt datasets: local JSONL, Parquet or `datasets.save_to_disk` folders, tokenized once.

Bad records (empty prompt, missing key, prompt longer than `max_prompt_length` tokens) follow the
user's policy: `error` stops with the file and line, `skip` drops them and counts each reason.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from lit_ppo.config import DataConfig
from lit_ppo.errors import (
    ConfigError,
    DataError,  # noqa: E402,F401 - defined with every user error; importable from here too
)
from lit_ppo.plan import PromptStats


@dataclass
class Prompt:
    prompt_ids: list[int]
    text: str  # the prompt as the model sees it (after the chat template)
    reference: str | None
    extras: dict[str, Any]
    location: str = ""  # file:line (or row) it came from, for messages


@dataclass
class PromptSet:
    prompts: list[Prompt]
    source: str
    skipped: Counter = field(default_factory=Counter)  # reason -> count

    def __len__(self) -> int:
        return len(self.prompts)

    def stats(self) -> PromptStats | None:
        """The prompts' lengths in tokens, for the plan's expected tokens per micro-batch."""
        return PromptStats.of(len(p.prompt_ids) for p in self.prompts)

    def describe(self) -> str:
        """`120 prompts from train.jsonl (skipped 3: too_long=2, missing_key=1)`, for the plan and the log."""
        text = f"{len(self.prompts)} prompts from {self.source}"
        if self.skipped:
            reasons = ", ".join(f"{reason}={count}" for reason, count in sorted(self.skipped.items()))
            text += f" (skipped {sum(self.skipped.values())}: {reasons})"
        return text


def _read_records(path: Path) -> Iterator[tuple[str, dict]]:
    """Yield (location, record); location names the file and line (or row) for messages."""
    if path.is_dir():
        try:
            import datasets
        except ImportError as e:
            raise ConfigError(
                f"data: {path} is a directory (a saved `datasets` dataset) but `datasets` is not installed; fix: pip install datasets"
            ) from e
        try:
            ds = datasets.load_from_disk(str(path))
        except FileNotFoundError as e:
            raise ConfigError(
                f"data: {path} is a directory but not a `datasets` save_to_disk folder ({e}); "
                "fix: point at a .jsonl or .parquet file or a folder written by Dataset.save_to_disk"
            ) from e
        if isinstance(ds, datasets.DatasetDict):
            raise ConfigError(
                f"data: {path} holds splits {list(ds)}; fix: point at one split's folder, e.g. {path}/train"
            )
        for i, record in enumerate(ds):
            yield f"{path} row {i}", record
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, record in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path} row {i}", record
    elif path.suffix in (".jsonl", ".json"):
        # utf-8-sig: a byte-order mark at the start (Windows tools write one) is read past, as JSON readers do
        with open(path, encoding="utf-8-sig") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                line = line.rstrip("\r\n")  # a column past the record's end is on its own line, not the next
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(
                        f"{path}:{line_no}:{e.colno}: malformed JSON ({e.msg} at line {line_no}, column {e.colno}: "
                        f"{_around(line, e.pos)!r}); fix: repair that record (a JSONL file holds one JSON object per "
                        "line)"
                    ) from e
                if not isinstance(record, dict):
                    raise DataError(
                        f"{path}:{line_no}: expected a JSON object, got {type(record).__name__}; fix: one object per line"
                    )
                yield f"{path}:{line_no}", record
    else:
        raise ConfigError(
            f"data: cannot read {path} (suffix {path.suffix!r}); fix: use .jsonl, .parquet or a `datasets` save_to_disk folder"
        )


def _around(line: str, position: int, width: int = 20) -> str:
    """The text of `line` around a character position, for a message."""
    return line[max(0, position - width) : position + width]


def format_prompt(text: str, tokenizer, *, chat_template: bool, system_prompt: str | None) -> str:
    """The prompt as the model sees it: the raw text, or a user turn (after an optional system turn) in
    the tokenizer's chat template, ending where the assistant's reply starts."""
    if not chat_template:
        return text
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"data.chat_template=true but the tokenizer of {tokenizer.name_or_path} has no chat template; "
            "fix: set data.chat_template=false (plain text prompts) or use a chat model"
        )
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": text}
    ]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


END_OF_TURN_PROBE = "lit-ppo end-of-turn probe"


def end_of_turn_token_ids(tokenizer) -> list[int]:
    """The special token the chat template writes right after an assistant turn's content (Qwen's `<|im_end|>`,
    Llama 3's `<|eot_id|>`, Gemma's `<end_of_turn>`): [its id], or [] if the template writes none.

    Found by rendering a conversation whose assistant turn is a probe text and reading what follows the probe:
    the longest special token (an added token marked special) the rest starts with, after whitespace. A base
    model's EOS is often another token, so generation would run on into turns it invents."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    messages = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": END_OF_TURN_PROBE}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    if END_OF_TURN_PROBE not in rendered:
        return []
    after = rendered.split(END_OF_TURN_PROBE, 1)[1].lstrip()
    special = {token.content: token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.special}
    special.update(zip(tokenizer.all_special_tokens, tokenizer.all_special_ids))
    matches = [token for token in special if token and after.startswith(token)]
    return [special[max(matches, key=len)]] if matches else []


def load_prompts(
    path: str | Path,
    tokenizer,
    *,
    prompt_key: str = "prompt",
    answer_key: str | None = "answer",
    extra_keys: list[str] = (),
    chat_template: bool = False,
    system_prompt: str | None = None,
    max_prompt_length: int = 512,
    bad_records: str = "error",
) -> PromptSet:
    if bad_records not in ("error", "skip"):
        raise ConfigError(f"data.bad_records={bad_records!r}; fix: use 'error' or 'skip'")
    path = Path(path)
    if not path.exists():
        raise ConfigError(
            f"data: file {path} does not exist; fix: set data.path (or data.eval_path) to an existing file"
        )
    result = PromptSet(prompts=[], source=str(path))

    def reject(location: str, reason: str, detail: str) -> None:
        if bad_records == "error":
            raise DataError(f"{location}: {detail}; fix: repair the record or set data.bad_records=skip")
        result.skipped[reason] += 1

    first = True
    for location, record in _read_records(path):
        missing = [k for k in [prompt_key, answer_key, *extra_keys] if k and k not in record]
        if missing and first:  # missing from the very first record: a key setting that names no field of the file
            settings = {prompt_key: "data.prompt_key", answer_key: "data.answer_key"}
            named = ", ".join(f"{settings.get(k, 'data.extra_keys')}={k!r}" for k in missing)
            raise ConfigError(
                f"{location}: {named} is not a field of the records (the first has {sorted(record)}); fix: set "
                f"{settings.get(missing[0], 'data.extra_keys')} to the field that holds it"
            )
        first = False
        if missing:
            reject(location, "missing_key", f"record has no key(s) {missing} (keys: {sorted(record)})")
            continue
        raw = record[prompt_key]
        if not isinstance(raw, str) or not raw.strip():
            reject(location, "empty_prompt", f"prompt {prompt_key!r} is empty or not text")
            continue
        text = format_prompt(raw, tokenizer, chat_template=chat_template, system_prompt=system_prompt)
        # A chat template writes its own special tokens (BOS included); plain text gets the tokenizer's.
        ids = tokenizer(text, add_special_tokens=not chat_template).input_ids
        if len(ids) > max_prompt_length:
            reject(location, "too_long", f"prompt has {len(ids)} tokens > data.max_prompt_length={max_prompt_length}")
            continue
        reference = None if not answer_key else (None if record[answer_key] is None else str(record[answer_key]))
        extras = {k: record[k] for k in extra_keys}
        result.prompts.append(Prompt(prompt_ids=ids, text=text, reference=reference, extras=extras, location=location))
    if not result.prompts:
        raise DataError(
            f"{path}: no usable prompts ({result.describe()}); fix: check data.prompt_key and the file's contents"
        )
    return result


def load_data_prompts(path: str | Path, tokenizer, data: DataConfig) -> PromptSet:
    """`load_prompts` with the `data` settings: the one way the run (run/train.py) and its pre-flight
    (run/entry.py) read a prompt file, so the pre-flight measures the prompts the run will train on."""
    return load_prompts(
        path,
        tokenizer,
        prompt_key=data.prompt_key,
        answer_key=data.answer_key,
        extra_keys=list(data.extra_keys),
        chat_template=data.chat_template,
        system_prompt=data.system_prompt,
        max_prompt_length=data.max_prompt_length,
        bad_records=data.bad_records,
    )
