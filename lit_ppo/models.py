"""The run's models from one Hugging Face directory: the actor, and the critic and reference model when the plan needs them."""

from __future__ import annotations

import logging

import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from lit_ppo.plan import StepPlan


def load_models(model_dir: str, plan: StepPlan, gradient_checkpointing: bool = False):
    """(actor, critic or None, reference or None), in float32; the reference frozen."""
    actor = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    critic = None
    if plan.critic_enabled:
        critic = AutoModelForTokenClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
        # A zero value head: the critic starts at V = 0 everywhere, the same in every run and on every rank.
        torch.nn.init.zeros_(critic.score.weight)
        if critic.score.bias is not None:
            torch.nn.init.zeros_(critic.score.bias)
        # transformers reports the head as MISSING weights (in run.log); this is what it means.
        logging.getLogger("lit_ppo").info(
            "critic: the policy's weights with a new value head (%d -> 1), starting at zero", critic.score.in_features
        )
    reference = None
    if plan.reference_enabled:
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().requires_grad_(False)
    for model in (actor, critic):
        if model is not None:
            prepare_for_training(model, gradient_checkpointing)
    return actor, critic, reference


def prepare_for_training(model: torch.nn.Module, gradient_checkpointing: bool) -> torch.nn.Module:
    """Training mode with every dropout off, and gradient checkpointing when asked.

    `from_pretrained` returns a model in eval mode and Lightning keeps each submodule's mode, while Hugging Face
    checkpoints layers only in training mode: without this, model.gradient_checkpointing=true did nothing.
    Training mode must not switch dropout on (the critic's classifier_dropout is 0.1 by default): the ratio of
    new to old log-probs and the comparison with vLLM's assume one deterministic function of the weights."""
    for name, value in vars(model.config).items():
        if "dropout" in name and isinstance(value, float):
            setattr(model.config, name, 0.0)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    if gradient_checkpointing:
        # Non-reentrant: parameters get gradients even though the layers' inputs (embeddings of ids) need none.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()
