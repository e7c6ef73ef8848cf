"""The prompt files as `mode=plan` reads them: their records counted without a tokenizer or a model."""

from __future__ import annotations

from pathlib import Path

from lit_ppo.config.data import DataConfig
from lit_ppo.errors import ConfigError


def count_records(path: Path) -> int:
    """Records in a prompt file without tokenizing them (for `mode=plan`)."""
    if path.suffix in (".jsonl", ".json"):
        with open(path, encoding="utf-8") as f:
            return sum(1 for line in f if line.strip())
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    import datasets

    return len(datasets.load_from_disk(str(path)))


def planned_dataset_size(data: DataConfig, prompt_stats=None) -> tuple[int, str]:
    """The number of training prompts: those the pre-flight read as the run reads them (`prompt_stats`, a
    plan.PromptStats: bad records and prompts over data.max_prompt_length left out under data.bad_records=skip),
    else the records of data.path, known before loading any model or tokenizer."""
    if data.source == "arithmetic":
        return data.n_train, "generated arithmetic problems"
    path = Path(data.path)
    if prompt_stats is not None:
        return prompt_stats.count, f"prompts in {path} as the run reads them"
    if path.exists():
        return count_records(path), f"records in {path} (before length filtering)"
    if data.expected_prompts:
        return data.expected_prompts, f"data.expected_prompts ({path} is not on this machine)"
    raise ConfigError(
        f"data.path={path} does not exist; fix: point data.path at your prompt file (or set data.expected_prompts for mode=plan)"
    )
