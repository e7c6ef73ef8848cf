"""The run's models from one Hugging Face directory: the actor, and the critic and reference model when the plan needs
them (with `model.lora`, PEFT adapters on a frozen base, and no reference copy); and their outputs at a micro-batch's
response tokens."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from lit_ppo.config import LoraConfig
from lit_ppo.distributed import gathered
from lit_ppo.errors import PackingError
from lit_ppo.plan import StepPlan
from lit_ppo.training.batching import MicroBatch
from lit_ppo.training.logits import logprobs_and_entropy
from lit_ppo.training.shared_prefix import attention_mask_for


def load_models(
    model_dir: str,
    plan: StepPlan,
    gradient_checkpointing: bool = False,
    lora: LoraConfig | None = None,
    attn_implementation: str | None = None,
):
    """(actor, critic or None, reference or None), in float32; the reference frozen.

    With `lora` enabled the actor and the critic are PEFT models: the base weights frozen (in bf16 under bf16-mixed,
    which computes in bf16 anyway; else float32), the adapters (and the critic's value head) trainable in float32. No
    reference model is loaded: it is the actor with its adapter disabled (`reference_logits`)."""
    lora = lora if lora is not None and lora.enabled else None
    attention = {"attn_implementation": attn_implementation} if attn_implementation else {}  # model.attn_implementation
    base_dtype = torch.bfloat16 if lora is not None and plan.models.precision == "bf16-mixed" else torch.float32
    actor = AutoModelForCausalLM.from_pretrained(model_dir, dtype=base_dtype, **attention)
    critic = None
    if plan.models.critic_enabled:
        critic = AutoModelForTokenClassification.from_pretrained(model_dir, num_labels=1, dtype=base_dtype, **attention)
        critic.score.float()
        # A zero value head: the critic starts at V = 0 everywhere, the same in every run and on every rank.
        torch.nn.init.zeros_(critic.score.weight)
        if critic.score.bias is not None:
            torch.nn.init.zeros_(critic.score.bias)
        # transformers reports the head as MISSING weights (in run.log); this is what it means. In run.log only: a
        # resumed run's critic is restored from its checkpoint after this (run/train.py says which on the console).
        logging.getLogger("lit_ppo").info(
            "critic: the policy's weights with a new value head (%d -> 1), starting at zero (a resumed run then loads "
            "its checkpoint's critic)",
            critic.score.in_features,
            extra={"console": False},
        )
    reference = None
    if plan.models.reference_enabled and lora is None:
        reference = (
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **attention)
            .eval()
            .requires_grad_(False)
        )
    for model in (actor, critic):
        if model is not None:
            prepare_for_training(model, gradient_checkpointing)
    if lora is not None:
        actor = with_lora(actor, lora)
        if critic is not None:  # the value head is new: trained whole (modules_to_save), beside the body's adapter
            critic = with_lora(critic, lora, modules_to_save=["score"])
    return actor, critic, reference


def peft_lora_config(lora: LoraConfig, modules_to_save: list[str] | None = None):
    """peft's LoraConfig of `model.lora`; also the `adapter_config.json` that vLLM reads."""
    from peft import LoraConfig as PeftLoraConfig

    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        target_modules=targets,
        lora_dropout=lora.dropout,
        init_lora_weights=True if lora.init == "default" else lora.init,
        bias="none",
        modules_to_save=modules_to_save,
    )


def with_lora(model: torch.nn.Module, lora: LoraConfig, modules_to_save: list[str] | None = None):
    """`model` as a PEFT model: base frozen, the adapter (and `modules_to_save`) trainable and in float32 whatever the
    base's dtype, so that AdamW's states and updates keep float32 resolution."""
    from peft import get_peft_model

    model = get_peft_model(model, peft_lora_config(lora, modules_to_save))
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.data = parameter.data.float()
    return model.train()


def is_lora(model: torch.nn.Module | None) -> bool:
    return model is not None and hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def adapter_tensors(model: torch.nn.Module) -> dict[str, Tensor]:
    """The actor's adapter by peft's names (`base_model.model.<module>.lora_A.weight`), as vLLM and `save_pretrained`
    read them: the only tensors a LoRA run syncs. Sharded (FSDP2), each is gathered whole, one at a time (a collective:
    every rank calls this); the frozen base is never gathered."""
    from peft import get_peft_model_state_dict

    return {name: gathered(tensor) for name, tensor in get_peft_model_state_dict(model).items()}


def trained_state(model: torch.nn.Module) -> dict[str, Tensor]:
    """The model's trained tensors by its state_dict keys (peft's, with the adapter's name), gathered whole if sharded
    (a collective, as `adapter_tensors`): what a sharded peft model's `save_pretrained(state_dict=...)` writes its
    adapter from."""
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    return {name: gathered(tensor) for name, tensor in model.state_dict().items() if name in trained}


@contextmanager
def adapter_disabled(model: torch.nn.Module) -> Iterator[None]:
    """peft's `disable_adapter()`: the frozen base alone, the reference policy of a LoRA run (forwards without
    gradients). peft also marks the adapter's parameters untrainable for the duration; they are marked trainable again
    inside, because FSDP2 reads which parameters train at the model's first forward, which may be this one, to fix the
    dtypes it reduces their gradients in. Seeing none, under bf16-mixed it reduces the adapter's gradients in bf16, not
    float32 (seen in a 2-rank on-policy GRPO run), or fails to store a bf16 gradient on a float32 shard (the FSDP
    worker of tests/training/test_lora.py)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    with model.disable_adapter():
        for parameter in trained:
            parameter.requires_grad_(True)
        yield


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
        mask = attention_mask_for(critic, mb)  # None, or the shared-prefix layout's 4-D mask
        values = critic(input_ids=mb.input_ids, attention_mask=mask, position_ids=mb.position_ids, use_cache=False)
        values = values.logits  # [R, L, 1]
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
    logits = packed_response_logits(model, mb)  # [1, n, V]
    targets = mb.response_ids[mb.response_mask > 0]  # [n], the same row-major order as head_index
    logp, entropy = logprobs_and_entropy(logits, targets[None], temperature=temperature)
    return scatter_responses(logp[0], mb.response_mask), scatter_responses(entropy[0], mb.response_mask)


def packed_response_logits(model: torch.nn.Module, mb: MicroBatch) -> Tensor:
    """A language model's logits at a packed micro-batch's `head_index` positions, [1, n, V], from the model's own
    forward: a hook on its decoder hands the rest of the forward the decoder's last hidden states at those positions
    only, as one sequence of n, so the model's own head and what follows it run on them as in the padded layout
    (Gemma2/3's final logit softcapping, Cohere's logit_scale, Granite's logits_scaling, Falcon-H1's
    lm_head_multiplier, MiniCPM3's scaled hidden states: each family's forward, no table of ours).

    Not transformers' `logits_to_keep` as a tensor of positions: it selects the same positions in every row, [R, n, V]
    for R packed rows. What wraps the model's forward (FSDP's gathering of the root's parameters, a peft model's
    forward, the LoRA reference's disabled adapter) runs as in any forward."""
    replaced: list[bool] = []

    def at_response_positions(_module, _args, output):
        hidden = output[0]  # [R, L, H] last_hidden_state (a ModelOutput or a tuple)
        kept = hidden.reshape(-1, hidden.shape[-1])[mb.head_index][None]  # [1, n, H]
        replaced.append(True)
        if isinstance(output, tuple):
            return (kept, *output[1:])
        output.last_hidden_state = kept  # a ModelOutput keeps its attribute and its first item the same
        return output

    handle = model.get_decoder().register_forward_hook(at_response_positions)
    try:
        # use_cache=False: with a cache transformers takes the positions for decoding steps and builds no packed mask
        inputs = dict(
            input_ids=mb.input_ids, attention_mask=attention_mask_for(model, mb), position_ids=mb.position_ids
        )
        logits = model(**inputs, use_cache=False, logits_to_keep=0).logits
    finally:
        handle.remove()
    if len(replaced) != 1 or logits.shape[:2] != (1, mb.head_index.numel()):
        raise PackingError(
            f"ppo.packing: the {model.config.model_type} model's forward did not compute its logits from its decoder's "
            f"hidden states (logits {tuple(logits.shape)} for {mb.head_index.numel()} response positions); "
            "fix: set ppo.packing=false (padded micro-batches)"
        )
    return logits


def scatter_responses(values: Tensor, response_mask: Tensor) -> Tensor:
    """[n] values at the response_mask's nonzero [B, T] entries (row-major) back into [B, T], zero elsewhere."""
    return torch.zeros(response_mask.shape, dtype=values.dtype, device=values.device).masked_scatter(
        response_mask > 0, values
    )
