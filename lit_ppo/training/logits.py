"""Log-probabilities and entropy of response tokens from vocabulary-sized logits, in chunks.

For a 151,936-token vocabulary one float32 copy of a micro-batch's logits [B, T, V] is 2.3 GiB at 4 x 1,024
tokens. Autograd through log_softmax/gather/entropy keeps several such copies (float32 upcast, softmax, log-softmax,
their gradients). Here one autograd function computes both quantities chunk by chunk in float32 and keeps only
the logits themselves (already alive: the LM head's output) and two floats per token (logsumexp, entropy); its
backward writes the logits' gradient chunk by chunk. Peak: the logits, their gradient, and a few float32 chunks of CHUNK_TOKENS tokens.
Each chunk takes few passes over its [tokens, V] floats (a fused log_softmax, in-place updates, no division at
temperature 1): on a GPU these elementwise passes, not the matrix products, were the training phase's overhead
against a plain loop (BENCHMARKS.md, "On a GPU"); on CPU the function ran 2x faster than before this change.

Gradients, per token with p = softmax(x), log-prob l_y = x_y - logsumexp(x), entropy H = -sum p log p:
  d l_y / dx = onehot(y) - p,        dH / dx = -p * (log p + H).
With a sampling temperature T the distribution is softmax(logits / T): x = logits / T, and the gradient with
respect to the logits is the one above divided by T.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK_TOKENS = 256  # tokens per float32 chunk: 256 x 151,936 x 4 B = 0.15 GiB (a few are alive at once)


def _chunks(batch: int, length: int, chunk_tokens: int):
    """(row, start, end) windows over [batch, length] positions, `chunk_tokens` positions at most each."""
    step = max(1, chunk_tokens)
    for row in range(batch):
        for start in range(0, length, step):
            yield row, start, min(length, start + step)


class _LogprobsAndEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, chunk_tokens: int, temperature: float):
        B, T = targets.shape
        logp = torch.empty(B, T, dtype=torch.float32, device=logits.device)
        entropy = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        for row, start, end in _chunks(B, T, chunk_tokens):
            x = logits[row, start:end].float()
            if temperature != 1.0:  # x / 1.0 is x: skip a pass over the chunk
                x = x / temperature
            log_p = torch.log_softmax(x, dim=-1)  # one fused kernel (max, exp-sum, subtract)
            chosen = log_p.gather(-1, targets[row, start:end, None]).squeeze(-1)
            logp[row, start:end] = chosen
            lse[row, start:end] = x.gather(-1, targets[row, start:end, None]).squeeze(-1) - chosen
            entropy[row, start:end] = -(log_p.exp().mul_(log_p)).sum(-1)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.chunk_tokens = chunk_tokens
        ctx.temperature = temperature
        ctx.overwrite = not logits.is_leaf  # a leaf is the caller's own tensor: leave it alone
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None):
        logits, targets, lse, entropy = ctx.saved_tensors
        B, T = targets.shape
        # The gradient overwrites the logits, chunk by chunk once a chunk is read: nothing else needs them after
        # this backward, and the two [B, T, V] tensors are then never alive together. (Another autograd node that
        # saved the logits would fail loudly on their changed version, not silently.)
        grad = logits if ctx.overwrite else torch.empty_like(logits)
        grad[:, T:].zero_()  # positions past T (e.g. the LM head's extra last one) get no gradient
        for row, start, end in _chunks(B, T, ctx.chunk_tokens):
            x = logits[row, start:end].float()  # the logits themselves when float32: read-only here
            if ctx.temperature != 1.0:
                x = x / ctx.temperature
            log_p = x - lse[row, start:end, None]
            p = log_p.exp()
            if grad_logp is not None:
                g = grad_logp[row, start:end, None].float()
                chunk = (p * -g).scatter_add_(-1, targets[row, start:end, None], g)
            else:
                chunk = torch.zeros_like(p)
            if grad_entropy is not None:
                chunk.sub_(
                    log_p.add_(entropy[row, start:end, None]).mul_(p).mul_(grad_entropy[row, start:end, None].float())
                )
            if ctx.temperature != 1.0:
                chunk.div_(ctx.temperature)
            grad[row, start:end] = chunk  # the copy casts to the logits' dtype
        return grad, None, None, None


def logprobs_and_entropy(
    logits: Tensor, targets: Tensor, chunk_tokens: int = CHUNK_TOKENS, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """log softmax(logits)[target] and the entropy of softmax(logits) at each of targets' [B, T] positions, in
    float32; `logits` is [B, >= T, V] in any dtype (positions past T are ignored: pass the LM head's output
    as is, slicing it would make autograd allocate a padded gradient). Differentiable in both outputs.

    The backward pass overwrites `logits` (unless a leaf) with their gradient: read nothing from them after backward."""
    if (
        logits.dim() != 3
        or targets.dim() != 2
        or logits.shape[0] != targets.shape[0]
        or logits.shape[1] < targets.shape[1]
    ):
        raise ValueError(
            f"logprobs_and_entropy: logits {tuple(logits.shape)} do not cover targets {tuple(targets.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"logprobs_and_entropy: temperature {temperature} must be positive")
    return _LogprobsAndEntropy.apply(logits, targets, chunk_tokens, float(temperature))
