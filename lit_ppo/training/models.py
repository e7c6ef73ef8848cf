"""The run's models from one Hugging Face directory: the actor, and the critic and reference model when the plan needs
them; and their outputs at a micro-batch's response tokens."""

from __future__ import annotations

import logging

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from lit_ppo.plan import StepPlan
from lit_ppo.training.batching import MicroBatch


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


def response_logits(model: torch.nn.Module, mb: MicroBatch) -> Tensor:
    """A language model's (the actor's, the reference's) logits at the positions that predict each response token,
    [B, T + 1, V]. Responses end the row, so only the last T + 1 positions need the vocabulary-sized LM head; the
    last one predicts nothing, but slicing it off would make autograd allocate a padded gradient of the whole. The
    sampling temperature is applied where the logits are read (`logits.logprobs_and_entropy`), in float32 chunks."""
    T = mb.response_ids.shape[1]
    inputs = dict(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids)
    return model(**inputs, logits_to_keep=T + 1).logits


def critic_values(critic: torch.nn.Module, mb: MicroBatch) -> Tensor:
    """The critic's value at each response token's position, [B, T] in float32."""
    T, start = mb.response_ids.shape[1], mb.prompt_width - 1
    inputs = dict(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids)
    return critic(**inputs).logits[:, start : start + T][..., 0].float()  # the value head's one output
