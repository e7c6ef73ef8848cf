"""Packing's shared test code: the realistic rollout batch of tests/training/test_packing.py and test_shared_prefix.py
(prompts of 100-300 tokens, ragged responses, episodes), a rollout step's training on it recording the gradients, and
the packed path's LM head applied by hand, as before issue 37 (test_packing.py and bench/packing_families.py compare
the model's forward with it)."""

from __future__ import annotations

import dataclasses

import torch

from lit_ppo.batch import RolloutBatch
from lit_ppo.config import RolloutConfig
from lit_ppo.plan import compute_plan
from lit_ppo.testing import synthetic_rollout_batch
from tests.helpers import compose_run_config, ppo_at, run_config
from tests.helpers.fixed_batch import train_on_fixed_batch

TEMPERATURE = 0.7


def small_ppo(preset: str = "ppo", prompts: int = 2, **changes):
    """The preset's settings at the packing tests' scale: `prompts` prompts x 4 samples per rollout step, mini-batches
    of 4 samples in micro-batches of 2, learning rates 1e-3; `changes` on top."""
    return ppo_at(prompts, 4, 4, 2, preset, actor_lr=1e-3, critic_lr=1e-3, **changes)


def realistic_rollout() -> RolloutConfig:
    """The default rollout settings for `realistic_batch`'s lengths: responses of up to 256 tokens, prompt and response
    within 600."""
    return dataclasses.replace(compose_run_config().rollout, max_response_tokens=256, max_model_len=600)


def realistic_batch(n_prompts: int = 4, n: int = 4, seed: int = 0, episodes: bool = True) -> RolloutBatch:
    """Prompts of 100-300 random ids, `n` responses each of 1-256 ids; episodes: responses that alternate the
    policy's turns with observations of 5-30 tokens (policy mask 0)."""
    # rewards 1 where 7i mod 3 is 0: the tolerances below were measured on these
    rewards = torch.tensor([float((i * 7) % 3 == 0) for i in range(n_prompts * n)])
    return synthetic_rollout_batch(
        n_prompts, n, (100, 300), (1, 256), seed=seed, observations=episodes, rewards=rewards
    )


def realistic_samples(n_prompts: int, n: int, seed: int, episodes: bool):
    """`realistic_batch`'s prompts, responses and policy masks (None without episodes), per sample."""
    batch = realistic_batch(n_prompts, n, seed, episodes)
    return batch.prompt_ids, batch.response_ids, batch.policy_masks


def train(model_dir, files, tmp_path, batch: RolloutBatch, ppo, steps: int = 1, prompt_stats=None):
    """`steps` rollout steps on `batch`; the module and the actor's and critic's gradients (before clipping) at each
    optimizer step. `prompt_stats`: the prompt lengths the plan is made with."""
    rollout = realistic_rollout()
    return train_on_fixed_batch(
        model_dir,
        files[0],
        tmp_path,
        batch,
        ppo,
        rollout,
        lambda prompts: compute_plan(run_config(ppo=ppo, rollout=rollout, steps=steps), prompts, prompt_stats),
        temperature=TEMPERATURE,
    )


def assert_close_tensors(a: dict, b: dict, rel: float) -> None:
    """Each tensor within `rel` relative (|a - b| / |b|, Euclidean norms; equal where b is zero: the critic's body
    before its zero value head has moved). Float32 sums of the same terms in another order (other micro-batches,
    other attention reductions) differ in the last bits of single entries, so entrywise ratios would read rounding."""
    assert a.keys() == b.keys() and a
    for name in a:
        norm = float(b[name].norm())
        if norm == 0:
            assert float(a[name].norm()) == 0, name
            continue
        error = float((a[name] - b[name]).norm()) / norm
        assert error <= rel, f"{name}: packed and padded gradients differ by {error:.2e} relative"


def head_by_hand(model, mb):
    """The packed path before issue 37: the decoder's hidden states at head_index times the LM head's weights, skipping
    what the family's forward does after its head. Kept to show the test models are ones where that matters, and to
    force the packed path wrong for the start-up check."""
    captured = []
    handle = model.get_decoder().register_forward_hook(lambda _m, _a, output: captured.append(output[0]))
    try:
        model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    hidden = captured[0].reshape(-1, captured[0].shape[-1])
    return model.get_output_embeddings()(hidden[mb.head_index])[None]
