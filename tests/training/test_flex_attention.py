"""Flex attention for packed micro-batches (model.attn_implementation=flex_attention, issue 37 item 3): each packed
micro-batch one row padded to the plan's fixed budget (the one shape transformers' compiled kernel sees), the flat
layout's mask built by transformers from the packed position ids, the shared-prefix layout's as a BlockMask of the
same rule; the plan's row; the pre-flight's refusal.

Found on this machine's torch (2.13.0+cpu): flex attention's forward runs on a CPU (eager and compiled, the
compiled kernel about 8 s to build for the tiny models), its backward does not ("NotImplementedError: FlexAttention
does not support backward on CPU"). The forwards without gradients (old log-probs, reference, values, the start-up
check) are tested here against the padded layout; a training step with flex attention needs a GPU
(docs/algorithms.md)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from lit_ppo.errors import ConfigError
from lit_ppo.plan import PromptStats, compute_plan
from lit_ppo.training.batching import fixed_row_length, pack, pack_samples
from lit_ppo.training.models import critic_values, prepare_for_training, response_logprobs_and_entropy
from lit_ppo.training.shared_prefix import pack_shared_prefix
from tests.helpers import compose_run_config, ppo_at, run_config
from tests.helpers.packing import TEMPERATURE, realistic_samples

ROW_TOKENS = 4096  # one budget for every forward here: one compiled shape


# make test-no-bf16 holds ATen's kernels to AVX2 on a CPU that has more (ATEN_CPU_CAPABILITY=avx2): there the kernels
# torch.compile builds for flex attention crash the process (SIGSEGV in the compiled kernel; 2026-11-27, torch 2.13 CPU,
# in the fresh clone's `bash .ci/run`), so the tests that compile them run where ATen's kernels are the CPU's own.
compiled_flex = pytest.mark.skipif(
    os.environ.get("ATEN_CPU_CAPABILITY") is not None,
    reason="ATEN_CPU_CAPABILITY set (make test-no-bf16's AVX2 emulation): flex attention's compiled kernels crash there",
)


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    """The tiny Qwen2 model of conftest and a tiny Llama of the same shape, built locally."""
    from lit_ppo.demo.tiny import build_char_tokenizer, padded_vocab_size, save_model_dir

    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    llama = AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(
            vocab_size=padded_vocab_size(len(tokenizer)),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=1024,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.eos_token_id,
        )
    )
    llama_dir = save_model_dir(llama, tokenizer, tmp_path_factory.mktemp("llama") / "model")
    return {"qwen2": tiny_model_dir, "llama": str(llama_dir)}


def loaded(model_dir: str, attention: str):
    """(actor, critic) with `attention`, float32, training mode, dropout off; the critic's value head random."""
    actor = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attention)
    critic = AutoModelForTokenClassification.from_pretrained(
        model_dir, num_labels=1, dtype=torch.float32, attn_implementation=attention
    )
    return prepare_for_training(actor, False), prepare_for_training(critic, False)


def test_a_fixed_row_holds_the_samples_end_to_end_then_its_padding():
    """Two samples in one row of 16 positions: the flat layout's ids and positions, then a segment of padding with
    positions from 0 (transformers reads it as a sequence of its own, which no sample attends to); a micro-batch over
    the budget takes the next multiple of it."""
    mb = pack_samples([[5, 6, 7], [8, 9]], [[10, 11, 12], [13]], 0, "cpu", row_tokens=16)
    assert mb.input_ids.tolist() == [[5, 6, 7, 10, 11, 12, 8, 9, 13] + [0] * 7]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 2] + list(range(7))]
    assert mb.head_index.tolist() == [2, 3, 4, 7]
    assert [fixed_row_length(t, 16) for t in (1, 16, 17, 40)] == [16, 16, 32, 48]
    shared = pack_shared_prefix([[5, 6], [5, 6]], [[10], [11, 12]], 0, "cpu", row_tokens=8)
    assert shared.input_ids.tolist() == [[5, 6, 10, 11, 12, 0, 0, 0]] and shared.attention_mask is None
    assert shared.position_ids.tolist() == [[0, 1, 2, 2, 3, 0, 1, 2]]
    # segments: prompt 0, responses 1 and 2 (attending to 0 as well), the row's end 3 (itself only)
    assert shared.segments.tolist() == [[[0, 0, 1, 2, 2, 3, 3, 3]], [[0, 0, 0, 0, 0, 3, 3, 3]]]


def test_fixed_rows_with_sdpa_give_the_padded_layout_s_logprobs(tiny_model_dir):
    """The fixed-budget row itself (no flex attention): sdpa over the row reads the same numbers as the padded
    layout, float32 within 1e-5, the padding at the row's end read by nothing."""
    actor, critic = loaded(tiny_model_dir, "sdpa")
    prompts, responses, masks = realistic_samples(3, 2, seed=2, episodes=True)
    padded = pack(prompts, responses, 0, "cpu", policy_masks=masks)
    fixed = pack_samples(prompts, responses, 0, "cpu", policy_masks=masks, row_tokens=ROW_TOKENS)
    assert fixed.input_ids.shape == (1, ROW_TOKENS)
    mask = padded.response_mask
    with torch.no_grad():
        a, ea = response_logprobs_and_entropy(actor, padded, TEMPERATURE)
        b, eb = response_logprobs_and_entropy(actor, fixed, TEMPERATURE)
        va, vb = critic_values(critic, padded) * mask, critic_values(critic, fixed)
    assert float((a * mask - b).abs().sum() / mask.sum()) < 1e-5
    torch.testing.assert_close(ea * mask, eb, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(va, vb, rtol=1e-5, atol=1e-5)


@compiled_flex
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_flex_attention_on_fixed_rows_gives_the_padded_layout_s_logprobs_and_values(family, model_dirs):
    """Flex attention on a CPU (forwards without gradients, as the old-log-prob, reference and value forwards run):
    the flat layout in one fixed row (transformers' block mask from the packed position ids) and the shared-prefix
    layout (our BlockMask: each response its prompt and itself) give the padded layout's log-probs, entropies and
    values, float32 within 1e-5 nats per token; every forward has the row's one shape."""
    actor, critic = loaded(model_dirs[family], "flex_attention")
    reference_actor, reference_critic = loaded(model_dirs[family], "sdpa")
    critic.load_state_dict(reference_critic.state_dict())  # the same random value head
    prompts, responses, masks = realistic_samples(2, 4, seed=3, episodes=True)
    padded = pack(prompts, responses, 0, "cpu", policy_masks=masks)
    mask = padded.response_mask
    with torch.no_grad():
        a, ea = response_logprobs_and_entropy(reference_actor, padded, TEMPERATURE)
        va = critic_values(reference_critic, padded) * mask
    assert float(va.abs().max()) > 0
    flat = pack_samples(prompts, responses, 0, "cpu", policy_masks=masks, row_tokens=ROW_TOKENS)
    shared = pack_shared_prefix(prompts, responses, 0, "cpu", policy_masks=masks, row_tokens=ROW_TOKENS)
    assert shared.layout_tokens < sum(len(p) + len(r) for p, r in zip(prompts, responses)) <= ROW_TOKENS
    for mb in (flat, shared):
        assert mb.input_ids.shape == (1, ROW_TOKENS)
        with torch.no_grad():
            b, eb = response_logprobs_and_entropy(actor, mb, TEMPERATURE)
            vb = critic_values(critic, mb)
        error = (a * mask - b).abs()
        assert float(error.sum() / mask.sum()) < 1e-5 and float(error.max()) < 1e-4, float(error.max())
        torch.testing.assert_close(ea * mask, eb, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(va, vb, rtol=1e-5, atol=1e-5)


@compiled_flex
def test_a_flex_shared_prefix_response_never_reads_its_sibling(model_dirs):
    """The block mask keeps siblings apart: a changed response token of sample 0 changes its log-probs and leaves its
    siblings' (the same prompt, the same row) bitwise equal."""
    actor, _ = loaded(model_dirs["qwen2"], "flex_attention")
    prompts, responses, _ = realistic_samples(1, 4, seed=4, episodes=False)
    changed = [list(r) for r in responses]
    changed[0][0] = 4 if changed[0][0] != 4 else 5
    with torch.no_grad():
        a = response_logprobs_and_entropy(
            actor, pack_shared_prefix(prompts, responses, 0, "cpu", row_tokens=ROW_TOKENS), TEMPERATURE
        )[0]
        b = response_logprobs_and_entropy(
            actor, pack_shared_prefix(prompts, changed, 0, "cpu", row_tokens=ROW_TOKENS), TEMPERATURE
        )[0]
    assert not torch.equal(a[0], b[0]) and torch.equal(a[1:], b[1:])


def test_the_plan_states_the_fixed_row_and_the_padding_it_expects():
    """flex_attention, packed: one row of the micro-batch's token budget (ppo.micro_train_max_tokens, else
    micro_train_batch_size x rollout.max_model_len), the positions it expects unused, the shared prefix on (its block
    mask); other implementations have no fixed row."""
    ppo = dataclasses.replace(
        compose_run_config().ppo, n_samples_per_prompt=8, rollout_batch_size=8, micro_train_max_tokens=8192
    )
    stats = PromptStats(count=100, mean_tokens=200.0, min_tokens=100, max_tokens=300)
    flex = compose_run_config("model.attn_implementation=flex_attention").model
    plan = compute_plan(run_config(ppo=ppo, model=flex), 100, stats)
    layout = plan.layout
    assert layout.row_tokens == 8192 and layout.shared_prefix
    laid_out = layout.expected_packed_tokens_per_micro_batch - layout.expected_prefix_tokens_saved_per_micro_batch
    assert layout.expected_row_padding_tokens_per_micro_batch == pytest.approx(8192 - laid_out)
    table = plan.table()
    assert "flex_attention: one row per micro-batch padded to 8192 positions" in table
    assert "expected row padding" in table and "(block mask)" in table
    fixed_size = compute_plan(
        run_config(ppo=dataclasses.replace(ppo, micro_train_max_tokens=None), model=flex), 100, stats
    )
    assert fixed_size.layout.row_tokens == ppo.micro_train_batch_size * compose_run_config().rollout.max_model_len
    assert compute_plan(run_config(ppo=ppo), 100, stats).layout.row_tokens is None
    assert (
        compute_plan(run_config(ppo=dataclasses.replace(ppo, packing=False), model=flex), 100).layout.row_tokens is None
    )


def test_the_pre_flight_refuses_flex_attention_where_torch_cannot_train_with_it(monkeypatch):
    """A torch without flex attention, and a CPU where torch has no flex attention backward (this machine's torch:
    asked, not assumed), are refused in one line naming the setting and the fix; a GPU run is not."""
    import transformers.utils

    from lit_ppo.run import preflight

    assert preflight.flex_backward_on_cpu() is False  # torch 2.13.0+cpu: "does not support backward on CPU"
    with pytest.raises(ConfigError, match=r"^model.attn_implementation=flex_attention: torch .* no flex attention "
                       r"backward on a CPU .*; fix: train on a GPU, or model.attn_implementation=null"):  # fmt: skip
        preflight.check_attention("flex_attention", "cpu")
    monkeypatch.setattr(preflight, "flex_backward_on_cpu", lambda: True)  # a torch that has it
    preflight.check_attention("flex_attention", "cpu")
    preflight.check_attention("flex_attention", "gpu")
    monkeypatch.setattr(transformers.utils, "is_torch_flex_attn_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^model.attn_implementation=flex_attention: needs a torch with flex"):
        preflight.check_attention("flex_attention", "gpu")
    preflight.check_attention("sdpa", "cpu")


@compiled_flex
def test_a_flex_attention_module_s_experience_forwards_are_the_sdpa_module_s(tiny_model_dir, monkeypatch):
    """PPOModule with model.attn_implementation=flex_attention on the CPU (the experience pass has no gradients):
    its packed micro-batches are rows of the plan's row_tokens, the shared-prefix ones too, and the start-up check and
    the old-log-prob, reference and value forwards give the sdpa module's numbers (float32, within 1e-5), and so the
    advantages."""
    from lit_ppo.training import module as module_file
    from lit_ppo.training.module import PPOModule
    from tests.helpers.packing import realistic_batch

    checks = []
    monkeypatch.setattr(
        module_file, "check_packing", lambda *a, check=module_file.check_packing: checks.append(check(*a))
    )
    ppo = ppo_at(2, 4, 8, 4, micro_train_max_tokens=ROW_TOKENS, kl_coef=0.1, old_logprobs="recompute")
    batch = realistic_batch(n_prompts=2, n=4, seed=6, episodes=True)
    experiences = {}
    for attention in ("sdpa", "flex_attention"):
        model = compose_run_config(f"model.attn_implementation={attention}").model
        plan = compute_plan(run_config(ppo=ppo, model=model), 64)
        assert plan.layout.shared_prefix and plan.models.critic_enabled and plan.models.reference_enabled
        torch.manual_seed(0)
        module = PPOModule(
            model_dir=tiny_model_dir, ppo=ppo, plan=plan, pad_token_id=0, temperature=TEMPERATURE,
            attn_implementation=attention,
        )  # fmt: skip
        torch.manual_seed(1)  # a random value head (the run's starts at zero), the same in both modules
        torch.nn.init.normal_(module.critic.score.weight)
        layout = module.micro_batch_layout(batch)
        shapes = {tuple(mb.input_ids.shape) for _, mb in layout.lay_out(layout.split(list(range(8))))}
        if attention == "flex_attention":  # one shape for every micro-batch: the kernel compiles once
            assert shapes == {(1, ROW_TOKENS)}
        module.check_packed_layout(batch)
        experiences[attention] = module.make_experience(batch)
    assert plan.layout.row_tokens == module.row_tokens == ROW_TOKENS
    assert len(checks) == 2 and checks[1].logprob_mean < 1e-5 and checks[1].value_relative < 1e-5, checks[1]
    a, b = experiences["sdpa"], experiences["flex_attention"]
    assert torch.equal(a.mask, b.mask) and float(a.values.abs().max()) > 0
    for field in ("old_logp", "ref_logp", "values", "advantages"):
        torch.testing.assert_close(getattr(b, field), getattr(a, field), rtol=1e-5, atol=1e-5)
