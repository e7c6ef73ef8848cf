"""Which checkpoint a run resumes from, and whether it may: a checkpoint read for its damage before any model loads
(`checkpoint_problem`), `resume=auto`'s choice of the newest intact one (`resolve_resume`), the lines a run prints
where there is nothing to resume or nothing left to train (`fresh_start_note`, `finished_note`), and the check that
a resumed run is the run its checkpoint was written under (`check_run_directory`): only the run length, the number
of ranks and the fixes the stopping errors name may change (`CHANGEABLE_KEYS`). Writing checkpoints, their names
and their rotation are lit_ppo/checkpoints.py's.
"""

from __future__ import annotations

import collections
import io
import json
import pickle
import zipfile
from pathlib import Path

from lit_ppo.checkpoints import DAMAGED_SUFFIX, list_checkpoints, step_of
from lit_ppo.config import RunConfig, move_keys
from lit_ppo.console import show
from lit_ppo.errors import ConfigError, DirectoryError


class _Anything:
    """Whatever a checkpoint's pickle names (tensors, torch classes, Lightning's objects), read without importing it."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):  # a dict subclass's items (pickle's SETITEMS)
        pass

    def append(self, item):  # a list subclass's items (APPENDS)
        pass

    def extend(self, items):
        pass


class _StateReader(pickle.Unpickler):
    """A torch checkpoint's object record (`data.pkl`) read for its structure only: no class imported, no storage
    read (a tensor is `_Anything`), so a checkpoint of any size is checked in the time of its small record."""

    def find_class(self, module, name):
        return collections.OrderedDict if (module, name) == ("collections", "OrderedDict") else _Anything

    def persistent_load(self, pid):
        return None


def checkpoint_problem(path: Path) -> str | None:
    """Why the file at `path` cannot be resumed from, in words (cut short or damaged inside, or not a lit-ppo
    checkpoint), or None. Read before any model loads, and cheaply: a checkpoint is a zip archive (torch.save's),
    whose directory is at its end, so a file cut short (by a full disk, a killed copy) has none; then its object
    record, for lit-ppo's own state. A file that cannot be read at all (permissions, a file system's error) is no
    damaged checkpoint: that is refused in one line (DirectoryError), never passed over for an older one."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as archive:
            record = next((n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
            if record is None:
                return f"{path.name} is damaged: its zip archive holds no object record (data.pkl)"
            state = _StateReader(io.BytesIO(archive.read(record))).load()
    except zipfile.BadZipFile as e:
        size = path.stat().st_size
        if "directory" in str(e) or "not a zip file" in str(e).lower():
            return (
                f"{path.name} is damaged: its {size} bytes end without the zip directory a checkpoint ends with (cut "
                "short, by a full disk or a killed copy?)"
            )
        return f"{path.name} is damaged ({e})"
    except FileNotFoundError:  # set aside by rank 0 (`resolve_resume`) while another rank looked: passed over there too
        return f"{path.name} is gone (set aside as damaged, or removed, while it was read)"
    except OSError as e:
        raise DirectoryError(
            f"{path}: cannot be read ({e.strerror or type(e).__name__}): not a damaged checkpoint as far as can be told, "
            "so no older one is resumed in its place; fix: make it readable (its permissions, the file system) and start "
            "again"
        ) from None
    except Exception as e:  # the object record cut short or garbled inside: damaged
        return f"{path.name} is damaged ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''})"
    if not isinstance(state, dict) or not {"state_dict", "lit_ppo"} <= state.keys():
        holds = f"the keys {sorted(map(str, state))[:6]}" if isinstance(state, dict) else f"a {type(state).__name__}"
        return (
            f"{path.name} is not a lit-ppo checkpoint (it holds {holds}, no 'lit_ppo' state: another program's file?)"
        )
    return None


def resolve_resume(resume: str | None, directory: Path, announce: bool = False) -> Path | None:
    """`null`: start fresh; `auto`: the newest checkpoint in the run's directory that can be resumed from
    (`checkpoint_problem`), if any, passing over newer ones that cannot (with one warning line where `announce`: a
    requeued job would otherwise fail on the same file on every start); else a path, refused in one line where it
    cannot be resumed from, naming the checkpoint to resume from instead."""
    if resume in (None, "", "none"):
        return None
    if resume == "auto":
        passed_over, damaged = [], []
        for path in reversed(list_checkpoints(directory)):
            problem = checkpoint_problem(path)
            if problem is None:
                if passed_over and announce:  # rank 0: set aside, so that the rotation keeps intact ones and a
                    # requeued job does not pass over it again (renamed, never deleted: the user may want it)
                    for other in damaged:
                        other.rename(other.with_name(other.name + DAMAGED_SUFFIX))
                    show(
                        f"warning: resume=auto: {'; '.join(passed_over)}; set aside as <name>{DAMAGED_SUFFIX}; "
                        f"resuming from {path.name}, the newest intact checkpoint (the rollout steps after "
                        f"{step_of(path)} are trained again)"
                    )
                return path
            passed_over.append(problem)
            damaged.append(path)
        if passed_over:
            shown = "; ".join(passed_over[:3]) + (f"; and {len(passed_over) - 3} more" if len(passed_over) > 3 else "")
            raise ConfigError(
                f"resume=auto: no checkpoint in {directory} can be resumed from: {shown}; fix: put an intact "
                "checkpoint there, or start a new run in another output_dir"
            )
        return None
    path = Path(resume)
    if not path.is_file():
        raise ConfigError(f"resume={resume}: no such checkpoint file; fix: give a .ckpt path or resume=auto")
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ConfigError(f"resume={resume}: {problem}; fix: {_instead(path, Path(directory))}")
    return path


def _instead(path: Path, directory: Path) -> str:
    """The resume that continues from the newest intact checkpoint beside `path` (a damaged one)."""
    for other in reversed(list_checkpoints(path.parent)):
        if other != path and checkpoint_problem(other) is None:
            if path.parent.resolve() == directory.resolve():
                return f"resume=auto, which resumes from {other.name}, the newest intact checkpoint in {directory}"
            return f"resume={other}, the newest intact checkpoint beside it"
    return "resume from another checkpoint of this run, or start a new run in another output_dir"


def fresh_start_note(resume: str | None, output_dir: Path) -> str | None:
    """The line a run with `resume=auto` prints when its directory holds no checkpoint (it then starts at rollout step
    0), saying whether an earlier run wrote there at all (a misspelt output_dir) or stopped before its first
    checkpoint; None otherwise. Read before this run writes its own config.yaml."""
    if resume != "auto" or list_checkpoints(Path(output_dir) / "checkpoints"):
        return None
    if (Path(output_dir) / "config.yaml").is_file():
        found = "holds a run that stopped before its first checkpoint"
    else:
        found = "holds no earlier run (is it the directory of the run to continue?)"
    return (
        f"resume=auto: no checkpoint in {Path(output_dir) / 'checkpoints'}; output_dir={output_dir} {found}; "
        "starting at rollout step 0"
    )


def finished_note(
    resume: str | None, checkpoint: Path | None, total_rollout_steps: int, output_dir: Path
) -> str | None:
    """The line a resumed run prints instead of training when its checkpoint is at or past the run's length and the
    run that wrote it finished there (its summary.json counts the same rollout steps); None when there is something
    left to do. A run killed after its last checkpoint but before its final files is not finished: it resumes, and
    writes them."""
    if checkpoint is None:
        return None
    step = step_of(checkpoint)
    summary = Path(output_dir) / "summary.json"
    if step is None or step < total_rollout_steps or not summary.is_file():
        return None
    try:
        finished_at = json.loads(summary.read_text()).get("rollout_steps")
    except (OSError, ValueError):
        return None
    if finished_at != step:
        return None
    where = (
        f"the end of the run (rollout step {step} of {total_rollout_steps})"
        if step == total_rollout_steps
        else f"rollout step {step}, past the run's length of {total_rollout_steps} rollout steps"
    )
    return (
        f"resume={resume}: {checkpoint.name} is at {where}, and its run finished there ({summary.name}); nothing to "
        "train, exiting; to train longer, raise trainer.total_rollout_steps (or trainer.data_epochs)"
    )


RUN_LENGTH_KEYS = (
    "trainer.total_rollout_steps",
    "trainer.data_epochs",
)
"""What a resumed run may change about the run itself: how long it goes on."""

RESHARD_KEYS = (
    "strategy.devices",
    "strategy.num_nodes",
    "strategy.lightning.data_parallel_size",
    "strategy.context_parallel_size",
)
"""The number of ranks and their groups, which a resumed run may change too (a run moved from 8 GPUs to 4, a requeued
job on another node count, another context-parallel size C): the checkpoint's states are full ones, resharded on load;
the data position and the sampling seeds are global."""

REMEDY_KEYS = (
    "ppo.actor_lr",
    "ppo.critic_lr",
    "ppo.dynamic_sampling.max_generation_rounds",
    "ppo.dynamic_sampling.on_shortfall",
    "rollout.max_logprob_abs_diff",
    "rollout.episodes.check_token_ids",
)
"""The settings that the errors which stop a run with a checkpoint name as their fix ("..., then resume=auto":
NonFiniteUpdatesError, DynamicSamplingShortfallError, RolloutMismatchError): a resumed run may change them, with one
warning line each (`remedy_changes`). Learning rates take effect from the resumed run's first optimizer step
(`training.optim.apply_learning_rates`), the others where they are read, every rollout step."""

UNTRACKED_KEYS = (
    "trainer.eval_every",
    "trainer.checkpoint_every",
    "trainer.keep_checkpoints",
    "trainer.collective_timeout_s",
    "rollout.engine_start_timeout_s",
    "rollout.workers.server_urls",  # where the vLLM servers run (a requeued job gets new ones), not what they serve
    "rollout.workers.trainer_host",  # where the trainer runs (a requeued job may land on another node)
    "rollout.workers.port",
    "resume",
    "output_dir",
    "cache_dir",
    "verbose",
    "mode",
    "logger",
)
"""Keys (or key prefixes) that change what is recorded or where, not what is trained: free on resume too."""


CHANGEABLE_KEYS = RUN_LENGTH_KEYS + RESHARD_KEYS + UNTRACKED_KEYS + REMEDY_KEYS


def _is_among(key: str, keys: tuple[str, ...]) -> bool:
    return any(key == k or key.startswith(k + ".") for k in keys)


def _flat(config, prefix: str = "") -> dict:
    if isinstance(config, dict):
        flat = {}
        for key, value in config.items():
            flat.update(_flat(value, f"{prefix}{key}."))
        return flat or {prefix[:-1]: {}}
    return {prefix[:-1]: config}


def config_differences(saved: dict, current: dict) -> list[str]:
    """`key: saved -> current` for every key that differs between two configs (`RunConfig.to_dict()`s), except the
    run length and the keys that do not change the training."""
    a, b = _flat(saved), _flat(current)
    return [
        f"{key}: {a.get(key, '(absent)')} -> {b.get(key, '(absent)')}"
        for key in sorted(a.keys() | b.keys())
        if a.get(key, _MISSING) != b.get(key, _MISSING) and not _is_among(key, CHANGEABLE_KEYS)
    ]


def remedy_changes(saved: dict, current: dict) -> list[str]:
    """One warning line per REMEDY_KEYS setting that a resumed run changes, with its old and new values."""
    a, b = _flat(saved), _flat(current)
    return [
        f"resume: {key} changed from {a.get(key, '(absent)')} to {b.get(key, '(absent)')} (the fix an error named); "
        "the resumed run trains with the new value"
        for key in REMEDY_KEYS
        if a.get(key, _MISSING) != b.get(key, _MISSING)
    ]


_MISSING = object()


def check_run_directory(config: RunConfig, output_dir: Path) -> None:
    """One run per directory, checked before anything is written into it: a fresh run (`resume` unset) refuses a
    directory that holds checkpoints, and a resumed run refuses a checkpoint written under another config (but
    for the run length) or older than the directory's latest. Rotation keeps the highest step numbers, so a second
    run in the same directory would otherwise lose its own checkpoints and `resume=auto` pick up the first run's."""
    import yaml

    directory = Path(output_dir) / "checkpoints"
    found = list_checkpoints(directory)
    resume = config.resume
    if resume in (None, "", "none"):
        if found:
            raise ConfigError(
                f"output_dir={output_dir} already holds another run's checkpoints (latest {found[-1].name}); "
                "fix: resume=auto to continue that run, or give this run another output_dir"
            )
        return
    path = resolve_resume(resume, directory)
    if path is None:
        return
    named = step_of(path)
    if resume != "auto" and path.parent.resolve() == directory.resolve() and named is not None:
        # (a newer one that cannot be resumed from does not count: resume=auto would pass it over too)
        newer = [p for p in found if step_of(p) > named and checkpoint_problem(p) is None]
        if newer:
            raise ConfigError(
                f"resume={resume} is older than {newer[-1].name} in the same directory, whose rotation would then mix "
                f"two runs; fix: resume=auto, or resume into another output_dir"
            )
    saved_config = path.parent.parent / "config.yaml"  # <run>/checkpoints/<file>.ckpt: its run's config
    if path.parent.name != "checkpoints" or not saved_config.is_file():
        return
    saved = move_keys(yaml.safe_load(saved_config.read_text()), announce=False)  # flat rollout keys of a run before
    differences = config_differences(saved, config.to_dict())
    saved_strategy = _flat(saved).get("strategy.name")
    if saved_strategy is not None and saved_strategy != config.strategy.name:
        # The strategy group's other keys (strategy.lightning.*) follow from its name: the user's setting is the name.
        others = [d for d in differences if not d.startswith("strategy.")]
        also = f", nor {'; '.join(others[:6])}" + (f"; and {len(others) - 6} more" if len(others) > 6 else "")
        raise ConfigError(
            f"resume={resume}: {path.name} was written under strategy={saved_strategy}, this run is "
            f"strategy={config.strategy.name}; the strategy may not change on resume (the number of ranks may)"
            f"{also if others else ''}; fix: resume with {strategy_for_resume(saved_strategy, config.strategy)}"
            f"{f' and the values in {saved_config}' if others else ''}, or start a new run in another output_dir"
        )
    if differences:
        shown = "; ".join(differences[:6]) + (f"; and {len(differences) - 6} more" if len(differences) > 6 else "")
        raise ConfigError(
            f"resume={resume}: {path.name} was written under another config ({shown}); only the run length "
            f"({', '.join(RUN_LENGTH_KEYS)}), the number of ranks ({', '.join(RESHARD_KEYS[:2])}) and the fixes "
            f"errors name ({', '.join(REMEDY_KEYS)}) may change on resume; fix: resume with the values in "
            f"{saved_config}, or start a new run in another output_dir"
        )
    for line in remedy_changes(saved, config.to_dict()):
        show(line)


def strategy_for_resume(saved_strategy: str, strategy) -> str:
    """The command-line settings that resume a checkpoint of `saved_strategy` on this run's ranks (`strategy`'s
    devices and nodes): one process when the checkpoint's strategy is single."""
    if saved_strategy == "single":
        return "strategy=single strategy.devices=1"
    nodes = f" strategy.num_nodes={strategy.num_nodes}" if strategy.num_nodes > 1 else ""
    return f"strategy={saved_strategy} strategy.devices={strategy.devices}{nodes}"
