"""Reward functions shipped with lit-ppo: the arithmetic task's exact integer match and a local reward model
(`SequenceClassifierReward`). The math verifier is `lit_ppo.rewards.math_verifier`."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from lit_ppo.errors import ConfigError

log = logging.getLogger("lit_ppo")


_INTEGER = re.compile(r"-?\d+")


def integer_match(prompts, responses, references, extras, **_) -> list[float]:
    """1.0 when the response is exactly the reference integer (surrounding spaces allowed), else 0.0."""
    scores = []
    for response, reference in zip(responses, references):
        text = response.strip()
        scores.append(
            1.0 if _INTEGER.fullmatch(text) and reference is not None and int(text) == int(reference) else 0.0
        )
    return scores


class SequenceClassifierReward:
    """A local reward model: a `transformers` sequence-classification model directory scoring prompt + response.

    The score of a sample is the logit `score_index` at the last token of prompt + response; batches
    of `batch_size` texts, kept to their last `max_length` tokens when that is set."""

    def __init__(
        self,
        model_dir: str,
        *,
        batch_size: int = 8,
        max_length: int | None = None,
        score_index: int = 0,
        device: str = "cpu",
        dtype: str = "float32",
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if not (Path(model_dir) / "config.json").exists():
            raise ConfigError(
                f"reward.fn.model_dir={model_dir} is not a model directory (no config.json); "
                "fix: point it at a saved AutoModelForSequenceClassification"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer.truncation_side = "left"  # the response, at the end, is what is being judged
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        self.model.config.pad_token_id = self.tokenizer.pad_token_id  # finds each text's last token in a padded batch
        self.model.to(device).eval()
        if not 0 <= score_index < self.model.config.num_labels:
            raise ConfigError(
                f"reward.fn.score_index={score_index} but the model has {self.model.config.num_labels} labels; "
                f"fix: use 0..{self.model.config.num_labels - 1}"
            )
        self.batch_size, self.max_length, self.score_index, self.device = batch_size, max_length, score_index, device

    def __call__(self, prompts, responses, references, extras) -> list[float]:

        texts = [p + r for p, r in zip(prompts, responses)]
        scores: list[float] = []
        with torch.no_grad():
            for start in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(
                    texts[start : start + self.batch_size],
                    return_tensors="pt",
                    padding=True,
                    truncation=self.max_length is not None,
                    max_length=self.max_length,
                ).to(self.device)
                logits = self.model(**batch).logits  # [B, num_labels]
                scores.extend(logits[:, self.score_index].float().tolist())
        return scores
