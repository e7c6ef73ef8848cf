"""The plan's table as `python train.py mode=plan` prints it: each section gives its rows, (name, value, unit) each."""

from __future__ import annotations

from typing import Any

Row = tuple[str, Any, str]  # (name, value, unit) of one line of the table


def format_table(rows: list[Row], notes: list[str], warnings: list[str]) -> str:
    """One line per number, its name left-aligned, its value right-aligned, then its unit; the notes and warnings."""
    width = max(len(r[0]) for r in rows)
    lines = ["Step plan", "-" * (width + 30)]
    lines += [f"{name:<{width}}  {value!s:>10}  {unit}" for name, value, unit in rows]
    lines += [f"note: {n}" for n in notes]
    lines += [f"warning: {w}" for w in warnings]
    return "\n".join(lines)
