"""Packed against padded log-probs on tiny random models of the families whose causal LM changes the logits after its
decoder (issue 37), float32, temperature 0.7, 6 samples of realistic lengths (`lit_ppo.testing.synthetic_rollout_batch`:
prompts 100-300 tokens, responses up to 256, episodes with observations, as in tests/training/test_packing.py). Per
family, mean and max |packed - padded| nats per token:

- `head by hand`: the LM head applied to the decoder's hidden states at the response positions, the packed path before
  issue 37 (it skipped what the family's forward does after the head);
- `model's forward`: the product's packed path (`training/models.py: packed_response_logits`).

Two weight scales: transformers' initialization (logits near 0: Gemma2's softcap at 30 does nothing there), and the LM
head 50x that (logits' std about 8, as a trained model's; the models of tests/training/test_packing.py). Falcon-H1 is refused
for packing since (recurrent layers, `lit_ppo/training/packing.py`); it is measured for the head alone.

    .venv/bin/python bench/packing_families.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lit_ppo.testing import synthetic_rollout_batch  # noqa: E402
from lit_ppo.training.batching import pack, pack_samples  # noqa: E402
from lit_ppo.training.models import prepare_for_training, response_logprobs_and_entropy  # noqa: E402
from tests.helpers.packing import head_by_hand  # noqa: E402

TEMPERATURE = 0.7
SHAPE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=1,
)
FAMILIES = {
    "granite": lambda: transformers.GraniteConfig(
        **SHAPE, logits_scaling=8.0, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=1 / 16
    ),
    "cohere": lambda: transformers.CohereConfig(**SHAPE, logit_scale=0.0625),
    "gemma2": lambda: transformers.Gemma2Config(
        **SHAPE, head_dim=16, final_logit_softcapping=30.0, attn_logit_softcapping=50.0, sliding_window=64
    ),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(
        **SHAPE, head_dim=16, final_logit_softcapping=30.0, sliding_window=64
    ),
    "minicpm3": lambda: transformers.MiniCPM3Config(**{**SHAPE, "num_key_value_heads": 4}, dim_model_base=16),
    "falcon_h1": lambda: transformers.FalconH1Config(**SHAPE, lm_head_multiplier=0.03),
}


def errors(model, padded, packed) -> tuple[tuple[float, float], tuple[float, float]]:
    """((mean, max) of the head by hand, (mean, max) of the model's forward), nats per token against padded."""
    mask = padded.response_mask
    with torch.no_grad():
        reference = response_logprobs_and_entropy(model, padded, TEMPERATURE)[0][mask > 0]
        by_hand = torch.log_softmax(head_by_hand(model, packed)[0].float() / TEMPERATURE, -1)
        by_hand = by_hand.gather(-1, packed.response_ids[mask > 0][:, None])[:, 0]
        forward = response_logprobs_and_entropy(model, packed, TEMPERATURE)[0][mask > 0]
    old, new = (by_hand - reference).abs(), (forward - reference).abs()
    return (float(old.mean()), float(old.max())), (float(new.mean()), float(new.max()))


def main() -> None:
    batch = synthetic_rollout_batch(3, 2, (100, 300), (1, 256), seed=2, observations=True)
    prompts, responses, masks = batch.prompt_ids, batch.response_ids, batch.policy_masks
    padded = pack(prompts, responses, 0, "cpu", policy_masks=masks)
    packed = pack_samples(prompts, responses, 0, "cpu", policy_masks=masks)
    columns = ("family", "head", "head by hand: mean", "max", "model's forward: mean", "max")
    print("{:12s} {:>9s}  {:>18s} {:>8s}  {:>21s} {:>8s}".format(*columns))
    for head_scale in (1.0, 50.0):
        for family, config in FAMILIES.items():
            torch.manual_seed(0)
            model = prepare_for_training(AutoModelForCausalLM.from_config(config(), dtype=torch.float32), False)
            with torch.no_grad():
                model.get_output_embeddings().weight.mul_(head_scale)
            (old_mean, old_max), (new_mean, new_max) = errors(model, padded, packed)
            print(
                f"{family:12s} {head_scale:>8g}x  {old_mean:>18.3g} {old_max:>8.3g}  {new_mean:>21.2e} {new_max:>8.2e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
