"""model.gradient_checkpointing=true recomputes the decoder layers in the backward pass, and training mode
switches no dropout on."""

from __future__ import annotations

import torch

from lit_ppo.training.batching import pack
from lit_ppo.training.models import critic_values
from tests.helpers import build_run


def test_checkpointing_recomputes_every_decoder_layer(tiny_model_dir, engine, arithmetic_files, tmp_path):
    """One rollout step with and without checkpointing: with it, the actor's and the critic's decoder layers run
    once more for every training micro-batch (the recomputation), and only then."""
    calls = {}
    for checkpointing in (False, True):
        trainer, module, datamodule, plan = build_run(
            tiny_model_dir,
            engine,
            arithmetic_files,
            tmp_path / str(checkpointing),
            gradient_checkpointing=checkpointing,
        )
        count = [0]
        layers = [layer for model in (module.actor, module.critic) for layer in model.model.layers]
        for layer in layers:
            # A pre-hook: the recomputation stops as soon as it has what the backward pass needs (non-reentrant
            # checkpointing), before a forward hook would run.
            layer.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
        trainer.fit(module, datamodule=datamodule)
        calls[checkpointing] = count[0]
    micro_batches = plan.counts.total_optimizer_steps * plan.layout.grad_accumulation_steps
    assert micro_batches > 0
    assert calls[True] - calls[False] == micro_batches * len(layers), calls


def test_trained_models_are_in_training_mode_without_dropout(tiny_model_dir, engine, arithmetic_files, tmp_path):
    _, module, _, _ = build_run(tiny_model_dir, engine, arithmetic_files, tmp_path, gradient_checkpointing=True)
    assert module.actor.training and module.critic.training and not module.reference.training
    assert module.actor.is_gradient_checkpointing and module.critic.is_gradient_checkpointing
    dropouts = [
        m.p for model in (module.actor, module.critic) for m in model.modules() if isinstance(m, torch.nn.Dropout)
    ]
    assert dropouts and all(p == 0.0 for p in dropouts)  # the critic's head had classifier_dropout 0.1
    mb = pack([[5, 6, 7, 8]] * 4, [[9, 10, 11]] * 4, module.pad_token_id, "cpu")
    values = [critic_values(module.critic, mb) for _ in range(2)]
    assert torch.equal(values[0], values[1])  # deterministic in training mode
