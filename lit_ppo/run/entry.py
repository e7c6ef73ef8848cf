"""Everything `train.py` does: read the config, state the plan, prepare model and data, train, report."""

from __future__ import annotations

import dataclasses
import logging
import re
import typing
from difflib import get_close_matches
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from lit_ppo.config import RunConfig
from lit_ppo.console import show
from lit_ppo.errors import ConfigError
from lit_ppo.run import user_code
from lit_ppo.run.directories import check_run_directories
from lit_ppo.run.lock import run_lock
from lit_ppo.run.prepare import prepare_run
from lit_ppo.run.report import write_plan

log = logging.getLogger("lit_ppo")


def output_dir_of(cfg: DictConfig) -> Path:
    from hydra.core.hydra_config import HydraConfig

    if cfg.get("output_dir"):
        return Path(cfg.output_dir)
    return Path(HydraConfig.get().runtime.output_dir)


def command_line_keys() -> list[str]:
    """The keys this run's command line set (Hydra's task overrides; none when Hydra did not run the job)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    return [o.lstrip("+").partition("=")[0] for o in HydraConfig.get().overrides.task if not o.startswith("~")]


def timestamped_run_directory(cfg: DictConfig) -> bool:
    """Whether this run writes into a directory Hydra names after the time it starts (no output_dir, and the default
    hydra.run.dir, or hydra.sweep.dir under -m): a new, empty one on every start, which can hold no checkpoint."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    if cfg.get("output_dir") or not HydraConfig.initialized():
        return False
    hydra = HydraConfig.get()
    node = hydra.sweep if hydra.mode == RunMode.MULTIRUN else hydra.run
    return "${now:" in str(OmegaConf.to_container(node, resolve=False).get("dir"))


def check_resume_directory(resume: str | None, timestamped: bool, run_directory: Path) -> None:
    """`resume=auto` in a directory named after the time would find no checkpoint on any start: a requeued job would
    begin again at rollout step 0 every time, and exit 0."""
    if resume == "auto" and timestamped:
        raise ConfigError(
            f"resume=auto without output_dir: this run writes into a new directory named after the time it starts "
            f"({run_directory}), which holds no checkpoint, so every start (every requeue) would begin again at "
            "rollout step 0; fix: give the run a fixed directory, the same on every start: output_dir=runs/<name> "
            "resume=auto"
        )


CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
"""The Hydra configs `train.py` composes (its `config_path`)."""


def compose(*overrides: str) -> DictConfig:
    """The config `python train.py <overrides>` runs, composed by Hydra from conf/ in this process (the tests and the
    benchmarks; `train.py` composes through `hydra.main`)."""
    from hydra import compose as compose_config
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose_config(config_name="config", overrides=list(overrides))


def check_override_keys(overrides: list[str]) -> None:
    """`key=value` of a key the composed config lacks: Hydra answers "To append to your config use +key=value",
    which for a misspelt key (`rollout.tempreature`) only moves the error and for a setting of another group option
    (`data.path` with data=arithmetic) hides it. `train.py` composes the overrides here first, and such a key is
    refused in one line saying what it is; Hydra's other errors are left for Hydra to report."""
    from hydra.errors import ConfigCompositionException

    if any(override.startswith("-") for override in overrides):  # Hydra's flags (-m, --cfg, ...): Hydra's own run
        return
    plain = [override for override in overrides if not override.startswith("hydra/")]  # (a group of Hydra's own)
    try:
        compose(*plain)
    except ConfigCompositionException as error:
        found = re.match(r"Could not override '([^']+)'\.\nTo append to your config use \+", str(error))
        given = [o for o in plain if found and o.partition("=")[0] == found.group(1)]
        if given:
            raise ConfigError(unknown_key_line(given[-1], without(plain, given[-1]))) from None
    except Exception:  # noqa: S110 (Hydra reports it again, in its own words, when train.py composes)
        pass


def without(overrides: list[str], left_out: str) -> dict | None:
    """The config composed without the override `left_out` (as plain values), or None where it does not compose."""
    try:
        return OmegaConf.to_container(compose(*[o for o in overrides if o != left_out]), resolve=False)
    except Exception:
        return None


def unknown_key_line(override: str, composed: dict | None = None) -> str:
    """What the key of `override`, which the config `composed` without it lacks, is, and its fix: a misspelling of a
    setting, a setting of another group option, a setting under a section the config holds as a value (a YAML of
    the last release's `rollout.workers: N`), or a new key under a free-form section (`reward.fn`: `+` adds it)."""
    from lit_ppo.config import MOVED_KEYS, _dataclass_of

    key, _, value = override.partition("=")
    parts = key.split(".")
    for depth in range(1, len(parts)):
        above = ".".join(parts[:depth])
        held = composed
        for part in parts[:depth]:
            held = held.get(part) if isinstance(held, dict) else None
        if held is not None and not isinstance(held, dict):
            if above in MOVED_KEYS:
                new = MOVED_KEYS[above]
                return (
                    f"{override}: a YAML of this run sets {above}: {held}, the last release's key for {new}; fix: "
                    f"write {new} there ({above}: {{{new.rsplit('.', 1)[1]}: {held}}})"
                )
            return f"{override}: a YAML of this run sets {above}: {held}, a value, not a section; fix: remove it there"
    cls = RunConfig
    for depth, name in enumerate(parts):
        prefix = ".".join(parts[:depth])
        names = [f.name for f in dataclasses.fields(cls)]
        if name not in names:
            hints = get_close_matches(name, names, 1)
            if hints:
                right = ".".join([*parts[:depth], hints[0], *parts[depth + 1 :]])
                return f"{key} is not a setting (did you mean {right}?); fix: {right}={value}"
            return f"{key} is not a setting; fix: correct it (the keys of {prefix or 'the root'}: {', '.join(names)})"
        nested = _dataclass_of(typing.get_type_hints(cls)[name])
        if nested is None:
            field_key = ".".join(parts[: depth + 1])
            if field_key != key:  # under a free-form section (reward.fn, strategy.lightning, ...): adding is meant
                return f"{field_key} has no key {key[len(field_key) + 1 :]} here; fix: +{override} adds it"
            break
        cls = nested
    options = [
        f"{parts[0]}={path.stem}"
        for path in sorted((CONF_DIR / parts[0]).glob("*.yaml"))
        if has_key(OmegaConf.to_container(OmegaConf.load(path), resolve=False), parts[1:])
    ]
    if options:
        return (
            f"{key} is a setting of {' and '.join(options)} only, not of this run's {parts[0]} config; fix: "
            f"{options[0]} {override}"
        )
    return f"{key} is a setting this run's config does not list; fix: +{override} adds it"


def has_key(values, parts: list[str]) -> bool:
    """Whether nested dicts `values` hold the key `parts` (`???` counts: the option lists the setting)."""
    for part in parts:
        if not isinstance(values, dict) or part not in values:
            return False
        values = values[part]
    return True


def compose_run_config(*overrides: str) -> RunConfig:
    """The typed settings `python train.py <overrides>` runs."""
    return RunConfig.from_hydra(compose(*overrides))


def run(config: RunConfig, output_dir: Path, engine=None) -> dict | None:
    """From typed settings to a run, the one road: the run directory's check and lock (held while the run lasts:
    lit_ppo/run/lock.py), the run prepared once (`prepare_run`: the pre-flight, the prompts read, the plan);
    `mode=plan` writes the plan and returns None, `mode=eval` evaluates the model (`lit_ppo.run.evaluate.evaluate`)
    and returns eval.json's record, a training run trains (`lit_ppo.run.train.train`) and returns its summary.
    `python train.py` comes here through `main`, and so do the tests' in-process runs of it, with `engine` a vLLM
    engine to share between single-process runs of one architecture."""
    # (train.py's Hydra callback checked them and took the lock before Hydra made the directory; callers without
    # Hydra's run, here: one run per directory at any moment, mode=plan too, which writes plan.json there)
    check_run_directories(output_dir, "output_dir", training=config.mode == "train")
    checkpoint = None  # mode=eval with resume: the checkpoint evaluated, chosen once
    if config.mode == "eval":
        from lit_ppo.run.evaluate import check_evaluation_settings

        checkpoint = check_evaluation_settings(config, output_dir)
    with run_lock(output_dir):
        prepared = prepare_run(config, output_dir)  # the pre-flight, the prompts read and the plan, once
        if config.mode == "plan":
            write_plan(prepared.plan, output_dir, prepared.dataset, prepared.config)
            show(f"plan written to {output_dir / 'plan.json'}")
            return None
        if config.mode == "eval":  # the run's evaluation alone, through the same functions (heavy imports only now)
            from lit_ppo.run.evaluate import evaluate, evaluation_plan

            show(evaluation_plan(prepared, checkpoint))
            return evaluate(prepared.config, output_dir, engine=engine, prepared=prepared, checkpoint=checkpoint)
        from lit_ppo.run.train import train  # heavy imports only when training

        return train(prepared.config, output_dir, engine=engine, prepared=prepared)


def main(cfg: DictConfig) -> dict | None:
    """Entry point behind `python train.py`; returns the summary (None in plan mode; eval.json's record in eval
    mode). The composed Hydra config becomes the typed `RunConfig` here, and nothing below this function reads the
    Hydra config."""
    user_code.make_importable(Path.cwd())  # before the reward's and environment's dotted paths are resolved
    config = RunConfig.from_hydra(cfg, command_line=command_line_keys())
    output_dir = output_dir_of(cfg)
    check_resume_directory(config.resume, timestamped_run_directory(cfg), output_dir)
    return run(config, output_dir)
