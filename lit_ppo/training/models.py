"""The run's models from one Hugging Face directory: the actor, and the critic and reference model when the plan needs
them; and their outputs at a micro-batch's response tokens."""

from __future__ import annotations

import logging

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from lit_ppo.plan import StepPlan
from lit_ppo.training.batching import MicroBatch
from lit_ppo.training.logits import logprobs_and_entropy


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
    """The critic's value at each response token's position, [B, T] in float32 (packed: zero where response_mask is).

    Packed, the value head (hidden size -> 1, one dot product per position) runs in the critic's own forward at every
    position and the values are gathered at the response positions: calling the decoder and the head apart would step
    around the wrappers' hooks on the model's forward (FSDP gathers the root's parameters there), to save nothing."""
    if mb.packed:
        values = critic(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False).logits  # [R, L, 1]
        return scatter_responses(values.reshape(-1)[mb.head_index].float(), mb.response_mask)
    T, start = mb.response_ids.shape[1], mb.prompt_width - 1
    inputs = dict(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids)
    return critic(**inputs).logits[:, start : start + T][..., 0].float()  # the value head's one output


def response_logprobs_and_entropy(model: torch.nn.Module, mb: MicroBatch, temperature: float) -> tuple[Tensor, Tensor]:
    """A language model's log-probs of the response tokens and its entropy there, [B, T] each in float32, at the
    sampling temperature (`logits.logprobs_and_entropy`). Packed: the LM head runs only at the positions that predict
    a response token the policy wrote ([n, V] logits, never for a prompt token, an observation or padding); zero
    elsewhere."""
    if not mb.packed:
        return logprobs_and_entropy(response_logits(model, mb), mb.response_ids, temperature=temperature)
    hidden = decoder_hidden_states(model, mb)  # [R * L, H]
    logits = model.get_output_embeddings()(hidden[mb.head_index])  # [n, V]
    targets = mb.response_ids[mb.response_mask > 0]  # [n], the same row-major order as head_index
    logp, entropy = logprobs_and_entropy(logits[None], targets[None], temperature=temperature)
    return scatter_responses(logp[0], mb.response_mask), scatter_responses(entropy[0], mb.response_mask)


def decoder_hidden_states(model: torch.nn.Module, mb: MicroBatch) -> Tensor:
    """The decoder's last hidden states of a packed micro-batch, [R * L, H], taken by a hook from the model's own
    forward (so that what wraps the model's forward, FSDP's gathering of the root's parameters or a peft model's,
    still runs), which computes the vocabulary logits of one position per row only (logits_to_keep=1)."""
    captured: list[Tensor] = []

    def keep(_module, _args, output) -> None:
        captured.append(output[0])  # BaseModelOutputWithPast.last_hidden_state

    handle = model.get_decoder().register_forward_hook(keep)
    try:
        # use_cache=False: with a cache transformers takes the positions for decoding steps and builds no packed mask
        model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    return captured[0].reshape(-1, captured[0].shape[-1])


def scatter_responses(values: Tensor, response_mask: Tensor) -> Tensor:
    """[n] values at the response_mask's nonzero [B, T] entries (row-major) back into [B, T], zero elsewhere."""
    return torch.zeros(response_mask.shape, dtype=values.dtype, device=values.device).masked_scatter(
        response_mask > 0, values
    )
