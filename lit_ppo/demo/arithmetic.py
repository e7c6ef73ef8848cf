"""The embedded default task: arithmetic prompts with a verifiable integer answer.

Prompts look like `37+45=` and the expected response is `82` followed by end-of-sequence:
the same shape as a math-RL run (prompt, free-form response, rule-based reward), small
enough to train on a CPU in minutes. Train and evaluation prompts are disjoint.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from lit_ppo.atomic import atomic_path
from lit_ppo.config import DataConfig

OPERATIONS = {"+": lambda a, b: a + b, "*": lambda a, b: a * b}


def make_problems(
    *, seed: int, max_operand: int, n_train: int, n_eval: int, operation: str = "+", min_operand: int = 0
) -> tuple[list[dict], list[dict]]:
    """All `a<operation>b` with min_operand <= a, b <= max_operand, shuffled and split into disjoint train/eval
    records (`operation` + or *; `data.operation`, `data.min_operand`)."""
    if operation not in OPERATIONS:
        raise ValueError(f"data.operation={operation!r}; fix: use one of {', '.join(OPERATIONS)}")
    pairs = [(a, b) for a in range(min_operand, max_operand + 1) for b in range(min_operand, max_operand + 1)]
    if n_train + n_eval > len(pairs):
        raise ValueError(
            f"data.n_train={n_train} + data.n_eval={n_eval} exceeds the {len(pairs)} distinct problems with "
            f"max_operand={max_operand}; fix: lower the counts or raise data.max_operand"
        )
    random.Random(seed).shuffle(pairs)
    compute = OPERATIONS[operation]
    records = [{"prompt": f"{a}{operation}{b}=", "answer": str(compute(a, b))} for a, b in pairs[: n_train + n_eval]]
    return records[:n_train], records[n_train:]


def problems_of(data: DataConfig) -> tuple[list[dict], list[dict]]:
    """The train and eval records that the `data` settings of the arithmetic task describe (`make_problems`)."""
    return make_problems(
        seed=data.seed,
        max_operand=data.max_operand,
        n_train=data.n_train,
        n_eval=data.n_eval,
        operation=data.operation,
        min_operand=data.min_operand,
    )


def write_jsonl(records: list[dict], path: str | Path) -> Path:
    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "w") as f:  # other ranks may be waiting to read it
        for record in records:
            f.write(json.dumps(record) + "\n")
    return path
