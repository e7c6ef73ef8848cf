"""The `python train.py ...` commands of README.md and docs/*.md plan as written (issue 55 item 17: README's
`strategy=ddp strategy.devices=8` and its SLURM script's `strategy.devices=...` were refused by the plan or the
pre-flight). Each is composed and planned in this process, as `python train.py <command> mode=plan` does."""

from __future__ import annotations

import re
import shlex

import pytest

from lit_ppo.config import moved_overrides
from lit_ppo.run import entry
from tests.helpers import ROOT, compose_config

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# The shell variables of the docs' batch scripts, as a 2-node, 8-GPU SLURM job would set them.
SHELL = {"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "8", "TRAINER": "node0"}


def documented_commands() -> list[str]:
    """The arguments after `train.py` of each command in a ```bash block (continued lines joined, comments cut) or an
    inline code span, once each, as the shell splits them (SHELL's variables set); sweeps (`-m`), `--help`,
    placeholders (`...`, `<preset>`) and rewards in the user's own `my_project` package are left out."""
    commands = []
    for path in DOCS:
        text = path.read_text()
        lines = [
            re.split(r"\s#", line)[0]
            for block in re.findall(r"```bash\n(.*?)```", text, re.S)
            for line in re.sub(r"\\\n\s*", " ", block).splitlines()
        ]
        lines += re.findall(r"`([^`\n]*train\.py[^`\n]*)`", text)
        for line in lines:
            found = re.search(r"(?:^|\s)train\.py(\s.*)?$", line)
            if not found or any(part in line for part in (" -m ", "--help", "...", "<", "my_project.")):
                continue
            variables_set = re.sub(r"\$(\w+)", lambda m: SHELL.get(m.group(1), m.group(0)), found.group(1) or "")
            command = " ".join(arg for arg in shlex.split(variables_set) if arg != "&")
            if command not in commands:
                commands.append(command)
    return commands


def test_the_docs_commands_are_found():
    commands = documented_commands()
    assert len(commands) > 20
    assert "strategy=ddp strategy.devices=8 ppo.micro_train_batch_size=8" in commands  # README's data-parallel block
    assert "+experiment=qwen7b output_dir=runs/exp1 resume=auto strategy.num_nodes=2 strategy.devices=8" in commands


@pytest.mark.parametrize("command", documented_commands())
def test_a_documented_command_plans_as_written(command, tmp_path):
    args = shlex.split(command)
    # (data.expected_prompts: the docs' prompt files, e.g. gsm8k/train.jsonl, are the user's, not on this machine)
    overrides = [*moved_overrides(args), "mode=plan", f"output_dir={tmp_path}", "++data.expected_prompts=100000"]
    assert entry.main(compose_config(*overrides)) is None
    assert (tmp_path / "plan.json").exists()
