"""After a Hydra sweep (`python train.py -m ppo=grpo,ppo seed=0,1`): one table of every job's overrides and results.

Registered in conf/config.yaml under hydra.callbacks; writes sweep_summary.csv and sweep_summary.md
into the sweep directory. Imports nothing heavy: Hydra instantiates it for single runs too.
"""

from __future__ import annotations

import csv
import json
import logging
import re
import sys
from pathlib import Path

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from lit_ppo.atomic import atomic_path, write_text_atomic

log = logging.getLogger("lit_ppo")

SUMMARY_METRICS = [
    "eval_reward_initial",
    "eval_reward_final",
    "reward_final",
    "rollout_steps",
    "optimizer_steps_actor",
    "wall_seconds",
]


def find_job_dirs(sweep_dir: Path) -> list[Path]:
    """Directories under sweep_dir holding a Hydra job (.hydra/overrides.yaml) or a run's summary.json."""
    found = {p.parent.parent for p in sweep_dir.rglob(".hydra/overrides.yaml")}
    found |= {p.parent for p in sweep_dir.rglob("summary.json")}
    found.discard(sweep_dir)  # the sweep's own multirun.yaml lives there, not a job

    def order(path: Path):  # job numbers numerically: 2 before 10
        name = str(path.relative_to(sweep_dir))
        return (0, int(name), "") if name.isdigit() else (1, 0, name)

    return sorted(found, key=order)


def path_list(value) -> list[str]:
    """The analysis notebook's `run_dirs` as a list of paths: a list as it is; a string, as papermill's `-p run_dirs
    '[a, b]'` passes one, read as a YAML list (`[a, b]`, `["a", "b"]`), else one path."""
    if isinstance(value, (str, Path)):
        text = str(value).strip()
        if text.startswith("["):
            parsed = yaml.safe_load(text)
            if isinstance(parsed, list):
                return [str(v) for v in parsed]
        return [text]
    return [str(v) for v in value]


def read_job(job_dir: Path, sweep_dir: Path) -> dict:
    overrides_file = job_dir / ".hydra" / "overrides.yaml"
    overrides = yaml.safe_load(overrides_file.read_text()) if overrides_file.exists() else []
    summary_file, eval_file = job_dir / "summary.json", job_dir / "eval.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    status = "done" if summary else "no summary.json"
    if not summary and eval_file.exists():  # a mode=eval job (lit_ppo/run/evaluate.py): its eval reward, no training
        evaluation = json.loads(eval_file.read_text())
        summary = {
            "eval_reward_final": evaluation["metrics"].get("eval/reward"),
            "wall_seconds": evaluation.get("wall_seconds"),
        }
        status = "evaluated"
    return {
        "job": str(job_dir.relative_to(sweep_dir)),
        "overrides": list(overrides or []),
        "status": status,
        **{key: summary.get(key) for key in SUMMARY_METRICS},
    }


def override_columns(jobs: list[dict]) -> list[str]:
    """The overridden keys, in order of first appearance (`ppo=grpo` -> column `ppo`)."""
    columns: list[str] = []
    for job in jobs:
        for override in job["overrides"]:
            key = override.split("=", 1)[0].lstrip("+")
            if key not in columns:
                columns.append(key)
    return columns


def override_values(job: dict) -> dict[str, str]:
    return {o.split("=", 1)[0].lstrip("+"): (o.split("=", 1)[1] if "=" in o else "") for o in job["overrides"]}


def write_sweep_summary(sweep_dir: Path) -> list[dict]:
    """sweep_summary.csv (one column per overridden key, then the results) and sweep_summary.md."""
    jobs = [read_job(d, sweep_dir) for d in find_job_dirs(sweep_dir)]
    keys = override_columns(jobs)
    columns = ["job", *keys, "overrides", "status", *SUMMARY_METRICS]
    with atomic_path(sweep_dir / "sweep_summary.csv") as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for job in jobs:
            values = override_values(job)
            writer.writerow({**job, **{k: values.get(k, "") for k in keys}, "overrides": " ".join(job["overrides"])})

    def cell(value) -> str:
        if value is None:
            return ""
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    header = ["job", "overrides", "status", *SUMMARY_METRICS]
    lines = [
        f"# Sweep summary: {sweep_dir}",
        "",
        f"{len(jobs)} jobs.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for job in jobs:
        row = [
            job["job"],
            " ".join(f"`{o}`" for o in job["overrides"]),
            job["status"],
            *(cell(job[k]) for k in SUMMARY_METRICS),
        ]
        lines.append("| " + " | ".join(row) + " |")
    write_text_atomic(sweep_dir / "sweep_summary.md", "\n".join(lines) + "\n")
    return jobs


# What differs between the jobs of one sweep besides the swept keys (Hydra sets them per job)
PER_JOB = ("hydra.job.num", "hydra.job.id", "hydra.job.override_dirname", "hydra.sweep.subdir")
# ${key}, ${hydra:key} or a resolver's name (${oc.env:...}); nested interpolations are found on their own
REFERENCE = re.compile(r"\$\{\s*([\w.\-]+)\s*(:?)\s*([\w.\-]*)")


def referenced_keys(text: str) -> set[str]:
    """The config keys an unresolved value reads: `runs/${seed}_${hydra:job.num}` -> {seed, hydra.job.num}."""
    keys = set()
    for name, colon, argument in REFERENCE.findall(text):
        if not colon:
            keys.add(name)
        elif name == "hydra":
            keys.add(f"hydra.{argument}")
    return keys


def keys_read(text: str, config: dict) -> set[str]:
    """Every key an unresolved value reads, through the keys it names (`runs/${name}` with `name: ${ppo.name}_${seed}`
    reads name, ppo.name and seed); `${hydra:runtime.choices.ppo}` reads the config group `ppo`. `config`: the
    unresolved config as a container."""
    found, todo = set(), list(referenced_keys(text))
    while todo:
        key = todo.pop()
        if key in found:
            continue
        found.add(key)
        if key.startswith("hydra.runtime.choices."):
            todo.append(key.removeprefix("hydra.runtime.choices."))
            continue
        value = config
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, str):
            todo.extend(referenced_keys(value))
    return found


def shared_job_directory(config: DictConfig) -> str | None:
    """Why every job of the sweep `config` (as Hydra composed it for on_multirun_start: the swept overrides are in
    hydra.overrides.task, not applied) would write into one directory, in one line with the fix; None where each
    job's differs (it names Hydra's job number or a swept key; a swept output_dir too) or the sweep has one job."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    hydra = OmegaConf.to_container(config.get("hydra") or OmegaConf.create(), resolve=False)
    task = list(hydra.get("overrides", {}).get("task") or [])
    params = (hydra.get("sweeper") or {}).get("params") or {}  # a sweep in the config (the basic sweeper's too)
    sweeps = OverridesParser.create().parse_overrides([*task, *(f"{k}={v}" for k, v in params.items())])
    swept = {o.key_or_group for o in sweeps if o.is_sweep_override()}
    if not swept or "output_dir" in swept:  # one job, or each its own output_dir
        return None
    container = OmegaConf.to_container(config, resolve=False)
    output_dir = container.get("output_dir")
    key, text = (
        ("output_dir", output_dir) if output_dir else ("hydra.sweep.subdir", hydra.get("sweep", {}).get("subdir"))
    )
    if text is None:  # no subdir: Hydra's own default, the job's number
        return None
    per_job = (*PER_JOB, *swept)
    if any(k == p or k.startswith(p + ".") for k in keys_read(str(text), container) for p in per_job):
        return None
    if key == "output_dir":
        fix = (
            "leave output_dir unset so each job writes to its own directory under hydra.sweep.dir, or make it differ "
            f"per job: output_dir='{text}/${{hydra:job.num}}' (or name a swept key, as ${{seed}})"
        )
    else:
        fix = "leave hydra.sweep.subdir at its default (${hydra.job.num}), or make it name a swept key"
    return (
        f"{key}={text} would be shared by every job of this sweep, each overwriting the last (with resume=auto a job "
        f"would take the one before it for its own run and train nothing); fix: {fix}"
    )


class SweepSummary(Callback):
    """Hydra callback: checks that a sweep's jobs write to distinct directories, summarizes the sweep at its end."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        # Before the first job. An exception here would be Hydra's warning, and the sweep would run on: exit instead
        problem = shared_job_directory(config)
        if problem:
            print(f"error: {problem}", file=sys.stderr, flush=True)
            sys.exit(2)

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            log.warning("sweep summary: %s does not exist; nothing to summarize", sweep_dir)
            return
        jobs = write_sweep_summary(sweep_dir)
        print(f"sweep summary of {len(jobs)} jobs: {sweep_dir / 'sweep_summary.md'} (and .csv)", flush=True)
