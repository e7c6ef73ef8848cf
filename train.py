"""lit-ppo's entry point: `python train.py [overrides]` (Hydra; configs in conf/)."""

import os
import sys

from lit_ppo.topology import launcher_rank

if __name__ == "__main__":
    from lit_ppo.signals import handle_signals_during_imports

    # Before the imports below, which take seconds: SIGTERM, SIGINT and SIGUSR1 while they load end the process with
    # the start-up line and 128 + the signal's number too (not a traceback, or a silent death).
    handle_signals_during_imports(rank_zero=launcher_rank() == 0)

import logging  # noqa: E402

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from lit_ppo.console import setup_logging, show_error  # noqa: E402
from lit_ppo.errors import UserError  # noqa: E402

# hydra.run.dir (conf/config.yaml): the run's output_dir when one is given, so Hydra leaves no empty
# outputs/<date>/<time>/.hydra behind in the working directory; registered before Hydra composes the config.
OmegaConf.register_new_resolver("lit_ppo_run_dir", lambda output_dir, default: output_dir or default, replace=True)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from lit_ppo.run.threads import allowed_cores, use_cpu_threads

    # Before torch loads (the next import): OpenMP reads its settings once. The ranks of a node share its cores, and
    # so do the rollout workers of rollout.mode=disaggregated (they generate while the trainer trains).
    # (A strategy.devices that is not a number is refused later, in one line, by the typed config: 1 until then.)
    devices = str(cfg.strategy.get("devices") or 1)
    local_processes = int(devices) if devices.isdigit() and int(devices) > 0 else 1
    workers_config = cfg.rollout.get("workers")
    if not hasattr(workers_config, "get"):  # `workers: N` in a YAML of the last release (now rollout.workers.count)
        workers_config = {"count": workers_config, "launch": cfg.rollout.get("worker_launch", "spawn")}
    workers = str(workers_config.get("count") or 1)
    # (External workers are the launcher's, on nodes it chose, and given servers the user's: they share out their
    # cores. Servers the trainer spawns run on its node.)
    launch = workers_config.get("launch", "spawn")
    spawned = launch == "spawn" or (launch == "server" and not workers_config.get("server_urls"))
    if cfg.rollout.get("mode") == "disaggregated" and spawned and workers.isdigit():
        local_processes += int(workers)
    threads = use_cpu_threads(local_processes)
    from lit_ppo.config_fields import as_boolean
    from lit_ppo.run.entry import main as run
    from lit_ppo.run.entry import output_dir_of

    # verbose=off is false (a word that is not a boolean is refused by the typed config, in one line, below)
    verbose = as_boolean(cfg.get("verbose", False)) or False
    setup_logging(output_dir_of(cfg), verbose=verbose, rank=launcher_rank())
    logging.getLogger("lit_ppo").info(
        "CPU threads: %d per process (%d cores allowed, %d process(es) on this node, OMP_WAIT_POLICY=%s)",
        threads,
        allowed_cores(),
        local_processes,
        os.environ.get("OMP_WAIT_POLICY")
        or (
            f"(unset: GOMP_SPINCOUNT={os.environ['GOMP_SPINCOUNT']})"
            if "GOMP_SPINCOUNT" in os.environ
            else "(unset: libgomp spins; the cores were free at start)"
        ),
    )
    try:
        run(cfg)
    except UserError as error:
        # A mistake the user can fix: one line, no traceback (the type is in run.log).
        logging.getLogger("lit_ppo").debug("%s: %s", type(error).__name__, error)
        show_error(f"error: {error}")
        sys.exit(2)
    except SystemExit:  # a preempted run (lit_ppo.preemption.Preempted) exits with its status, already reported
        raise
    except BaseException:
        logging.getLogger("lit_ppo.console").exception("the run failed")  # the traceback in run.log too
        raise


if __name__ == "__main__":
    from lit_ppo.config import moved_overrides
    from lit_ppo.run.entry import check_override_keys
    from lit_ppo.signals import Stopped, handle_signals_outside_training

    # SIGTERM, SIGINT and SIGUSR1 before the first rollout step (config, pre-flight, model load, engine start) and
    # after the last: one line and 128 + the signal's number; during the rollout steps lit_ppo.preemption saves first.
    handle_signals_outside_training()
    try:
        # Rollout keys of the last release (`rollout.worker_launch=...`): written with their new keys, announced; one
        # setting given under both keys with two values is refused, and so is a key the config lacks.
        try:
            sys.argv[1:] = moved_overrides(sys.argv[1:])
            check_override_keys(sys.argv[1:])  # a key the config lacks: what it is, not Hydra's "use +"
        except UserError as error:  # before logging is set up: the line on stderr only
            print(f"error: {error}", file=sys.stderr, flush=True)
            sys.exit(2)
        main()
    except Stopped as stopped:
        if launcher_rank() == 0 and not stopped.shown:
            show_error(stopped.line)
        raise
