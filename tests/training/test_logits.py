"""Chunked log-probs and entropy (lit_ppo.training.logits) against autograd through the plain formulas, in float64."""

from __future__ import annotations

import pytest
import torch

from lit_ppo.training.logits import logprobs_and_entropy


def reference(logits, targets):
    T = targets.shape[1]
    log_p = logits[:, :T].double().log_softmax(-1)
    return log_p.gather(-1, targets[..., None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


@pytest.mark.parametrize("chunk_tokens", [1, 3, 1024])
@pytest.mark.parametrize("entropy_weight", [0.0, 0.3])
def test_values_and_gradients_match_autograd(chunk_tokens, entropy_weight):
    torch.manual_seed(0)
    leaf = (3 * torch.randn(2, 6, 50)).requires_grad_()  # 5 response positions + the LM head's extra one
    logits = leaf * 1.0  # not a leaf, as the LM head's output: its memory is reused for the gradient
    expected_logits = logits.detach().double().requires_grad_()
    targets = torch.randint(0, 50, (2, 5))
    weights = torch.randn(2, 5)
    logp, entropy = logprobs_and_entropy(logits, targets, chunk_tokens=chunk_tokens)
    loss = (
        (logp * weights).sum() + (entropy_weight * entropy * weights).sum()
        if entropy_weight
        else (logp * weights).sum()
    )
    (grad,) = torch.autograd.grad(loss, leaf)
    ref_logp, ref_entropy = reference(expected_logits, targets)
    ref_loss = (ref_logp * weights).sum() + (entropy_weight * ref_entropy * weights).sum()
    (ref_grad,) = torch.autograd.grad(ref_loss, expected_logits)
    assert torch.allclose(logp.double(), ref_logp, atol=1e-5) and torch.allclose(
        entropy.double(), ref_entropy, atol=1e-5
    )
    assert torch.allclose(grad.double(), ref_grad, atol=1e-5)
    assert grad[:, 5].abs().max() == 0  # the extra position gets no gradient


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_gradient_through_the_entropy_alone_matches_autograd(temperature):
    # An entropy bonus without a log-prob term in the loss: the backward gets no gradient for the log-probs.
    torch.manual_seed(1)
    leaf = (3 * torch.randn(2, 6, 50)).requires_grad_()
    logits = leaf * 1.0
    expected_logits = (logits.detach() / temperature).double().requires_grad_()
    targets = torch.randint(0, 50, (2, 5))
    weights = torch.randn(2, 5)
    _, entropy = logprobs_and_entropy(logits, targets, chunk_tokens=3, temperature=temperature)
    (grad,) = torch.autograd.grad((entropy * weights).sum(), leaf)
    _, ref_entropy = reference(expected_logits, targets)
    (ref_grad,) = torch.autograd.grad((ref_entropy * weights).sum(), expected_logits)
    assert torch.allclose(entropy.double(), ref_entropy, atol=1e-5)
    assert torch.allclose(grad.double(), ref_grad / temperature, atol=1e-5)
    assert torch.equal(logits.detach(), grad)  # computed in the logits' own memory


def test_a_leaf_is_not_overwritten():
    logits = torch.randn(1, 3, 10, requires_grad=True)
    before = logits.detach().clone()
    logprobs_and_entropy(logits, torch.zeros(1, 3, dtype=torch.long))[0].sum().backward()
    assert torch.equal(logits.detach(), before)


def test_bf16_logits_give_float32_results_and_bf16_gradients():
    torch.manual_seed(1)
    logits = torch.randn(2, 4, 30).bfloat16().requires_grad_()
    targets = torch.randint(0, 30, (2, 4))
    logp, entropy = logprobs_and_entropy(logits, targets, chunk_tokens=2)
    assert logp.dtype == entropy.dtype == torch.float32
    ref_logp, ref_entropy = reference(logits.detach(), targets)
    assert torch.allclose(logp.double(), ref_logp, atol=1e-5)
    logp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_no_grad_builds_no_graph():
    logits = torch.randn(1, 3, 10, requires_grad=True)
    with torch.no_grad():
        logp, entropy = logprobs_and_entropy(logits, torch.zeros(1, 3, dtype=torch.long))
    assert logp.grad_fn is None and entropy.grad_fn is None


@pytest.mark.parametrize("temperature", [0.6, 1.7])
def test_temperature_gives_the_sampled_distribution_and_its_gradient(temperature):
    """With a temperature T the log-probs and entropy are those of softmax(logits / T), what vLLM samples from,
    and the gradient with respect to the logits carries the 1 / T."""
    torch.manual_seed(2)
    leaf = (3 * torch.randn(2, 5, 40)).requires_grad_()
    targets = torch.randint(0, 40, (2, 4))
    weights = torch.randn(2, 4)
    logp, entropy = logprobs_and_entropy(leaf * 1.0, targets, chunk_tokens=3, temperature=temperature)
    (grad,) = torch.autograd.grad((logp * weights).sum() + (0.3 * entropy * weights).sum(), leaf)
    expected_logits = leaf.detach().double().requires_grad_()
    ref_logp, ref_entropy = reference(expected_logits / temperature, targets)
    (ref_grad,) = torch.autograd.grad((ref_logp * weights).sum() + (0.3 * ref_entropy * weights).sum(), expected_logits)
    assert torch.allclose(logp.double(), ref_logp, atol=1e-5) and torch.allclose(
        entropy.double(), ref_entropy, atol=1e-5
    )
    assert torch.allclose(grad.double(), ref_grad, atol=1e-5)
    untempered, _ = logprobs_and_entropy(leaf.detach(), targets)
    assert (untempered - logp.detach()).abs().max() > 0.05  # the comparison can fail


def test_an_entropy_bonus_trains_through_the_module(tiny_model_dir, engine, arithmetic_files, tmp_path):
    """ppo.entropy_coef > 0 takes the entropy's gradient path of the chunked function inside a real update."""
    from tests.helpers import build_run

    trainer, module, datamodule, _ = build_run(tiny_model_dir, engine, arithmetic_files, tmp_path, entropy_coef=0.01)
    trainer.fit(module, datamodule=datamodule)
    row = module.history[-1]
    assert module.actor_optimizer_steps > 0 and row["actor/entropy"] > 0 and row["actor/grad_norm"] > 0
