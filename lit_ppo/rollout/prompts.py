"""Prompt datasets: local JSONL, Parquet or `datasets.save_to_disk` folders, tokenized once.

Bad records (empty prompt, missing key, prompt longer than `max_prompt_length` tokens) follow the
user's policy: `error` stops with the file and line, `skip` drops them and counts each reason. A file is read as a
stream (`iter_prompts`), tokenized in batches, with its progress on the console when it takes more than a few seconds:
the pre-flight (`run/prepare.py:read_prompts`) keeps only the prompts' lengths in `mode=plan`, and for a run the prompts
themselves, from the same single read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from lit_ppo.config import DataConfig, RolloutConfig
from lit_ppo.console import SHOWN
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


GZIP_MAGIC = b"\x1f\x8b"  # the first two bytes of every gzip file


def check_not_gzip(path: Path, key: str | None = None) -> None:
    """A prompt file that is gzip-compressed (its first bytes 1f 8b, whatever its name says) is refused in one line
    with the command that decompresses it: read as text it would be "not UTF-8" or malformed JSON. The readers take
    .jsonl, .parquet and `datasets` folders, not compressed files."""
    if path.is_dir():
        return
    with open(path, "rb") as f:
        if f.read(2) != GZIP_MAGIC:
            return
    where = f"{key}={path}" if key else str(path)
    if path.suffix == ".gz":
        fix = f"`gunzip -k {path}` and point at the {Path(path.stem).suffix or '.jsonl'} file it writes"
    else:  # a compressed file under a text file's name
        fix = f"`mv {path} {path}.gz && gunzip {path}.gz` (the decompressed file keeps its name)"
    raise DataError(
        f"{where}: the file is gzip-compressed (it starts with the gzip bytes 1f 8b), not {path.suffix or 'JSONL'} "
        f"text; fix: decompress it, e.g. {fix}"
    )


def check_utf8(path: Path, key: str | None = None) -> None:
    """A text prompt file (JSONL) must be UTF-8: the first line that is not, named as file:line. A gzip-compressed
    file (under any name) is named as such, with the command that decompresses it. `key`: the setting that names the
    file (data.path)."""
    check_not_gzip(path, key)
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path}:{line_no}: not UTF-8 (byte 0x{line[e.start]:02x} at column {e.start + 1}; {key}); fix: "
                    "re-encode the file as UTF-8, e.g. `iconv -f latin1 -t utf-8 in.jsonl > out.jsonl`"
                ) from None


def _read_records(path: Path, key: str | None = None) -> Iterator[tuple[str, dict]]:
    """Yield (location, record); location names the file and line (or row) for messages. `key`: the setting that
    names the file (data.path), for the refusal of a compressed or non-UTF-8 file."""
    check_not_gzip(path, key)
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
            try:
                for line_no, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    line = line.rstrip("\r\n")  # a column past the record's end is on its own line, not the next
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(
                            f"{path}:{line_no}:{e.colno}: malformed JSON ({e.msg} at line {line_no}, column "
                            f"{e.colno}: {_around(line, e.pos)!r}); fix: repair that record (a JSONL file holds one "
                            "JSON object per line)"
                        ) from e
                    if not isinstance(record, dict):
                        raise DataError(
                            f"{path}:{line_no}: expected a JSON object, got {type(record).__name__}; fix: one object "
                            "per line"
                        )
                    yield f"{path}:{line_no}", record
            except UnicodeDecodeError:  # not UTF-8: its first such line named (the bytes scanned on this error only)
                check_utf8(path, key)
                raise
    else:
        raise ConfigError(
            f"data: cannot read {path} (suffix {path.suffix!r}); fix: use .jsonl, .parquet or a `datasets` save_to_disk folder"
        )


def _around(line: str, position: int, width: int = 20) -> str:
    """The text of `line` around a character position, for a message."""
    return line[max(0, position - width) : position + width]


def records_estimate(path: Path) -> int | None:
    """About how many records `path` holds, cheaply: a JSONL file's lines (blank ones too), a Parquet file's rows
    (its metadata); None for a `datasets` folder. For the progress line only."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    if path.is_dir():
        return None
    lines, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            lines, last = lines + chunk.count(b"\n"), chunk[-1:]
    return lines + (last != b"\n")


PROGRESS_AFTER_S = 5.0  # a read shorter than this prints nothing


class ReadingProgress:
    """`reading data.path=train.jsonl: 120,000 of ~200,000 records (5 s)`: one console line, drawn once a read has
    taken PROGRESS_AFTER_S seconds, redrawn in place at most once a second, and left with the read's last count when
    it ends (that line also in run.log). `estimate` (`records_estimate`) is called only when the line is first drawn."""

    def __init__(self, what: str, estimate: Callable[[], int | None]):
        self.what, self.estimate = what, estimate
        self.started = time.monotonic()
        self.drawn: float | None = None  # when the line was last drawn
        self.total: int | None = None

    def line(self, records: int) -> str:
        of = f" of ~{self.total:,}" if self.total else ""
        return f"reading {self.what}: {records:,}{of} records ({time.monotonic() - self.started:.0f} s)"

    def update(self, records: int) -> None:
        now = time.monotonic()
        if now - self.started < PROGRESS_AFTER_S or (self.drawn is not None and now - self.drawn < 1.0):
            return
        if self.drawn is None:
            self.total = self.estimate()
        self.drawn = now
        sys.stdout.write("\r" + self.line(records))
        sys.stdout.flush()

    def close(self, records: int) -> None:
        if self.drawn is not None:
            line = self.line(records)
            sys.stdout.write("\r" + line + "\n")
            sys.stdout.flush()
            logging.getLogger(SHOWN).info(line)  # run.log's copy (lit_ppo.console.show's logger)


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


TOKENIZE_BATCH = 1024  # prompts tokenized in one call: a fast tokenizer encodes a batch on every core


def resolve_stop_token_ids(rollout: RolloutConfig, tokenizer, chat_template: bool) -> list[int]:
    """rollout.stop_token_ids, plus the chat template's end-of-turn token when prompts use the template."""
    ids = [int(i) for i in rollout.stop_token_ids]
    if chat_template and rollout.stop_at_end_of_turn:
        ids += [i for i in end_of_turn_token_ids(tokenizer) if i not in ids]
    return ids


class _PromptBatches:
    """`iter_prompts`' records tokenized a batch at a time, the bad ones following `bad_records` (`error` stops at the
    first in file order, `skip` counts each reason in `skipped`); `usable` counts the prompts given."""

    def __init__(self, tokenizer, *, answer_key, extra_keys, chat_template, max_prompt_length, bad_records, skipped):
        self.tokenizer, self.answer_key, self.extra_keys = tokenizer, answer_key, extra_keys
        self.chat_template, self.max_prompt_length = chat_template, max_prompt_length
        self.bad_records, self.skipped = bad_records, skipped
        self.usable = 0

    def reject(self, location: str, reason: str, detail: str) -> None:
        if self.bad_records == "error":
            raise DataError(f"{location}: {detail}; fix: repair the record or set data.bad_records=skip")
        self.skipped[reason] += 1

    def tokenized(self, batch: list[tuple[str, str | None, Any]]) -> Iterator[Prompt]:
        """`batch`: per record in file order, (location, its text, the record), or (location, None, (reason,
        detail)) for a record rejected before tokenizing."""
        texts = [text for _, text, _ in batch if text is not None]
        # A chat template writes its own special tokens (BOS included); plain text gets the tokenizer's.
        encoded = (
            self.tokenizer(texts, add_special_tokens=not self.chat_template, return_attention_mask=False)
            if texts
            else None
        )
        ids_of = iter(encoded.input_ids if encoded is not None else [])
        answer_key, limit = self.answer_key, self.max_prompt_length
        for location, text, record in batch:
            if text is None:
                self.reject(location, *record)
                continue
            ids = next(ids_of)
            if len(ids) > limit:
                self.reject(location, "too_long", f"prompt has {len(ids)} tokens > data.max_prompt_length={limit}")
                continue
            reference = None if not answer_key else (None if record[answer_key] is None else str(record[answer_key]))
            extras = {k: record[k] for k in self.extra_keys}
            self.usable += 1
            yield Prompt(prompt_ids=ids, text=text, reference=reference, extras=extras, location=location)


def _missing_keys(location: str, record: dict, first: bool, prompt_key, answer_key, extra_keys) -> list[str]:
    """The keys `record` lacks; missing from the `first` record, a key names a setting that names no field:
    ConfigError."""
    missing = [k for k in [prompt_key, answer_key, *extra_keys] if k and k not in record]
    if missing and first:
        settings = {prompt_key: "data.prompt_key", answer_key: "data.answer_key"}
        named = ", ".join(f"{settings.get(k, 'data.extra_keys')}={k!r}" for k in missing)
        raise ConfigError(
            f"{location}: {named} is not a field of the records (the first has {sorted(record)}); fix: set "
            f"{settings.get(missing[0], 'data.extra_keys')} to the field that holds it"
        )
    return missing


def _pending_record(
    location: str, record: dict, missing: list[str], tokenizer, prompt_key: str, **formatting
) -> tuple[str, str | None, Any]:
    """One record read, as `_PromptBatches.tokenized` takes it: its formatted prompt (`formatting`: chat_template,
    system_prompt), or why it is rejected."""
    raw = record.get(prompt_key)
    if missing:
        return location, None, ("missing_key", f"record has no key(s) {missing} (keys: {sorted(record)})")
    if not isinstance(raw, str) or not raw.strip():
        return location, None, ("empty_prompt", f"prompt {prompt_key!r} is empty or not text")
    return location, format_prompt(raw, tokenizer, **formatting), record


def iter_prompts(
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
    skipped: Counter | None = None,
    name: str = "",
    generated: list[dict] | None = None,
) -> Iterator[Prompt]:
    """The usable prompts of `path` in file order, streamed: read, formatted and tokenized TOKENIZE_BATCH records at a
    time, so that a caller that keeps only their lengths holds one batch. Bad records follow `bad_records`: `error`
    stops at the first in file order, `skip` counts each reason in `skipped`; DataError where none is usable. `name`
    (`data.path=...`) names the file on the progress line of a long read. `generated`: the file's records, given in
    place of reading it (the arithmetic task's; the run writes them to `path`, one a line), named by their lines."""
    if bad_records not in ("error", "skip"):
        raise ConfigError(f"data.bad_records={bad_records!r}; fix: use 'error' or 'skip'")
    path = Path(path)
    if generated is None and not path.exists():
        raise ConfigError(
            f"data: file {path} does not exist; fix: set data.path (or data.eval_path) to an existing file"
        )
    skipped = Counter() if skipped is None else skipped
    batches = _PromptBatches(
        tokenizer,
        answer_key=answer_key,
        extra_keys=extra_keys,
        chat_template=chat_template,
        max_prompt_length=max_prompt_length,
        bad_records=bad_records,
        skipped=skipped,
    )
    formatting = dict(chat_template=chat_template, system_prompt=system_prompt)
    if generated is None:
        key = name.partition("=")[0] if name else None  # data.path=...: the setting, for a refusal of the file
        read, estimate = _read_records(path, key), lambda: records_estimate(path)
    else:
        read, estimate = ((f"{path}:{i}", r) for i, r in enumerate(generated, start=1)), lambda: len(generated)
    progress = ReadingProgress(name or str(path), estimate)
    pending, records = [], 0  # records read and not yet tokenized; records read
    try:
        for location, record in read:
            missing = _missing_keys(location, record, not records, prompt_key, answer_key, extra_keys)
            records += 1
            pending.append(_pending_record(location, record, missing, tokenizer, prompt_key, **formatting))
            if len(pending) == TOKENIZE_BATCH:
                batch, pending = pending, []
                yield from batches.tokenized(batch)
                progress.update(records)
    except DataError:
        # A line that cannot be read (malformed JSON): the bad records before it, not yet tokenized, are named first.
        batch, pending = pending, []
        yield from batches.tokenized(batch)
        raise
    finally:
        progress.close(records)
    yield from batches.tokenized(pending)
    if not batches.usable:
        described = PromptSet([], str(path), skipped).describe()
        raise DataError(f"{path}: no usable prompts ({described}); fix: check data.prompt_key and the file's contents")


def load_prompts(path: str | Path, tokenizer, **settings) -> PromptSet:
    """The usable prompts of `path` (`iter_prompts`, with its settings), kept, with the bad records skipped."""
    skipped = Counter()
    prompts = list(iter_prompts(path, tokenizer, skipped=skipped, **settings))
    return PromptSet(prompts=prompts, source=str(path), skipped=skipped)


def data_prompt_settings(data: DataConfig) -> dict:
    """`iter_prompts`' settings of the `data` section."""
    return dict(
        prompt_key=data.prompt_key,
        answer_key=data.answer_key,
        extra_keys=list(data.extra_keys),
        chat_template=data.chat_template,
        system_prompt=data.system_prompt,
        max_prompt_length=data.max_prompt_length,
        bad_records=data.bad_records,
    )


def load_data_prompts(path: str | Path, tokenizer, data: DataConfig, name: str = "") -> PromptSet:
    """`load_prompts` with the `data` settings: one file's prompts as a run reads them (`run/prepare.py:read_prompts`,
    which reads a run's files once through `iter_prompts` with the same settings, for the run and its plan)."""
    return load_prompts(path, tokenizer, name=name, **data_prompt_settings(data))


def prompt_digest(prompt: Prompt) -> bytes:
    """What makes two prompts the same: the text the model sees (after the chat template), as a 16-byte digest (a set
    of 200,000 holds about 15 MB where their texts would hold 50)."""
    return hashlib.blake2b(prompt.text.encode(), digest_size=16).digest()


def repetition_notes(
    train: Iterable[bytes], evaluation: Iterable[bytes] | None, train_name: str, eval_name: str = ""
) -> list[str]:
    """The console's notes on repeated prompts (`prompt_digest`s, in file order): training prompts that repeat an
    earlier one (drawn as often as they appear), and evaluation prompts that are also training prompts (their
    held-out scores are then of prompts trained on). None is an error: a dataset may repeat prompts on purpose."""
    seen: set[bytes] = set()
    count = repeats = 0
    for digest in train:
        count += 1
        repeats += digest in seen
        seen.add(digest)
    notes = []
    if repeats:
        notes.append(
            f"{train_name}: {repeats:,} of {count:,} training prompts repeat an earlier one (the same text as the model "
            "sees it); each copy is drawn as a prompt of its own"
        )
    if evaluation is not None:
        evaluation = list(evaluation)
        shared = sum(digest in seen for digest in evaluation)
        if shared:
            notes.append(
                f"{eval_name}: {shared:,} of {len(evaluation):,} evaluation prompts are also training prompts "
                f"({train_name}): their held-out scores are of prompts the run trains on; fix: leave them out of one "
                "of the two files"
            )
    return notes
