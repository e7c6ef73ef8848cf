"""Experiment trackers beside metrics.csv: W&B (online with credentials, offline without) and sample tables.

`conf/logger/wandb.yaml` builds the W&B logger with `make_wandb_logger`; `SampleTableLogger` is a
Lightning callback that shows the held-out generations of every evaluation, as a W&B table when a
W&B logger is attached and as a short console table otherwise.
"""

from __future__ import annotations

import logging
import netrc
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import lightning as L
from lightning.pytorch.loggers import WandbLogger

from lit_ppo.atomic import (
    write_text_atomic,
)
from lit_ppo.console import show
from lit_ppo.errors import ConfigError

log = logging.getLogger("lit_ppo")

WANDB_MODES = ("auto", "online", "offline")
SECRET_WORDS = ("key", "token", "secret", "password")
# Hosts whose netrc entry `wandb login` writes: the W&B API and the CoreWeave Forge proxy in front of it.
WANDB_API_HOSTS = ("api.wandb.ai", "api.forge.coreweave.com")


def drop_secrets(config: Any) -> Any:
    """The config without any key whose name contains key/token/secret/password, at any depth.

    Coarse on purpose: losing `data.prompt_key` from the tracker's copy costs nothing (the run
    directory's config.yaml has everything), sending an `api_key` to a server cannot be undone."""
    if isinstance(config, dict):
        return {k: drop_secrets(v) for k, v in config.items() if not any(w in str(k).lower() for w in SECRET_WORDS)}
    if isinstance(config, (list, tuple)):
        return [drop_secrets(v) for v in config]
    return config


def wandb_credentials_available() -> bool:
    """An API key in WANDB_API_KEY or in the netrc file (NETRC, else ~/.netrc) for the W&B server."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    path = Path(os.environ.get("NETRC") or "~/.netrc").expanduser()
    if not path.is_file():
        return False
    try:
        entries = netrc.netrc(str(path))
    except (netrc.NetrcParseError, OSError):
        return False
    hosts = list(WANDB_API_HOSTS)
    if os.environ.get("WANDB_BASE_URL"):
        hosts.insert(0, urlsplit(os.environ["WANDB_BASE_URL"]).netloc)
    return any((entry := entries.authenticators(host)) and entry[2] for host in hosts)


def resolve_wandb_mode(mode: str) -> str:
    """online or offline. `auto`: WANDB_MODE if the user set it, else online exactly when credentials exist."""
    if mode not in WANDB_MODES:
        raise ConfigError(f"logger.extra.mode={mode!r}; fix: use one of {', '.join(WANDB_MODES)}")
    if mode != "auto":
        return mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if wandb_credentials_available() else "offline"


class RolloutWandbLogger(WandbLogger):
    """Lightning's WandbLogger with rollout_step as the x-axis, the run closed at the end of fit, and
    (for mode=auto) an offline fallback when the server cannot be reached."""

    def __init__(self, *args, fallback_offline: bool = False, run_id_file: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._fallback_offline = fallback_offline
        self._run_id_file = run_id_file  # where the started run's id is kept, for a resumed run to continue it
        if self._wandb_init.get("anonymous") is None:  # wandb warns about the setting even when it is None
            self._wandb_init.pop("anonymous", None)

    @property
    def experiment(self):
        starting = self._experiment is None
        try:
            run = WandbLogger.experiment.fget(self)
        except Exception as error:  # wandb.errors.CommError and friends: no server, bad key
            if not (starting and self._fallback_offline):
                raise
            log.warning(
                "wandb: could not start an online run (%s); logging offline instead, upload later with `wandb sync`",
                str(error).splitlines()[0],
            )
            self._wandb_init["mode"] = "offline"
            if self._wandb_init.pop("id", None) is not None:  # the failed online start still holds that id
                self._wandb_init.pop("resume", None)
                self._id = None
                log.warning("wandb: the resumed run cannot be continued offline; logging to a new offline run")
            run = WandbLogger.experiment.fget(self)
        if starting and callable(getattr(run, "define_metric", None)):
            # WandbLogger plots against `trainer/global_step` (our step= argument); every row also carries
            # rollout_step itself, so W&B charts read exactly like metrics.csv, whoever logs in between.
            run.define_metric("rollout_step")
            run.define_metric("*", step_metric="rollout_step", step_sync=True)
        if starting and self._run_id_file and getattr(run, "id", None):
            write_text_atomic(self._run_id_file, f"{run.id}\n")
        return run

    def finalize(self, status: str) -> None:
        super().finalize(status)
        # WandbLogger leaves the run open: the next run in this process (a Hydra sweep) would reuse it.
        if self._experiment is not None and callable(getattr(self._experiment, "finish", None)):
            self._experiment.finish(exit_code=0 if status == "success" else 1)
            self._experiment = None


WANDB_RUN_ID_FILE = "wandb_run_id"  # in the run directory: the W&B run a resumed run continues


def make_wandb_logger(
    save_dir: str,
    project: str = "lit-ppo",
    name: str | None = None,
    mode: str = "auto",
    entity: str | None = None,
    group: str | None = None,
    tags: list[str] | None = None,
    run_config: dict | None = None,
    init_timeout: float = 30.0,
    resume_dir: str | None = None,
    **kwargs,
) -> RolloutWandbLogger:
    """A W&B logger that never waits on a network it was not told to use.

    mode=auto logs online when credentials exist (WANDB_API_KEY or a netrc entry), else offline
    (into save_dir/wandb/, upload later with `wandb sync`); an online start that fails within
    `init_timeout` seconds falls back to offline. `run_config` (the composed config) is recorded
    without secret-looking keys. Other keyword arguments go to `wandb.init`.

    The started run's id is kept in `save_dir/wandb_run_id`; a run resumed from a checkpoint in
    `resume_dir` (the run directory that wrote it) continues that W&B run (`id=`, `resume="allow"`)
    instead of starting another."""
    import wandb

    run_id = None
    if resume_dir is not None and (Path(resume_dir) / WANDB_RUN_ID_FILE).is_file():
        run_id = (Path(resume_dir) / WANDB_RUN_ID_FILE).read_text().strip() or None
    if run_id is not None:  # a fresh run lets W&B choose its id (written to save_dir once the run starts)
        kwargs.update(id=run_id, resume=kwargs.get("resume", "allow"))
        log.info("wandb: continuing run %s", run_id)

    # vLLM imports openai, and wandb then advertises its LLM-tracing product on every run; the user can opt back in.
    os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")
    resolved = resolve_wandb_mode(mode)
    settings = kwargs.pop("settings", None) or wandb.Settings(init_timeout=init_timeout)
    return RolloutWandbLogger(
        save_dir=save_dir,
        project=project,
        name=name,
        entity=entity,
        group=group,
        tags=list(tags or []),
        config=drop_secrets(run_config) if run_config is not None else None,
        mode=resolved,
        settings=settings,
        fallback_offline=(mode == "auto" and resolved == "online"),
        run_id_file=str(Path(save_dir) / WANDB_RUN_ID_FILE),
        **kwargs,
    )


def format_samples(samples: list[dict], max_rows: int = 4, width: int = 40) -> str:
    """A plain-text table of {prompt, response, reward} records."""

    def cell(text: Any) -> str:
        text = str(text).replace("\n", "\\n")
        return text if len(text) <= width else text[: width - 1] + "…"

    rows = [(f"{s['reward']:.2f}", cell(s["prompt"]), cell(s["response"])) for s in samples[:max_rows]]
    widths = [max(len(r[i]) for r in rows + [("reward", "prompt", "response")]) for i in range(3)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(("reward", "prompt", "response"), widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


class SampleTableLogger(L.Callback):
    """After every evaluation, its sample generations: a `wandb.Table` (key eval/samples, with the
    rollout step) for each W&B logger, else a short console table."""

    def __init__(self, max_console_rows: int = 4):
        self.max_console_rows = max_console_rows
        self.logged = 0  # entries of module.eval_history already shown

    def on_train_start(self, trainer, module) -> None:
        # Runs before the module's own on_train_start (the first evaluation); what is already in the history
        # here was restored from a checkpoint and shown by the run that made it.
        self.logged = len(module.eval_history)

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self._log_new(trainer, module)  # the evaluation before any update (the module's on_train_start), before step 1

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self._log_new(trainer, module)

    def on_train_end(self, trainer, module) -> None:
        self._log_new(trainer, module)

    def _log_new(self, trainer, module) -> None:
        evals = module.eval_history
        if not module.topology.is_rank_zero or self.logged >= len(evals):
            return
        wandb_loggers = [lg for lg in trainer.loggers if isinstance(lg, WandbLogger)]
        for entry in evals[self.logged :]:
            samples = entry.get("samples") or []
            if not samples:
                continue
            step = entry["rollout_step"]
            if wandb_loggers:
                import wandb

                rows = [[step, s["prompt"], s["response"], float(s["reward"])] for s in samples]
                for logger in wandb_loggers:
                    table = wandb.Table(columns=["rollout_step", "prompt", "response", "reward"], data=rows)
                    logger.log_metrics({"eval/samples": table, "rollout_step": step}, step=step)
            else:
                show(
                    f"eval samples at rollout step {step} (greedy, eval reward {entry.get('eval/reward', float('nan')):.3f}):\n"
                    + format_samples(samples, self.max_console_rows)
                )
        self.logged = len(evals)
