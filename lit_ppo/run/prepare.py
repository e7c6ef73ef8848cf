"""The run prepared once (`prepare_run`): the pre-flight's checks (lit_ppo/run/preflight.py), the prompts read and the
plan computed, before any model loads, handed as a `PreparedRun` to the training run (`lit_ppo.run.train.train`) or
the evaluation (`lit_ppo.run.evaluate.evaluate`), which neither read the prompts nor plan again.

`mode=plan` streams the prompt files and keeps their lengths (a file of millions of prompts is never held); a run
keeps the prompts themselves from that same single read. Under data parallelism every rank is a copy of the command
(Lightning's launcher) and prepares its own run, once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from lit_ppo.config import DataConfig, RunConfig, planned_dataset_size
from lit_ppo.config.strategy import check_context_parallel_model
from lit_ppo.console import show
from lit_ppo.errors import ConfigError
from lit_ppo.plan import LoraTargets, PromptStats, StepPlan, compute_plan
from lit_ppo.rollout.prompts import PromptSet, check_utf8
from lit_ppo.run import preflight as checks
from lit_ppo.run import user_code
from lit_ppo.run.teacher_preflight import check_teacher, teacher_layout
from lit_ppo.topology import check_launched_ranks

log = logging.getLogger("lit_ppo")

DATA_FOLDERS = {"train": "data", "eval": "eval_data"}
"""Where in the run's directory a run writes the arithmetic task's prompts (mode=eval: beside eval.json, not in data/:
its output_dir may be a training run's own)."""


@dataclass(frozen=True)
class PromptsRead:
    """What the one read of the prompts yields: the training prompts' lengths in tokens (the plan's), the longest
    prompt of all with where it is (`checks.check_lengths`), the notes on repeated prompts, and for a run the prompts
    themselves (None in `mode=plan`, which keeps the lengths only)."""

    lengths: list[int]
    longest: tuple[int, str] | None
    notes: list[str]
    train: PromptSet | None = None
    evaluation: PromptSet | None = None  # None also where the run has no held-out prompts (data.eval_path unset)
    records: tuple[list[dict], list[dict]] | None = None  # the arithmetic task's (train, eval) records, generated


@dataclass(frozen=True)
class Checked:
    """What the pre-flight (`preflight`) hands on: the settings it resolved, and what it read to check them."""

    config: RunConfig  # ppo.packing and ppo.shared_prefix resolved where the model's type is known
    tokenizer: Any | None  # None where neither the tiny model nor the model's tokenizer files are on this machine
    prompts: PromptsRead | None  # None where the tokenizer or the prompt files are not on this machine
    lora_targets: LoraTargets | None

    @property
    def prompt_stats(self) -> PromptStats | None:
        return PromptStats.of(self.prompts.lengths) if self.prompts else None


@dataclass(frozen=True)
class PreparedRun:
    """A run prepared once, before any model loads (`prepare_run`): what the training run and the evaluation start
    from instead of reading the prompts and planning again."""

    config: RunConfig  # as the pre-flight resolved it
    plan: StepPlan
    dataset: str  # the training prompts in words, for the plan's title
    lora_targets: LoraTargets | None = None
    tokenizer: Any = None  # the tokenizer the prompts were read with (a run's; None in mode=plan where none is here)
    train_prompts: PromptSet | None = None  # None in mode=plan
    eval_prompts: PromptSet | None = None
    records: tuple[list[dict], list[dict]] | None = None  # the arithmetic task's (train, eval) records


def prepare_run(config: RunConfig, output_dir: Path) -> PreparedRun:
    """The pre-flight (`preflight`), then the one plan: of the prompts the run reads (their number and lengths after
    data.bad_records, as the pre-flight read them), or in `mode=plan` of their lengths (or of what is known without
    them: `planned_dataset_size`). A ConfigError names what is wrong before any model loads."""
    checked = preflight(config, output_dir)
    config, prompts = checked.config, checked.prompts
    stats = checked.prompt_stats
    if prompts is not None and prompts.train is not None:  # a run: the prompts it trains on, as it reads them
        size, dataset = len(prompts.train), prompts.train.describe()
    else:  # mode=plan (a run's data.path not on this machine is refused here)
        size, dataset = planned_dataset_size(config.data, stats)
    plan = compute_plan(config, size, stats, checked.lora_targets)
    return PreparedRun(
        config=config,
        plan=plan,
        dataset=dataset,
        lora_targets=checked.lora_targets,
        tokenizer=checked.tokenizer,
        train_prompts=prompts.train if prompts else None,
        eval_prompts=prompts.evaluation if prompts else None,
        records=prompts.records if prompts else None,
    )


def preflight(config: RunConfig, output_dir: Path | None = None) -> Checked:
    """The pre-flight checks of lit_ppo/run/preflight.py on these settings, before the plan and before any model loads
    (the one place that reads them out of the config). A training run needs the model's files; `mode=plan`
    checks what is on this machine and plans without the rest. Returns the settings with ppo.packing resolved where
    the model's type is known (`checks.resolve_packing`), the tokenizer, the prompts read once (`PromptsRead`: their
    lengths in tokens that the plan's expected tokens per micro-batch rest on, and for a run the prompts themselves,
    the arithmetic ones named in `output_dir`'s data folder; None where the tokenizer or the prompt files are not on
    this machine), and with model.lora the modules it adapts, matched on the model built from its config.json on the
    meta device (None without LoRA, or where config.json is not on this machine). `mode=eval` loads its model as a
    training run does, and is checked as one."""
    training = config.mode != "plan"  # a run that loads the model: mode=train or mode=eval
    rollout, data = config.rollout, config.data
    checks.check_strategy(config.strategy.name, config.strategy.devices, config.strategy.num_nodes)
    checks.check_launcher(config.strategy.lightning, class_default=training)
    if training:  # (mode=plan plans a cluster's run on any machine)
        checks.check_accelerator(config.strategy.accelerator, config.strategy.devices, config.strategy.name)
        check_launched_ranks(config.strategy.devices, config.strategy.num_nodes)
    environment = rollout.episodes.environment
    check_reward_and_environment(config)
    files = []
    if data.source == "file":
        files = [
            (Path(path), f"data.{key}") for key, path in (("path", data.path), ("eval_path", data.eval_path)) if path
        ]
    tokenizer, max_positions, positions_source, model_type, architecture, model_name = read_model(config, training)
    prompts = read_prompts_once(config, training, tokenizer, files, output_dir)
    check_prompt_lengths(config, prompts, max_positions, positions_source, has_environment=environment is not None)
    longest = prompts.longest[0] + rollout.response_budget_tokens() if prompts and prompts.longest else None
    check_teacher(config, tokenizer, architecture, training, longest)  # before any model loads
    packing, shared_prefix = teacher_layout(config, *resolve_layout(config, training, model_type, architecture))
    lora_targets = match_lora_targets(config, architecture, model_name)
    ppo = dataclasses.replace(config.ppo, packing=packing, shared_prefix=shared_prefix)
    return Checked(dataclasses.replace(config, ppo=ppo), tokenizer, prompts, lora_targets)


def check_reward_and_environment(config: RunConfig) -> None:
    """The user's code the run names, bound, never called (lit_ppo/run/user_code.py): the environment's class and
    turns, the reward function's keywords and calling convention."""
    rollout, data = config.rollout, config.data
    environment = rollout.episodes.environment
    user_code.check_environment_turns(environment is not None, rollout.episodes.max_turns)
    if environment is not None and environment.get("_target_"):
        environment_class = user_code.resolve_target(environment["_target_"], "rollout.episodes.environment")
        arguments = {k: v for k, v in environment.items() if not k.startswith("_")}
        user_code.check_environment_convention(environment_class, arguments, str(environment["_target_"]))
    spec = config.reward.fn
    target = user_code.resolve_target(spec.get("_target_"), "reward.fn")
    bound = {k: v for k, v in spec.items() if not k.startswith("_")}
    name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', spec['_target_'])}"
    user_code.check_bound_keywords(target, bound, partial=bool(spec.get("_partial_")), name=name)
    user_code.check_reward_convention(
        user_code.call_parameters(target, bound, partial=bool(spec.get("_partial_"))),
        name,
        config.reward.signature,
        data.answer_key,
        list(data.extra_keys),
    )


def read_model(config: RunConfig, training: bool) -> tuple:
    """What the pre-flight reads of the model without loading it: (its tokenizer, its positions and where that limit
    is from, its model_type, its architecture (a transformers config, or the directory of config.json) and its name
    in messages); None (or "") for what is not on this machine."""
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
        if training and tokenizer.pad_token is None:  # padding is masked out: any id fills it
            tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, max_positions, positions_source, model_type, architecture, model_name


def read_prompts_once(config: RunConfig, training: bool, tokenizer, files: list, output_dir: Path | None):
    """The one read of the prompts (`PromptsRead`: a run's kept, `mode=plan`'s lengths only), their notes shown; None
    where the tokenizer or the prompt files are not on this machine (their encoding checked at least)."""
    data = config.data
    if training and data.source == "file" and not Path(data.path).exists():  # expected_prompts plans without it
        raise ConfigError(
            f"data.path={data.path} does not exist; fix: point data.path at your prompt file (data.expected_prompts "
            f"stands for it in mode=plan only)"
        )
    prompts = None
    if training and tokenizer is not None and (data.source == "arithmetic" or Path(data.path).exists()):
        prompts = read_run_prompts(data, tokenizer, output_dir or Path("."), DATA_FOLDERS[config.mode])
    elif tokenizer is not None and (data.source == "arithmetic" or all(path.exists() for path, _ in files)):
        prompts = PromptsRead(*prompt_lengths(data, tokenizer, [path for path, _ in files]))
    for note in prompts.notes if prompts else []:
        show(note)
    for path, key in files if prompts is None else []:  # not read here (no tokenizer): their encoding at least
        if path.is_file() and path.suffix in (".jsonl", ".json", ".gz"):
            check_utf8(path, key)
    return prompts


def check_prompt_lengths(config: RunConfig, prompts, max_positions, positions_source, has_environment: bool) -> None:
    """The longest prompt and the response budget within rollout.max_model_len and the model's positions."""
    rollout = config.rollout
    if has_environment:
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
        longest_prompt=prompts.longest if prompts else None,
    )


def resolve_layout(config: RunConfig, training: bool, model_type, architecture) -> tuple[bool | None, bool | None]:
    """The attention implementation checked for a run; ppo.packing and ppo.shared_prefix resolved where the model is
    known (null: on where exact for it)."""
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
    if training and config.strategy.context_parallel_size > 1 and architecture is not None:  # before any model loads
        model_config = architecture
        if not hasattr(architecture, "num_attention_heads"):
            model_config = SimpleNamespace(**json.loads((Path(architecture) / "config.json").read_text()))
        check_context_parallel_model(
            model_config, config.strategy.context_parallel_size, config.model.attn_implementation
        )
    return packing, shared_prefix


def match_lora_targets(config: RunConfig, architecture, model_name: str) -> LoraTargets | None:
    """With model.lora, the modules it adapts, matched on the model built from its config.json on the meta device;
    None without LoRA, or where config.json is not on this machine (said in one line)."""
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
    return lora_targets


def prompt_lengths(
    data: DataConfig, tokenizer, paths: list[Path]
) -> tuple[list[int], tuple[int, str] | None, list[str]]:
    """The training prompts' lengths in tokens as the run will see them (after the chat template, within
    data.max_prompt_length under data.bad_records), the longest prompt of all (training and held-out ones) with
    where it is, and the notes on repeated prompts (`repetition_notes`). `paths`: data.path first, then
    data.eval_path if set. A file's prompts are streamed (`read_prompts`, the run's reading and filtering): only
    their lengths and digests are kept (`mode=plan`)."""
    from lit_ppo.rollout.prompts import format_prompt

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
    read = read_prompts(data, tokenizer, paths, keep=False)  # the run's reading and filtering, lengths kept only
    return read.lengths, read.longest, read.notes


def data_paths(data: DataConfig, output_dir: Path, folder: str = "data") -> tuple[Path, Path | None]:
    """The (train, eval) prompt files: the user's (data=file; eval None without data.eval_path), or for the arithmetic
    task those the run writes into `output_dir/folder`."""
    if data.source == "arithmetic":
        return output_dir / folder / "train.jsonl", output_dir / folder / "eval.jsonl"
    return Path(data.path), (Path(data.eval_path) if data.eval_path else None)


def read_run_prompts(data: DataConfig, tokenizer, output_dir: Path, folder: str) -> PromptsRead:
    """A run's prompts (`read_prompts`, kept): the user's files, or the arithmetic task's records, generated and read
    as the files the run writes into `output_dir/folder` (`data_paths`) would be."""
    train_path, eval_path = data_paths(data, output_dir, folder)
    if data.source != "arithmetic":
        return read_prompts(data, tokenizer, [train_path, *([eval_path] if eval_path else [])], keep=True)
    from lit_ppo.demo.arithmetic import problems_of

    try:
        records = problems_of(data)
    except ValueError as e:  # its messages name the data keys and the fix
        raise ConfigError(str(e)) from e
    read = read_prompts(data, tokenizer, [train_path, eval_path], keep=True, generated=list(records))
    return dataclasses.replace(read, records=records)


def read_prompts(
    data: DataConfig, tokenizer, paths: list[Path], *, keep: bool, generated: list[list[dict]] | None = None
) -> PromptsRead:
    """One read of the prompt files `paths` (data.path first, then data.eval_path if set), as the run reads them
    (`iter_prompts`: its reading, filtering and bad records under the `data` settings): the training prompts'
    lengths, the longest prompt of all with where it is, the notes on repeated prompts (`repetition_notes`), and with
    `keep` the prompts themselves (a run; `mode=plan` keeps only lengths and 16-byte digests). `generated`: per path,
    its records given in place of the file (the arithmetic task's)."""
    from lit_ppo.rollout.prompts import data_prompt_settings, iter_prompts, prompt_digest, repetition_notes

    names = [f"{key}={path}" for key, path in zip(("data.path", "data.eval_path"), paths)]
    lengths, digests, kept = [[] for _ in paths], [[] for _ in paths], [[] for _ in paths]
    skipped, longest = [Counter() for _ in paths], None
    for i, path in enumerate(paths):
        given = generated[i] if generated else None
        settings = data_prompt_settings(data)
        for prompt in iter_prompts(path, tokenizer, name=names[i], skipped=skipped[i], generated=given, **settings):
            lengths[i].append(len(prompt.prompt_ids))
            digests[i].append(prompt_digest(prompt))
            longest = max(longest or (0, ""), (len(prompt.prompt_ids), prompt.location))
            if keep:
                kept[i].append(prompt)
    notes = repetition_notes(digests[0], digests[1] if len(paths) > 1 else None, *names)
    if not keep:
        return PromptsRead(lengths[0], longest, notes)
    sets = [PromptSet(prompts=kept[i], source=str(path), skipped=skipped[i]) for i, path in enumerate(paths)]
    for name, prompt_set in zip(("train", "eval"), sets):
        if prompt_set.skipped:
            log.warning(
                "data: skipped %s %s prompts (%s)", sum(prompt_set.skipped.values()), name, dict(prompt_set.skipped)
            )
    return PromptsRead(lengths[0], longest, notes, train=sets[0], evaluation=sets[1] if len(sets) > 1 else None)
