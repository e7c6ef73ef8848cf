"""Everything `train.py` does: read the config, state the plan, prepare model and data, train, report."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import typing
from difflib import get_close_matches
from pathlib import Path
from types import SimpleNamespace

from omegaconf import DictConfig, OmegaConf

from lit_ppo.config import DataConfig, RunConfig, planned_dataset_size
from lit_ppo.console import show
from lit_ppo.errors import ConfigError
from lit_ppo.plan import LoraTargets, PromptStats, compute_plan
from lit_ppo.run import preflight as checks
from lit_ppo.run.directories import check_run_directories
from lit_ppo.run.lock import run_lock
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


def preflight(config: RunConfig) -> tuple[RunConfig, PromptStats | None, LoraTargets | None]:
    """The pre-flight checks of lit_ppo/run/preflight.py on these settings, before the plan and before any model loads
    (the one place that reads them out of the config). A training run needs the model's files; `mode=plan`
    checks what is on this machine and plans without the rest. Returns the settings with ppo.packing resolved where
    the model's type is known (`checks.resolve_packing`), the training prompts' lengths in tokens that the plan's
    expected tokens per micro-batch rest on (None where the tokenizer or the prompt files are not on this machine),
    and with model.lora the modules it adapts, matched on the model built from its config.json on the meta device
    (None without LoRA, or where config.json is not on this machine). `mode=eval` loads its model as a training run
    does, and is checked as one."""
    training = config.mode != "plan"  # a run that loads the model: mode=train or mode=eval
    rollout, data = config.rollout, config.data
    checks.check_strategy(config.strategy.name, config.strategy.devices, config.strategy.num_nodes)
    if training:
        checks.check_accelerator(config.strategy.accelerator, config.strategy.devices, config.strategy.name)
    environment = rollout.episodes.environment
    checks.check_environment_turns(environment is not None, rollout.episodes.max_turns)
    if environment is not None and environment.get("_target_"):
        environment_class = checks.resolve_target(environment["_target_"], "rollout.episodes.environment")
        arguments = {k: v for k, v in environment.items() if not k.startswith("_")}
        checks.check_environment_convention(environment_class, arguments, str(environment["_target_"]))
    spec = config.reward.fn
    target = checks.resolve_target(spec.get("_target_"), "reward.fn")
    bound = {k: v for k, v in spec.items() if not k.startswith("_")}
    name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', spec['_target_'])}"
    checks.check_bound_keywords(target, bound, partial=bool(spec.get("_partial_")), name=name)
    checks.check_reward_convention(
        checks.call_parameters(target, bound, partial=bool(spec.get("_partial_"))),
        name,
        config.reward.signature,
        data.answer_key,
        list(data.extra_keys),
    )
    files = []
    if data.source == "file":
        files = [
            (Path(path), f"data.{key}") for key, path in (("path", data.path), ("eval_path", data.eval_path)) if path
        ]
        for path, key in files:
            if path.is_file() and path.suffix in (".jsonl", ".json", ".gz"):
                checks.check_utf8(path, key)

    tokenizer, max_positions, positions_source, model_type = None, None, "", None
    architecture, model_name = None, ""  # a transformers config, or the directory of config.json
    if config.model.path:
        model = checks.find_model_files(config.model.path, required=training, offline=checks.hub_offline())
        if model is not None:
            max_positions, positions_source = model.max_positions, model.source
            model_type = model.config.get("model_type")
            architecture, model_name = model.directory, f"model.path={config.model.path} ({model.source})"
            from transformers import AutoTokenizer

            try:  # a hub model's tokenizer by its name when training (fetched as the run would); else what is here
                tokenizer = AutoTokenizer.from_pretrained(
                    config.model.path if training and not model.local else model.directory
                )
            except Exception as e:
                if training:
                    raise ConfigError(
                        f"model.path={config.model.path}: its tokenizer cannot be loaded "
                        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); fix: save the tokenizer "
                        "beside the model (tokenizer.save_pretrained)"
                    ) from None
    elif config.model.tiny is not None:  # the tiny model: its shape is in the config and its tokenizer is built
        from lit_ppo.demo.tiny import build_char_tokenizer, tiny_config

        tokenizer = build_char_tokenizer()
        max_positions, positions_source = config.model.tiny.max_position_embeddings, "model.tiny"
        model_type = "qwen2"  # lit_ppo.demo.tiny builds a Qwen2 model
        architecture = tiny_config(tokenizer, **dataclasses.asdict(config.model.tiny))
        model_name = "the tiny model (model.tiny)"
    if tokenizer is not None:
        note = checks.pad_token_note(config.model.path or "the tiny model", tokenizer.pad_token, tokenizer.eos_token)
        if note:
            show(note)

    longest, prompt_stats = None, None
    if tokenizer is not None and (data.source == "arithmetic" or all(path.exists() for path, _ in files)):
        train_lengths, longest, notes = prompt_lengths(data, tokenizer, [path for path, _ in files])
        prompt_stats = PromptStats.of(train_lengths)
        for note in notes:
            show(note)
    if environment is not None:
        response_key = (
            "rollout.episodes.max_tokens"
            if rollout.episodes.max_tokens
            else "rollout.episodes.max_turns x max_response_tokens"
        )
    else:
        response_key = "rollout.max_response_tokens"
    checks.check_lengths(
        max_model_len=rollout.max_model_len,
        max_positions=max_positions,
        positions_source=positions_source,
        response_tokens=rollout.response_budget_tokens(),
        response_key=response_key,
        longest_prompt=longest,
    )
    if training:
        checks.check_attention(config.model.attn_implementation, config.strategy.accelerator)
    packing = checks.resolve_packing(config.ppo.packing, model_type)
    shared_prefix = config.ppo.shared_prefix
    if packing is not False and architecture is not None:  # the layout exact for this model, or off (null)
        # config.json read as it is (no transformers import in mode=plan): the layout reads model_type and its windows
        model_config = architecture
        if not hasattr(architecture, "model_type"):
            model_config = SimpleNamespace(**json.loads((Path(architecture) / "config.json").read_text()))
        shared_prefix = checks.resolve_shared_prefix(shared_prefix, model_config, config.model.attn_implementation)
    lora, lora_targets = config.model.lora, None
    if lora.enabled and architecture is None:
        show(
            f"LoRA targets: model.lora.target_modules={lora.target_modules} not matched on the model here (its "
            "config.json is not on this machine); a run matches them before its model loads"
        )
    elif lora.enabled:
        lora_targets = checks.lora_targets(
            checks.meta_model(architecture, model_name), lora.target_modules, lora.rank, model_name
        )
    ppo = dataclasses.replace(config.ppo, packing=packing, shared_prefix=shared_prefix)
    return dataclasses.replace(config, ppo=ppo), prompt_stats, lora_targets


def prompt_lengths(
    data: DataConfig, tokenizer, paths: list[Path]
) -> tuple[list[int], tuple[int, str] | None, list[str]]:
    """The training prompts' lengths in tokens as the run will see them (after the chat template, within
    data.max_prompt_length under data.bad_records), the longest prompt of all (training and held-out ones) with
    where it is, and the notes on repeated prompts (`repetition_notes`). `paths`: data.path first, then
    data.eval_path if set. A file's prompts are streamed (`iter_prompts`, the run's reading and filtering): only
    their lengths and digests are kept."""
    from lit_ppo.rollout.prompts import (
        data_prompt_settings,
        format_prompt,
        iter_prompts,
        prompt_digest,
        repetition_notes,
    )

    chat = data.chat_template
    if data.source == "arithmetic":
        from lit_ppo.demo.arithmetic import problems_of

        try:
            train, evaluation = problems_of(data)
        except ValueError as e:  # its messages name the data keys and the fix
            raise ConfigError(str(e)) from e
        texts = [
            format_prompt(r["prompt"], tokenizer, chat_template=chat, system_prompt=data.system_prompt)
            for r in train + evaluation
        ]
        lengths = [len(tokenizer(t, add_special_tokens=not chat).input_ids) for t in texts]
        longest = max(((n, f"the arithmetic prompt {t!r}") for n, t in zip(lengths, texts)), default=None)
        return lengths[: len(train)], longest, []
    if not paths:
        return [], None, []
    # the same reading and filtering as the run's (run/train.py:load_prompt_sets), keeping lengths and digests only
    names = [f"{key}={path}" for key, path in zip(("data.path", "data.eval_path"), paths)]
    lengths, digests, longest = [[] for _ in paths], [[] for _ in paths], None
    for i, path in enumerate(paths):
        for prompt in iter_prompts(path, tokenizer, name=names[i], **data_prompt_settings(data)):
            lengths[i].append(len(prompt.prompt_ids))
            digests[i].append(prompt_digest(prompt))
            longest = max(longest or (0, ""), (len(prompt.prompt_ids), prompt.location))
    notes = repetition_notes(digests[0], digests[1] if len(paths) > 1 else None, *names)
    return lengths[0], longest, notes


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
    lit_ppo/run/lock.py), the pre-flight, the plan; `mode=plan` writes the plan and returns None, `mode=eval`
    evaluates the model (`lit_ppo.run.evaluate.evaluate`) and returns eval.json's record, a training run trains
    (`lit_ppo.run.train.train`) and returns its summary.
    `python train.py` comes here through `main`, and so do the tests' in-process runs of it, with `engine` a vLLM
    engine to share between single-process runs of one architecture."""
    # (train.py's Hydra callback checked them and took the lock before Hydra made the directory; callers without
    # Hydra's run, here: one run per directory at any moment, mode=plan too, which writes plan.json there)
    check_run_directories(output_dir, "output_dir", training=config.mode == "train")
    if config.mode == "eval":
        from lit_ppo.run.evaluate import check_evaluation_settings

        check_evaluation_settings(config, output_dir)
    with run_lock(output_dir):
        config, prompt_stats, lora_targets = preflight(config)
        size, source = planned_dataset_size(config.data, prompt_stats)
        plan = compute_plan(config, size, prompt_stats, lora_targets)
        if config.mode == "plan":
            write_plan(plan, output_dir, source, config)
            show(f"plan written to {output_dir / 'plan.json'}")
            return None
        if config.mode == "eval":  # the run's evaluation alone, through the same functions (heavy imports only now)
            from lit_ppo.run.evaluate import evaluate, evaluation_plan

            show(evaluation_plan(config, plan, output_dir))
            return evaluate(config, output_dir, engine=engine, lora_targets=lora_targets)
        from lit_ppo.run.train import train  # heavy imports only when training

        return train(config, output_dir, engine=engine, lora_targets=lora_targets)


def main(cfg: DictConfig) -> dict | None:
    """Entry point behind `python train.py`; returns the summary (None in plan mode; eval.json's record in eval
    mode). The composed Hydra config becomes the typed `RunConfig` here, and nothing below this function reads the
    Hydra config."""
    checks.make_importable(Path.cwd())  # before the reward's and environment's dotted paths are resolved
    config = RunConfig.from_hydra(cfg, command_line=command_line_keys())
    output_dir = output_dir_of(cfg)
    check_resume_directory(config.resume, timestamped_run_directory(cfg), output_dir)
    return run(config, output_dir)
