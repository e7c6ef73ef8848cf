"""plan.json as older releases wrote it: a plan written before the plan had sections (flat) read by its sections, so
that the checkpoints written then still load (`sections_of`, checkpoints.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from lit_ppo.plan.step import SECTIONS

# plan.json before the plan had sections (a flat dict: checkpoints written then still load, `sections_of`): each
# flat key that is not its section field's own name -> (section, field); the others keep their names. A feature's
# section was on where its flag (below) says so.
RENAMED_FLAT_KEYS = {
    "old_logprobs_source": ("old_logprobs", "source"),
    "dynamic_sampling_on_shortfall": ("dynamic_sampling", "on_shortfall"),
    "lora_rank": ("lora", "rank"),
    "lora_alpha": ("lora", "alpha"),
    "lora_target_modules": ("lora", "target_modules"),
    "lora_adapted_names": ("lora", "adapted_names"),
    "lora_adapted_modules": ("lora", "adapted_modules"),
    "lora_adapter_parameters": ("lora", "adapter_parameters"),
    "rollout_workers": ("workers", "count"),
    "rollout_devices_per_worker": ("workers", "devices_per_worker"),
    "rollout_worker_launch": ("workers", "launch"),
    "rollout_worker_address": ("workers", "address"),
}
FLAT_FEATURE_FLAGS = {  # section -> whether a flat plan had it on
    "dynamic_sampling": lambda flat: bool(flat.get("dynamic_sampling")),
    "episodes": lambda flat: bool(flat.get("max_episode_tokens")),
    "lora": lambda flat: bool(flat.get("lora_rank")),
    "workers": lambda flat: flat.get("rollout_mode") == "disaggregated",
    "teacher": lambda flat: False,  # on-policy distillation came after the sections
    "partial": lambda flat: False,  # partial rollouts likewise
}


def sections_of(record: dict) -> dict[str, Any]:
    """A plan.json (or a checkpoint's plan) by section, as `StepPlan.to_dict` writes it; a flat one written before
    the plan had sections is mapped to them (RENAMED_FLAT_KEYS; a key it lacks is left out of its section)."""
    if "counts" in record:  # a section added since (a feature that did not exist then) was off
        added = {section: None for section in SECTIONS if section not in record}
        return {**added, **record} if added else record
    owner = {}  # flat key -> (section, field)
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            owner[f.name] = (section, f.name)
    owner.update(RENAMED_FLAT_KEYS)
    nested: dict[str, Any] = {section: {} for section in SECTIONS}
    for key, value in record.items():
        if key in owner:
            section, name = owner[key]
            nested[section][name] = value
    counts = nested["counts"]  # rollout_batch_size came after the sections: the flat plan's samples per prompt
    if "rollout_batch_size" not in counts and counts.get("n_samples_per_prompt"):
        counts["rollout_batch_size"] = counts["samples_per_rollout_step"] // counts["n_samples_per_prompt"]
    if "data_parallel_size" in counts:  # context parallelism came later too: a flat plan's ranks were all data-parallel
        counts.setdefault("context_parallel_size", 1)
    for section, on in FLAT_FEATURE_FLAGS.items():
        if not on(record):
            nested[section] = None
    return {**nested, "notes": record.get("notes", []), "warnings": record.get("warnings", [])}
