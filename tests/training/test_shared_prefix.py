"""The shared-prefix layout (ppo.shared_prefix, lit_ppo/training/shared_prefix.py): each prompt group's prompt once,
its responses attending to it and to themselves only. Exact against the flat packed layout: log-probs, entropies and
values (sdpa and eager, through peft), gradients for the four loss aggregations, the weights after a rollout step; the
plan's row and refusals; the run-time check of the tokens laid out."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from lit_ppo.config import LoraConfig
from lit_ppo.errors import ConfigError, StepAccountingError
from lit_ppo.plan import PromptStats, check_layout_tokens, compute_plan
from lit_ppo.training.batching import pack_samples
from lit_ppo.training.models import critic_values, prepare_for_training, response_logprobs_and_entropy, with_lora
from lit_ppo.training.packing import shared_prefix_unsupported
from lit_ppo.training.shared_prefix import (
    pack_shared_prefix,
    prefix_tokens_saved,
    shared_prefix_micro_batch_groups,
)
from tests.helpers import compose_run_config, plan_of, ppo_at, run_config
from tests.helpers.packing import (
    TEMPERATURE,
    assert_close_tensors,
    realistic_batch,
    realistic_samples,
    small_ppo,
    train,
)


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def models(request, tiny_model_dir):
    """(actor, critic) of the tiny model with one attention implementation, float32, training mode, dropout off; the
    critic's value head random (a zero head would agree in any layout)."""
    actor = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=request.param)
    critic = AutoModelForTokenClassification.from_pretrained(
        tiny_model_dir, num_labels=1, dtype=torch.float32, attn_implementation=request.param
    )
    return prepare_for_training(actor, False), prepare_for_training(critic, False)


def test_shared_prefix_layout_hand_case():
    """Two prompts of two samples: each prompt once, its responses after it with positions going on from the prompt's
    length, each response attending to its prompt and itself (not its sibling), the head where each response token is
    predicted (token 0 at the prompt's last position), the row ends padding that attends to itself."""
    mb = pack_shared_prefix(
        [[5, 6], [7], [5, 6], [7]], [[10, 11], [12], [13], [14, 15]], 0, "cpu", policy_masks=[[1, 0], [1], [1], [1, 1]]
    )
    # groups: [5, 6] with responses 0 and 2 (5 tokens), [7] with 1 and 3 (4 tokens): one row each, of the longest
    assert mb.input_ids.tolist() == [[5, 6, 10, 11, 13], [7, 12, 14, 15, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 2], [0, 1, 1, 2, 0]]
    assert mb.response_ids.tolist() == [[10, 11], [12, 0], [13, 0], [14, 15]]
    assert mb.response_mask.tolist() == [[1, 0], [1, 0], [1, 0], [1, 1]]
    # 10 at 1 (6); 12 at 5 (7); 13 at 1 (6); 14 at 5 (7), 15 at 7 (14); 11 is an observation: no head
    assert mb.head_index.tolist() == [1, 5, 1, 5, 7]
    assert mb.layout_tokens == 9 and prefix_tokens_saved([[5, 6], [7], [5, 6], [7]]) == 3
    assert mb.attention_mask.shape == (2, 1, 5, 5)
    assert mb.attention_mask[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],  # 10: the prompt and itself
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 1],  # 13: the prompt, not its sibling 10 11
    ]
    assert mb.attention_mask[1, 0, 4].int().tolist() == [0, 0, 0, 0, 1]  # the row's end: itself only


def test_micro_batches_keep_prompt_groups_together():
    """Fixed size: as many micro-batches of as many samples as the flat layout, a group's samples in runs; token
    budget: whole groups within the budget, a group over it in pieces."""
    prompts = [[1] * 100] * 4 + [[2] * 50] * 4
    responses = [10, 20, 30, 40, 5, 5, 5, 5]
    fixed = shared_prefix_micro_batch_groups(prompts, responses, [7, 0, 5, 2, 1, 6, 3, 4], max_samples=4)
    assert [sorted(g) for g in fixed] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    budget = shared_prefix_micro_batch_groups(prompts, responses, list(range(8)), max_samples=8, max_tokens=200)
    assert sorted(map(sorted, budget)) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # 100 + 100 | 50 + 20: whole groups fit
    # 200 tokens over 150: pieces within it, 100 + 30 | 100 + 30 | 100 + 40
    budget = shared_prefix_micro_batch_groups(prompts, responses, list(range(8)), max_samples=8, max_tokens=150)
    assert sorted(map(sorted, budget)) == [[0, 1], [2], [3], [4, 5, 6, 7]]
    assert shared_prefix_micro_batch_groups(prompts, responses, list(range(8)), max_samples=8, max_tokens=1000) == [
        list(range(8))
    ]


@pytest.mark.parametrize("episodes", [False, True], ids=["single-turn", "episodes"])
def test_logprobs_entropies_and_values_equal_the_flat_packed_layout(models, episodes):
    """n = 8 samples of each of 2 GSM8K-length prompts (100-300 tokens), responses up to 256 tokens (episodes: with
    observations the policy did not write): the shared-prefix layout computes fewer tokens and gives the flat layout's
    numbers to float32 rounding, for the actor's log-probs and entropies and the critic's values."""
    actor, critic = models
    prompts, responses, masks = realistic_samples(2, 8, seed=3, episodes=episodes)
    flat = pack_samples(prompts, responses, 0, "cpu", policy_masks=masks)
    shared = pack_shared_prefix(prompts, responses, 0, "cpu", policy_masks=masks)
    real = sum(len(p) + len(r) for p, r in zip(prompts, responses))
    assert shared.layout_tokens == real - 7 * (len(prompts[0]) + len(prompts[8])) < real
    with torch.no_grad():
        a, ea = response_logprobs_and_entropy(actor, flat, TEMPERATURE)
        b, eb = response_logprobs_and_entropy(actor, shared, TEMPERATURE)
        va, vb = critic_values(critic, flat), critic_values(critic, shared)
    assert float(va.abs().max()) > 0  # the loaded value head is random: values that could differ
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(eb, ea, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vb, va, rtol=1e-5, atol=1e-5)


def test_a_changed_sibling_response_leaves_the_others_bitwise_unchanged(models):
    """Sibling responses do not attend to each other: changing sample 0's response changes its log-probs and leaves
    every other sample's, which share its prompt in the row, bitwise equal."""
    actor, _ = models
    prompts, responses, _ = realistic_samples(1, 4, seed=4, episodes=False)
    changed = [list(r) for r in responses]
    changed[0][0] = 4 if changed[0][0] != 4 else 5
    with torch.no_grad():
        a = response_logprobs_and_entropy(actor, pack_shared_prefix(prompts, responses, 0, "cpu"), TEMPERATURE)[0]
        b = response_logprobs_and_entropy(actor, pack_shared_prefix(prompts, changed, 0, "cpu"), TEMPERATURE)[0]
    assert not torch.equal(a[0], b[0])
    assert torch.equal(a[1:], b[1:])


def test_gradients_through_peft_equal_the_flat_packed_layout(tiny_model_dir):
    """With LoRA: the actor's log-probs and the adapter's gradients, the reference (the adapter disabled) and the
    critic's values and gradients, shared prefix against flat packed."""
    from lit_ppo.training.models import adapter_disabled

    lora = LoraConfig(rank=4)
    actor = with_lora(prepare_for_training(AutoModelForCausalLM.from_pretrained(tiny_model_dir), False), lora)
    base = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, num_labels=1)
    critic = with_lora(prepare_for_training(base, False), lora, modules_to_save=["score"])
    torch.manual_seed(0)
    with torch.no_grad():  # adapters off their zero start: the adapted and the reference policies differ
        for name, parameter in [*actor.named_parameters(), *critic.named_parameters()]:
            if "lora_B" in name:
                parameter.normal_(std=0.05)
    prompts, responses, masks = realistic_samples(2, 8, seed=5, episodes=True)
    layouts = [
        pack_samples(prompts, responses, 0, "cpu", policy_masks=masks),
        pack_shared_prefix(prompts, responses, 0, "cpu", policy_masks=masks),
    ]
    out = []
    for mb in layouts:
        actor.zero_grad()
        critic.zero_grad()
        logp = response_logprobs_and_entropy(actor, mb, TEMPERATURE)[0]
        values = critic_values(critic, mb)
        (logp.sum() + values.square().sum()).backward()
        with torch.no_grad(), adapter_disabled(actor):
            reference = response_logprobs_and_entropy(actor, mb, TEMPERATURE)[0]
        grads = {
            f"{m}.{n}": p.grad.clone()
            for m, model in (("actor", actor), ("critic", critic))
            for n, p in model.named_parameters()
            if p.grad is not None
        }
        out.append((logp.detach(), values.detach(), reference, grads))
    (a, va, ra, ga), (b, vb, rb, gb) = out
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vb, va, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rb, ra, rtol=1e-5, atol=1e-5)
    assert any("lora_A" in name for name in ga) and (ra - a).abs().max() > 1e-3
    assert_close_tensors(gb, ga, 1e-5)


# The four loss aggregations; ppo (token-mean, with the critic) in the fast suite, the others read the same log-probs
@pytest.mark.parametrize(
    "preset", ["ppo", *(pytest.param(p, marks=pytest.mark.slow) for p in ("grpo", "gspo", "cispo"))]
)
def test_shared_prefix_and_flat_packed_updates_are_the_same_update(preset, tiny_model_dir, arithmetic_files, tmp_path):
    """Gradients of every optimizer step (actor, and critic with ppo) on the same rollout batch of episodes, n = 4
    (2 prompts of 100-300 tokens), float32, within 1e-5 relative; 2 mini-batches of 2 micro-batches. The shared run
    logs the prompt tokens it did not compute, and the same real tokens."""
    ppo = small_ppo(preset, packing=True)
    batch = realistic_batch(n_prompts=2, n=4, episodes=True)
    flat, flat_grads = train(
        tiny_model_dir, arithmetic_files, tmp_path / "a", batch, dataclasses.replace(ppo, shared_prefix=False)
    )
    shared, shared_grads = train(
        tiny_model_dir, arithmetic_files, tmp_path / "b", batch, dataclasses.replace(ppo, shared_prefix=True)
    )
    assert shared.plan.layout.shared_prefix and not flat.plan.layout.shared_prefix
    assert len(flat_grads) == len(shared_grads) == (4 if preset == "ppo" else 2)
    for a, b in zip(shared_grads, flat_grads):
        assert_close_tensors(a, b, 1e-5)
    flat_row, shared_row = flat.history[-1], shared.history[-1]
    assert shared_row["perf/trained_tokens"] == flat_row["perf/trained_tokens"]
    assert flat_row["perf/prefix_tokens_saved"] == 0
    # whatever samples share a micro-batch, at least the prompts of each micro-batch's groups are saved once
    assert 0 < shared_row["perf/prefix_tokens_saved"] <= sum(3 * len(batch.prompt_ids[4 * g]) for g in range(2))
    assert shared_row["perf/trained_positions"] < flat_row["perf/trained_positions"]
    assert 0 <= shared_row["perf/padding_fraction"] < 0.3


@pytest.mark.slow  # two runs of one rollout step of 32 samples of up to 556 tokens: about 40 s on 2 busy cores
def test_a_rollout_step_ends_with_the_flat_layout_s_weights_at_n_8(tiny_model_dir, arithmetic_files, tmp_path):
    """GSM8K-length prompts (100-300 tokens), n = 8, GRPO with a reference (kl_coef > 0, its forwards in the shared
    layout too), 2 mini-batches: the weights after the rollout step are the flat packed layout's (< 1e-4 relative)."""
    base = compose_run_config("ppo=grpo").ppo
    ppo = dataclasses.replace(
        base,
        rollout_batch_size=4,
        n_samples_per_prompt=8,
        train_batch_size=16,
        micro_train_batch_size=8,
        packing=True,
        kl_coef=0.01,
        actor_lr=1e-3,
    )
    batch = realistic_batch(n_prompts=4, n=8, seed=6, episodes=False)
    flat, _ = train(
        tiny_model_dir, arithmetic_files, tmp_path / "a", batch, dataclasses.replace(ppo, shared_prefix=False)
    )
    shared, _ = train(
        tiny_model_dir, arithmetic_files, tmp_path / "b", batch, dataclasses.replace(ppo, shared_prefix=True)
    )
    weights = [{n: p.detach() for n, p in m.actor.named_parameters()} for m in (shared, flat)]
    assert_close_tensors(*weights, 1e-4)
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert any(not torch.equal(weights[1][n], start[n]) for n in weights[1] if n in start)  # the step moved them
    assert shared.history[-1]["perf/prefix_tokens_saved"] > 0


def test_the_layout_token_check_fires():
    plan = plan_of(64, ppo=dataclasses.replace(compose_run_config().ppo, packing=True))
    check_layout_tokens(plan, 0, 90, 100, 10)
    with pytest.raises(StepAccountingError, match=r"rollout step 1: a shared-prefix micro-batch laid out 95 tokens"):
        check_layout_tokens(plan, 0, 95, 100, 10)


def test_the_plan_resolves_shared_prefix_and_states_the_tokens_it_saves():
    """null: on where packed with several samples per prompt and sdpa/eager; true where not refused in one line; the
    table's packing row and the expected tokens saved per micro-batch."""
    ppo = dataclasses.replace(compose_run_config().ppo, n_samples_per_prompt=8, rollout_batch_size=8)
    stats = PromptStats(count=100, mean_tokens=200.0, min_tokens=100, max_tokens=300)
    plan = compute_plan(run_config(ppo=ppo), 100, stats)
    assert plan.layout.packing and plan.layout.shared_prefix
    # micro-batches of 32 samples hold whole groups of 8: 7/8 of the prompt tokens, prompts 200 of 200 + 1024 tokens
    assert plan.layout.expected_prefix_tokens_saved_per_micro_batch == pytest.approx(
        plan.layout.expected_real_tokens_per_micro_batch * 7 * 200 / (8 * (200 + plan.counts.max_response_tokens))
    )
    assert (
        "expected prefix tokens saved" in plan.table() and "shared prefix: a prompt group's prompt once" in plan.table()
    )
    assert not compute_plan(
        run_config(ppo=dataclasses.replace(ppo, shared_prefix=False)), 100, stats
    ).layout.shared_prefix
    assert not compute_plan(
        run_config(ppo=dataclasses.replace(ppo, n_samples_per_prompt=1, rollout_batch_size=64)), 100
    ).layout.shared_prefix
    for change, reason in (
        (dict(packing=False), "ppo.packing is off"),
        (dict(n_samples_per_prompt=1, rollout_batch_size=64), "no two samples share a prompt"),
    ):
        with pytest.raises(ConfigError, match=f"ppo.shared_prefix=true: .*{reason}.*fix: set ppo.shared_prefix"):
            compute_plan(run_config(ppo=dataclasses.replace(ppo, shared_prefix=True, **change)), 100)
    flash = compose_run_config("model.attn_implementation=flash_attention_2", "ppo.shared_prefix=true")
    with pytest.raises(ConfigError, match="flash_attention_2 takes no ready mask"):
        compute_plan(flash, 100)


def test_models_the_layout_cannot_serve_exactly_are_named(tiny_model_dir):
    from transformers import AutoConfig, Gemma2Config

    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert shared_prefix_unsupported(config, "sdpa") is None and shared_prefix_unsupported(config, "eager") is None
    assert "takes no ready 4-D mask" in shared_prefix_unsupported(config, "flash_attention_2")
    assert "sliding-window layers" in shared_prefix_unsupported(Gemma2Config(), "sdpa")


def test_the_pre_flight_turns_null_off_for_a_model_it_would_not_serve_exactly_and_refuses_true(capsys):
    from transformers import Gemma2Config, Qwen2Config

    from lit_ppo.run.preflight import resolve_shared_prefix

    assert resolve_shared_prefix(None, Qwen2Config(), None) is None  # on where the plan resolves it
    assert resolve_shared_prefix(None, Gemma2Config(), None) is False
    assert "shared prefix: off, the gemma2 model has sliding-window layers" in capsys.readouterr().out
    with pytest.raises(
        ConfigError, match="ppo.shared_prefix=true: the gemma2 model .* fix: set ppo.shared_prefix=false"
    ):
        resolve_shared_prefix(True, Gemma2Config(), "eager")
    assert resolve_shared_prefix(True, None, None) is True  # config.json not here (mode=plan): left as set


@pytest.mark.slow  # two 2-process runs (gloo, DDP) with a vLLM engine per rank: minutes on 2 cores
def test_two_ddp_ranks_with_the_shared_prefix_end_with_the_flat_layout_s_weights(tmp_path_factory):
    """tests/end_to_end/test_ddp.py's settings (2 rollout steps of 2 PPO epochs of 2 mini-batches, PPO with a critic, n = 4),
    `strategy=ddp strategy.devices=2`: the shared-prefix and the flat packed runs end with the same actor (float32
    rounding of the same updates), and the shared run logs the prompt tokens it did not compute."""
    from tests.helpers.cli_runs import DDP, assert_same_weights, final_actor, metrics, train_cli

    cache = tmp_path_factory.mktemp("cache")
    flat = train_cli(tmp_path_factory.mktemp("flat"), cache, *DDP, "ppo.shared_prefix=false")
    shared = train_cli(tmp_path_factory.mktemp("shared"), cache, *DDP, "ppo.shared_prefix=true")
    plans = [json.loads((run / "plan.json").read_text()) for run in (shared, flat)]
    assert plans[0]["layout"]["shared_prefix"] and not plans[1]["layout"]["shared_prefix"]
    assert plans[0]["counts"]["data_parallel_size"] == 2
    assert assert_same_weights(final_actor(shared), final_actor(flat), rel=1e-5) <= 1e-5
    rows = [metrics(run) for run in (shared, flat)]
    assert all(float(r["perf/prefix_tokens_saved"]) > 0 for r in rows[0])
    assert all(float(r["perf/prefix_tokens_saved"]) == 0 for r in rows[1])
    for a, b in zip(rows[0], rows[1], strict=True):
        assert float(a["perf/trained_tokens"]) == float(b["perf/trained_tokens"])


def test_a_config_json_read_as_it_is_shows_its_sliding_window():
    """The pre-flight reads config.json without transformers (mode=plan imports no model library), so the layer types
    transformers derives (Gemma2's) are missing there: a window without a switch that turns it off counts as used."""
    from types import SimpleNamespace

    assert "sliding-window" in shared_prefix_unsupported(
        SimpleNamespace(model_type="gemma2", sliding_window=4096), "sdpa"
    )
    qwen2 = SimpleNamespace(model_type="qwen2", sliding_window=4096, use_sliding_window=False)
    assert shared_prefix_unsupported(qwen2, "sdpa") is None
    assert shared_prefix_unsupported(SimpleNamespace(model_type="llama"), "sdpa") is None
    assert shared_prefix_unsupported(SimpleNamespace(model_type="mistral", sliding_window=None), "eager") is None


# ---------------------------------------------------------------- the ranks' shares keep prompt groups together


def test_group_rank_partition_hand_cases():
    """Groups largest first, each whole to the part with room that computes the fewest tokens; a group no part has
    room for in pieces, largest first; as many samples per part; positions ascending."""
    from lit_ppo.training.rank_samples import group_rank_partition

    a, b, c = [1] * 10, [2] * 20, [3] * 30
    # groups: a x3 (positions 0, 3, 5), b x3 (1, 4, 7), c x2 (2, 6): parts of 4
    prompts = [a, b, c, a, b, a, c, b]
    responses = [1, 2, 3, 4, 5, 6, 7, 8]
    # b (20 + 15 tokens) to part 0; a (10 + 11) to part 1 (fewer tokens so far); c: only part 1 has room (1) and
    # part 0 has 1: pieces of 1 and 1
    assert group_rank_partition(prompts, responses, 2) == [[1, 2, 4, 7], [0, 3, 5, 6]]
    # two groups of 4 on 2 ranks: each whole on one rank, the heavier first
    prompts = [a, a, c, c, a, c, a, c]
    assert group_rank_partition(prompts, [1] * 8, 2) == [[2, 3, 5, 7], [0, 1, 4, 6]]
    with pytest.raises(ValueError, match="cannot split 7 samples into 2 parts"):
        group_rank_partition(prompts[:7], [1] * 7, 2)


def test_two_ranks_keep_each_prompt_group_on_one_rank_and_save_its_prompt_once():
    """GSM8K-length prompts, n = 8, global mini-batches of 16 shuffled samples on 2 ranks (`rank_share`): before,
    the token-balanced split of samples (`equal_count_partition`) put samples of one group on both ranks, whose prompt
    was then laid out on each; with the shared prefix each rank's share holds whole groups where one has room, so the
    two ranks together lay out about as few prompt tokens as one process (a group is cut only where no ranks of as
    many samples can hold the groups whole). The shares are as many samples each and together
    the mini-batch (the update is one process's: the loss denominators are the mini-batch's)."""
    from collections import Counter

    from lit_ppo.plan import minibatch_schedule
    from lit_ppo.training.rank_samples import equal_count_partition, rank_share

    ppo = ppo_at(4, 8, 16, 4)
    batch = realistic_batch(n_prompts=4, n=8, seed=5, episodes=False)
    one, two = compute_plan(run_config(ppo=ppo), 64), compute_plan(run_config(ppo=ppo, dp=2), 64)
    assert two.layout.shared_prefix and two.layout.rank_balance
    tokens = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    groups_split_before = saved_before = saved_after = saved_one = 0
    for minibatch in minibatch_schedule(two, 32, torch.Generator().manual_seed(ppo.shuffle_seed))[0]:
        shares = [rank_share(batch, minibatch, two, rank) for rank in range(2)]
        assert [len(s) for s in shares] == [8, 8] and sorted(shares[0] + shares[1]) == sorted(minibatch)
        assert rank_share(batch, minibatch, one, 0) == minibatch
        before = [[minibatch[j] for j in part] for part in equal_count_partition([tokens[i] for i in minibatch], 2)]
        prompts = lambda share: [batch.prompt_ids[i] for i in share]  # noqa: E731
        groups_split_before += len(
            {tuple(batch.prompt_ids[i]) for i in before[0]} & set(map(tuple, prompts(before[1])))
        )
        sizes = sorted(Counter(map(tuple, prompts(minibatch))).values(), reverse=True)
        split_after = len({tuple(p) for p in prompts(shares[0])} & {tuple(p) for p in prompts(shares[1])})
        # groups of 6, 4, 3, 3 and of 5, 5, 4, 2 samples: no ranks of 8 hold them whole, one group is cut
        assert sizes in ([6, 4, 3, 3], [5, 5, 4, 2]) and split_after == 1
        saved_before += sum(prefix_tokens_saved(prompts(share)) for share in before)
        saved_after += sum(prefix_tokens_saved(prompts(share)) for share in shares)
        saved_one += prefix_tokens_saved(prompts(minibatch))
    # 7 groups of the 8 on both ranks before; the prompt tokens not computed: 2979 before, 3917 now, 4188 on one rank
    assert groups_split_before == 7 and saved_before < 0.75 * saved_one and saved_after > 0.9 * saved_one
