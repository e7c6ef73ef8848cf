"""The `data` section: the training and held-out prompts (lit_ppo/config/prompt_files.py counts a prompt file's
records for the plan)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lit_ppo.config_fields import at_least
from lit_ppo.errors import ConfigError


@dataclass(frozen=True)
class DataConfig:
    """The `data` group: the training and held-out prompts (generated arithmetic problems, or the user's files)."""

    source: str = "arithmetic"
    """arithmetic (generated problems) or file."""
    seed: int = 0
    """arithmetic: the problems' seed."""
    max_operand: int = 49
    n_train: int = 2000
    n_eval: int = 200
    operation: str = "+"
    min_operand: int = 0
    path: str | None = None
    """file: the training prompts (JSONL, Parquet or a `datasets` folder)."""
    eval_path: str | None = None
    """file: the held-out prompts; null: no evaluation."""
    prompt_key: str = "prompt"
    answer_key: str | None = "answer"
    extra_keys: list[str] = field(default_factory=list)
    chat_template: bool = False
    system_prompt: str | None = None
    max_prompt_length: int = field(default=32, metadata=at_least(1))
    """Tokens (after the chat template); longer prompts follow bad_records."""
    bad_records: str = "error"
    """error: stop at the first bad record (file and line); skip: drop and count them."""
    expected_prompts: int | None = field(default=None, metadata=at_least(1))
    """mode=plan on a machine without data.path: the number of training prompts."""

    def __post_init__(self) -> None:
        if self.source not in ("arithmetic", "file"):
            raise ConfigError(f"data.source={self.source!r}; fix: use 'arithmetic' or 'file'")
        if self.source == "file" and not self.path:
            raise ConfigError(
                "data.path is not set; fix: data.path=<your prompt file> (JSONL, Parquet or a datasets folder)"
            )
        if self.bad_records not in ("error", "skip"):
            raise ConfigError(f"data.bad_records={self.bad_records!r}; fix: use 'error' or 'skip'")
