"""Context parallelism (lit_ppo/training/context_parallel.py) is exact: two gloo CPU ranks in one context-parallel group
of C = 2, each running the models on half of every row's positions, compute the one-rank forward's log-probs,
entropies and values, the one-rank PPO loss (actor and critic), and, summed over the group, the one-rank gradients
(float32, < 1e-5 relative), in the padded and the packed layouts and rows of causality alone (of a length C divides and
not), under sdpa and eager attention."""

from __future__ import annotations

import copy
import json
import sys
import traceback

import pytest
import torch
import torch.distributed as dist

from tests.helpers import ROOT
from tests.helpers.ranks import start_ranks

TEMPERATURE = 0.7
TOLERANCE = 1e-5


def _models(checkpointing: bool = False):
    """A tiny Qwen2 actor (4 heads, 2 KV heads: both divide by C = 2) and a critic of its shape with a random value
    head, the same on every rank (seeded); with `checkpointing`, their layers under gradient checkpointing."""
    from transformers import AutoModelForTokenClassification

    from lit_ppo.demo.tiny import build_char_tokenizer, build_tiny_model
    from lit_ppo.training.models import prepare_for_training

    tokenizer = build_char_tokenizer()
    shape = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
    actor = build_tiny_model(tokenizer, **shape, max_position_embeddings=512, seed=0).float()
    config = copy.deepcopy(actor.config)
    config.num_labels = 1
    torch.manual_seed(1)
    critic = AutoModelForTokenClassification.from_config(config).float()
    actor, critic = (prepare_for_training(m, checkpointing) for m in (actor, critic))
    return actor, critic, tokenizer.pad_token_id


def _samples(vocab: int):
    """Four samples with prompts of 100+ tokens and responses of different lengths (odd row lengths: padded to C)."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, vocab - 3, (n,), generator=g).tolist() for n in (101, 130, 117, 124)]
    responses = [torch.randint(3, vocab - 3, (n,), generator=g).tolist() for n in (40, 9, 27, 33)]
    return prompts, responses


def _loss(logp, entropy, values, mb):
    """The PPO loss with a critic on one micro-batch (lit_ppo.training.loss), from fixed old log-probs, advantages,
    returns and old values."""
    from lit_ppo.config import PPOConfig
    from lit_ppo.training.loss import LossInputs, actor_loss, critic_loss

    g = torch.Generator().manual_seed(3)
    mask = mb.response_mask
    noise = lambda: torch.randn(mask.shape, generator=g)  # noqa: E731
    inputs = LossInputs(
        response_mask=mask,
        loss_mask=mask,
        advantages=noise(),
        returns=noise(),
        old_logp=logp.detach() + 0.1 * noise(),  # ratios off 1, some clipped
        rc_weights=None,
        ref_logp=None,
        old_values=values.detach() + 0.1 * noise(),
        num_tokens=mask.sum(),
        num_seqs=torch.tensor(float(mask.shape[0])),
        num_policy_tokens=mask.sum(),
    )
    ppo = PPOConfig(entropy_coef=0.01)
    policy, _ = actor_loss(logp, entropy, inputs, ppo, kl_coef=0.0, max_len=mask.shape[1])
    return policy + critic_loss(values, inputs, ppo)


def _count_recomputes() -> list[int]:
    """[n]: how often, in this process from now on, a checkpointed layer's backward recompute entered the exchange
    again (`context_parallel._recompute_contexts`' recompute context, of a forward that ran inside `ulysses`): none
    where gradient checkpointing is silently inactive (eval mode, a change of transformers' checkpointed layers), which
    the outputs alone would not show. Call it before the models' first context-parallel forward."""
    from contextlib import contextmanager

    from lit_ppo.training import context_parallel

    count, original = [0], context_parallel._recompute_contexts

    def counted():
        forward, recompute = original()
        if not context_parallel._ACTIVE:  # a forward outside the exchange (the one-rank run): nothing to count
            return forward, recompute

        @contextmanager
        def entered():
            count[0] += 1
            with recompute:
                yield

        return forward, entered()

    context_parallel._recompute_contexts = counted  # what `_recompute_inside` gives the checkpointed layers
    return count


def _run(actor, critic, mb, cp):
    """Outputs, loss and gradients of one forward and backward; under `cp` the gradients summed over its group."""
    from lit_ppo.distributed import global_sum
    from lit_ppo.training.context_parallel import context_parallel_logprobs, context_parallel_values
    from lit_ppo.training.models import critic_values, response_logprobs_and_entropy

    actor.zero_grad(set_to_none=True)
    critic.zero_grad(set_to_none=True)
    if cp is None:
        logp, entropy = response_logprobs_and_entropy(actor, mb, TEMPERATURE)
        values = critic_values(critic, mb)
    else:
        logp, entropy = context_parallel_logprobs(actor, mb, cp, TEMPERATURE)
        values = context_parallel_values(critic, mb, cp)
    loss = _loss(logp, entropy, values, mb)
    loss.backward()
    grads = {}
    for prefix, model in (("actor", actor), ("critic", critic)):
        for name, p in model.named_parameters():
            grad = p.grad if cp is None else global_sum(p.grad, cp.group)
            grads[f"{prefix}.{name}"] = grad
    outputs = dict(logp=logp, entropy=entropy, values=values)
    outputs = {name: (x * mb.response_mask).detach() for name, x in outputs.items()}
    return outputs, loss.detach(), grads


def _relative(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _errors(one, many) -> dict[str, float]:
    """The largest relative differences of (outputs, loss, gradients), C ranks against one. The gradients also as one
    vector: a one-element gradient (the value head's bias: a sum over every token with cancellation) summed over the
    ranks in two halves differs by float32 rounding at ~1e-5 of itself."""
    (outputs, loss, grads), (outputs_cp, loss_cp, grads_cp) = one, many
    errors = {name: _relative(outputs_cp[name], outputs[name]) for name in outputs}
    errors["loss"] = _relative(loss_cp, loss)
    errors["gradients"] = float(
        sum((grads_cp[k] - grads[k]).norm() ** 2 for k in grads) ** 0.5
        / sum(g.norm() ** 2 for g in grads.values()) ** 0.5
    )
    errors["worst_gradient_tensor"] = max(_relative(grads_cp[k], grads[k]) for k in grads)
    errors["gradient_norm"] = float(sum(g.norm() ** 2 for g in grads.values()) ** 0.5)
    return errors


def _rank(rank: int, world: int, implementation: str, checkpointing: bool, out: str) -> None:
    sys.path.insert(0, str(ROOT))
    report = {"error": None}
    try:
        dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=world)
        from lit_ppo.topology import RankTopology
        from lit_ppo.training.batching import pack, pack_samples
        from lit_ppo.training.context_parallel import ContextGroup, local_micro_batch
        from lit_ppo.training.shared_prefix import pack_shared_prefix

        topology = RankTopology(rank=rank, world_size=world, context_parallel_size=world).with_groups()
        report["groups"] = [dist.get_process_group_ranks(topology.context_parallel_group)]
        report["groups"].append(dist.get_process_group_ranks(topology.data_parallel_group))
        cp = ContextGroup.of(topology)
        recomputes = _count_recomputes()
        actor, critic, pad = _models(checkpointing)
        actor.config._attn_implementation = critic.config._attn_implementation = implementation
        prompts, responses = _samples(actor.config.vocab_size)
        layouts = {
            "padded": pack(prompts, responses, pad, "cpu"),
            "packed": pack_samples(prompts, responses, pad, "cpu"),
            # one row of 144 tokens, no padding: the whole row's mask is causality alone (sdpa's is_causal, no mask)
            "causal": pack(prompts[2:3], responses[2:3], pad, "cpu"),
            # 139 tokens, padded to 140 for C = 2: still causality alone (no mask under sdpa), packed or padded
            "causal-odd": pack(prompts[1:2], responses[1:2], pad, "cpu"),
            "causal-odd-packed": pack_samples(prompts[1:2], responses[1:2], pad, "cpu"),
            # two prompts of two samples each: each laid out once, its responses attending to it (a 4-D mask)
            "shared-prefix": pack_shared_prefix(prompts[:2] * 2, responses, pad, "cpu"),
            # one sample (139 tokens): its prompt, then its response, causality alone (no mask under sdpa)
            "shared-prefix-one-sample": pack_shared_prefix(prompts[1:2], responses[1:2], pad, "cpu"),
        }
        report["causal_without_mask"] = [
            local_micro_batch(actor, layouts[name], cp).attention_mask is None
            for name in ("causal", "causal-odd", "causal-odd-packed", "shared-prefix-one-sample")
        ]
        report["packing_check"] = _packing_check(actor, critic, layouts["packed"], prompts, responses, pad, cp)
        for layout, mb in layouts.items():
            many = _run(actor, critic, mb, cp)  # the group's outputs, loss and summed gradients, on every rank
            if rank == 0:  # the one-rank run, on one of them
                report[layout] = _errors(_run(actor, critic, mb, None), many)
        report["recomputes"] = recomputes[0]
    except Exception:
        report["error"] = traceback.format_exc()
    with open(f"{out}/rank{rank}.json", "w") as f:
        f.write(json.dumps(report))


def _packing_check(actor, critic, packed, prompts, responses, pad, cp) -> dict:
    """The start-up check of ppo.packing (`packing_check.check_packing`) with the group: what it found, and the widest
    row either decoder ran on (through the exchange: half the packed row's positions, never the whole row)."""
    from lit_ppo.training.batching import pack
    from lit_ppo.training.packing_check import check_packing

    widths = []
    hooks = [  # [rows, positions, H] of each forward's embeddings
        model.get_input_embeddings().register_forward_hook(lambda _m, _args, out: widths.append(out.shape[1]))
        for model in (actor, critic)
    ]
    alone = [pack([p], [r], pad, "cpu") for p, r in zip(prompts, responses)]
    found = check_packing(actor, critic, packed, alone, TEMPERATURE, "32-true", cp)
    for hook in hooks:
        hook.remove()
    return dict(found.__dict__, widest=max(widths), row=packed.input_ids.shape[1])


@pytest.mark.parametrize(
    "implementation, checkpointing",
    [
        ("sdpa", False),
        pytest.param("eager", False, marks=pytest.mark.slow),
        # the backward recomputes each layer after the forward's exchange has exited: it must exchange again
        pytest.param("sdpa", True, id="sdpa-gradient-checkpointing"),
    ],
)
def test_two_context_parallel_ranks_compute_the_one_rank_outputs_loss_and_gradients(
    implementation, checkpointing, tmp_path
):
    start_ranks(_rank, 2, 2, implementation, checkpointing, str(tmp_path))
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, report in enumerate(reports):
        assert report["error"] is None, report["error"]
        assert report["groups"] == [[0, 1], [rank]]
        assert (report["recomputes"] > 0) == checkpointing, report["recomputes"]  # the recomputes ran, exchanging
        assert report["causal_without_mask"] == [implementation == "sdpa"] * 4  # eager always has its additive mask
        found = report["packing_check"]  # through the exchange: each rank half a packed row, as in training
        assert found["widest"] == -(-found["row"] // 2) and found["hidden_relative"] is None, found
        assert found["logprob_mean"] < 1e-6 and found["value_relative"] < 1e-6, found
    layouts = ("padded", "packed", "causal", "causal-odd", "causal-odd-packed", "shared-prefix")
    for layout in (*layouts, "shared-prefix-one-sample"):
        errors = reports[0][layout]
        print(implementation, layout, errors)  # the figures, with pytest -s
        assert errors.pop("gradient_norm") > 1e-3, layout  # gradients that are there to compare
        assert errors.pop("worst_gradient_tensor") < 1e-4, (layout, errors)
        assert max(errors.values()) < TOLERANCE, (layout, errors)


def test_heads_not_divisible_by_c_are_refused_in_one_line():
    from transformers import Qwen2Config

    from lit_ppo.errors import ConfigError
    from lit_ppo.training.context_parallel import check_model

    config = Qwen2Config(num_attention_heads=4, num_key_value_heads=1, hidden_size=64)
    config._attn_implementation = "sdpa"
    with pytest.raises(ConfigError, match=r"^strategy.context_parallel_size=2: the model's 4 attention heads and 1 KV"):
        check_model(config, 2)
    check_model(config, 1)
    windowed = Qwen2Config(num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=16)
    windowed._attn_implementation = "sdpa"
    with pytest.raises(ConfigError, match="sliding-window attention"):
        check_model(windowed, 2)
    flash = Qwen2Config(num_attention_heads=4, num_key_value_heads=2)
    flash._attn_implementation = "flash_attention_2"
    with pytest.raises(ConfigError, match="model.attn_implementation=flash_attention_2 is not built"):
        check_model(flash, 2)


@pytest.mark.parametrize("layout", ["padded", "packed", "shared-prefix"])
def test_a_row_of_causality_alone_gets_no_whole_row_mask_at_a_length_not_divisible_by_c(layout, monkeypatch):
    """One sample's row (no padding, one sequence; in the shared-prefix layout its prompt, then its response) of 139
    tokens at C = 2 and 4: the rank's micro-batch has no [L, L] mask (sdpa's is_causal, as the one-rank forward), and
    none is built, though `local_micro_batch` adds columns up to a multiple of C (transformers, given their padding or
    restarted positions, builds the whole rows' mask: 256 MiB of bool at 16k tokens, and sdpa a float copy of it per
    layer; the shared-prefix layout's own rule, `segment_mask`, as much); two samples still get the whole rows' 4-D
    mask, of the added width. Exactness of the odd row:
    `test_two_context_parallel_ranks_compute_the_one_rank_outputs_loss_and_gradients`."""
    from lit_ppo.training import context_parallel
    from lit_ppo.training.batching import pack, pack_samples
    from lit_ppo.training.context_parallel import ContextGroup, local_micro_batch
    from lit_ppo.training.shared_prefix import pack_shared_prefix, segment_mask

    actor, _, pad = _models()
    prompts, responses = _samples(actor.config.vocab_size)
    lay_out = {"padded": pack, "packed": pack_samples, "shared-prefix": pack_shared_prefix}[layout]
    one = lay_out(prompts[1:2], responses[1:2], pad, "cpu")  # 130 + 9 tokens
    two = lay_out(prompts[:2], responses[:2], pad, "cpu")
    assert one.input_ids.shape[1] % 2 == 1
    built = []  # the shared-prefix rule's dense masks built by `local_micro_batch`
    monkeypatch.setattr(context_parallel, "segment_mask", lambda s: built.append(s.shape) or segment_mask(s))
    for size in (2, 4):
        for rank in range(size):
            cp = ContextGroup(group=None, size=size, rank=rank)
            before = len(built)
            local = local_micro_batch(actor, one, cp)
            assert local.attention_mask is None and len(built) == before, (size, rank)
            assert local.input_ids.shape[1] == -(-139 // size)
            if layout == "shared-prefix" and size == 4:
                continue  # its own rule's mask is built after the model's check: 2 KV heads do not divide by 4
            mask = local_micro_batch(actor, two, cp).attention_mask
            width = -(-two.input_ids.shape[1] // size) * size
            assert mask is not None and mask.shape[-2:] == (width, width), (size, rank)
    assert len(built) == (2 if layout == "shared-prefix" else 0)  # the two samples' masks at C = 2: the count sees them


# ---------------------------------------------------------------- one rollout step of the training step, C = 2

STEP_VARIANTS = {  # (preset, packed rows, strategy, ranks: groups of C = 2, options)
    "ppo-critic-padded": ("ppo", False, "ddp", 2, ()),
    "ppo-critic-padded-gradient-checkpointing": ("ppo", False, "ddp", 2, ("gradient_checkpointing",)),
    "grpo-packed": ("grpo", True, "ddp", 2, ()),
    "fsdp-ppo-critic-packed": ("ppo", True, "fsdp", 2, ()),
    "ppo-critic-packed": ("ppo", True, "ddp", 2, ()),
    "grpo-padded": ("grpo", False, "ddp", 2, ()),
    "ppo-critic-packed-4-ranks": ("ppo", True, "ddp", 4, ()),  # 2 data-parallel groups x C = 2
    "fsdp-ppo-critic-packed-gradient-checkpointing": ("ppo", True, "fsdp", 2, ("gradient_checkpointing",)),
    "lora-ppo-critic-packed": ("ppo", True, "ddp", 2, ("lora",)),
    "fsdp-lora-grpo-padded-gradient-checkpointing": ("grpo", False, "fsdp", 2, ("lora", "gradient_checkpointing")),
    "lora-ppo-critic-shared-prefix": ("ppo", True, "ddp", 2, ("lora", "shared_prefix")),
    "grpo-shared-prefix-gradient-checkpointing": ("grpo", True, "ddp", 2, ("shared_prefix", "gradient_checkpointing")),
}
STEP_METRICS = ("actor/policy_loss", "actor/entropy", "actor/grad_norm", "critic/value_loss", "critic/grad_norm")
STEP_COUNTS = ("perf/trained_tokens", "rollout/advantage_mean", "rollout/reward_mean", "rollout/response_length_mean")


def _step_inputs(root, variant: str, ranks: int, data_parallel_rank: int = 0):
    """The rollout step the one-rank and the C = 2 runs both train: a tiny Qwen2 of 4 heads and 2 KV heads (both divide
    by C), 2 prompts of 100-140 tokens x 4 responses of 1-60 tokens, mini-batches of 4 samples in micro-batches of 2
    (2 optimizer steps), at temperature 0.7, on `ranks` ranks (more than 1: context_parallel_size=2, each data-parallel
    rank given its contiguous share of the samples, as generation gives it)."""
    import dataclasses
    from pathlib import Path

    from lit_ppo.config import LoraConfig, ModelConfig, StrategyConfig
    from lit_ppo.demo.arithmetic import make_problems, write_jsonl
    from lit_ppo.demo.tiny import build_char_tokenizer, build_tiny_model, save_model_dir
    from lit_ppo.plan import compute_plan
    from lit_ppo.testing import synthetic_rollout_batch
    from tests.helpers import ppo_at, run_config
    from tests.helpers.packing import realistic_rollout

    root = Path(root)
    preset, packed, name, _, _ = STEP_VARIANTS[variant]
    if not (root / "model").exists():  # the same weights in every process (seeded)
        tokenizer = build_char_tokenizer()
        shape = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
        save_model_dir(
            build_tiny_model(tokenizer, **shape, max_position_embeddings=512, seed=0), tokenizer, root / "model"
        )
        write_jsonl(make_problems(seed=0, max_operand=20, n_train=16, n_eval=1)[0], root / "train.jsonl")
    options = STEP_VARIANTS[variant][4]
    shared = "shared_prefix" in options
    ppo = ppo_at(2, 4, 4, 2, preset, actor_lr=1e-3, critic_lr=1e-3, packing=packed, shared_prefix=shared)
    rollout = realistic_rollout()
    rewards = torch.tensor([0.0, 1.0, 0.5, 1.0, 0.0, 0.0, 1.0, 0.25])
    batch = synthetic_rollout_batch(2, 4, (100, 140), (1, 60), seed=0, rewards=rewards)
    C = min(ranks, 2)
    share = len(batch.response_ids) * C // ranks
    batch = batch.with_samples(
        [batch], [(0, i) for i in range(data_parallel_rank * share, (data_parallel_rank + 1) * share)]
    )
    strategy = StrategyConfig(name=name if ranks > 1 else "single", accelerator="cpu", devices=ranks)
    strategy = dataclasses.replace(strategy, precision="32-true", context_parallel_size=C)
    model = ModelConfig(lora=_module_options(variant).get("lora", LoraConfig()))
    config = dataclasses.replace(run_config(ppo=ppo, rollout=rollout, steps=1, model=model), strategy=strategy)
    return str(root / "model"), root / "train.jsonl", batch, ppo, rollout, lambda n: compute_plan(config, n)


def _module_options(variant: str) -> dict:
    """PPOModule's settings of a variant's options: gradient checkpointing, a LoRA of rank 8 (on actor and critic)."""
    from lit_ppo.config import LoraConfig

    settings = {"gradient_checkpointing": dict(gradient_checkpointing=True), "lora": dict(lora=LoraConfig(rank=8))}
    return {k: v for option in STEP_VARIANTS[variant][4] for k, v in settings.get(option, {}).items()}


def _train_step(root, variant: str, ranks: int, data_parallel_rank: int = 0, **trainer):
    """One rollout step (`train_on_fixed_batch`: the Lightning trainer and PPOModule's training step) on `ranks`
    ranks: the gradients at each optimizer step, the metrics row, the experience and the final weights."""
    from lit_ppo.distributed import full_tensors, gathered
    from tests.helpers.fixed_batch import train_on_fixed_batch

    model_dir, prompts, batch, ppo, rollout, plan_for = _step_inputs(root, variant, ranks, data_parallel_rank)
    options = _module_options(variant)
    experiences = []

    def record(module):
        make = module.make_experience
        module.make_experience = lambda b: experiences.append(make(b)) or experiences[-1]
        if "lora" in options:  # adapters that change the policy from the start: the reference (adapter off) differs
            g = torch.Generator().manual_seed(4)
            with torch.no_grad():
                for name, p in module.named_parameters():
                    if "lora_B" in name:
                        p.copy_(0.05 * torch.randn(p.shape, generator=g))

    module, grads = train_on_fixed_batch(
        model_dir,
        prompts,
        root,
        batch,
        ppo,
        rollout,
        plan_for,
        temperature=TEMPERATURE,
        prepare=record,
        **options,
        **trainer,
    )
    exp = {k: getattr(experiences[0], k) for k in ("old_logp", "ref_logp", "values", "advantages", "returns")}
    weights = {f"actor.{k}": v for k, v in full_tensors(module.actor)}  # FSDP: gathered (a collective)
    if module.critic is not None:
        weights.update({f"critic.{k}": v for k, v in full_tensors(module.critic)})
    if "lora" in options:  # the trained weights alone (the frozen base would set the scale of _weights_apart)
        weights = {k: v for k, v in weights.items() if "lora_" in k or "modules_to_save" in k}
    grads = [{name: gathered(g) for name, g in step.items()} for step in grads]
    engine = type(module.trainer.datamodule.engine).__name__
    return dict(
        grads=grads, row=module.history[-1], experience=exp, weights=weights, plan=module.plan.to_dict(), engine=engine
    )


def _step_rank(rank: int, world: int, variant: str, port: int, out: str) -> None:
    """A rank as a launcher starts it (its rank variables set): Lightning's DDP strategy joins the process group. Each
    rank's own rollout batch would have rewards of its rank and of the moment (a judge's, a timed code run's): the
    group's rank 0's batch (rank 0's: the one-rank run's rewards) is what every rank of the group must train."""
    import dataclasses
    import os
    import time

    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from lit_ppo.testing import FixedBatchDataModule
    from lit_ppo.training import module

    produced, fixed = [], FixedBatchDataModule.produce_rollout

    def rank_and_time_rewards(self, rollout_step):
        produced.append(rollout_step)
        batch = fixed(self, rollout_step)
        return dataclasses.replace(batch, rewards=batch.rewards + rank % 2 * (1.0 + time.time() % 1))

    FixedBatchDataModule.produce_rollout = rank_and_time_rewards  # in this rank's process only
    recomputes = _count_recomputes()
    module.device_peak_memory_gib = lambda device: 1.0 + rank  # a CUDA peak of this rank's (None on a CPU)

    sys.path.insert(0, str(ROOT))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), NODE_RANK="0")
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank))
    report = {"error": None}
    try:
        if STEP_VARIANTS[variant][2] == "fsdp":  # FSDP2 over every rank, the context-parallel groups orthogonal
            strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
        else:
            strategy = DDPStrategy(process_group_backend="gloo", find_unused_parameters=True)
        report.update(_train_step(f"{out}/rank{rank}", variant, world, rank // 2, devices=world, strategy=strategy))
        report["produced"], report["recomputes"] = produced, recomputes[0]
    except Exception:
        report["error"] = traceback.format_exc()
    torch.save(report, f"{out}/step{rank}.pt")


def _max_relative(a: dict, b: dict) -> float:
    """The largest |a - b| / |b| (Euclidean norms) over the tensors of `b` that are not all zero."""
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).norm() / b[k].norm()) for k in b if b[k] is not None and b[k].norm() > 0)


def _weights_apart(a: dict, b: dict) -> float:
    """The largest entry difference over the largest weight (tests/helpers/cli_runs.py:assert_same_weights' measure:
    the critic's value head starts at zero, where a tensor's own norm would read Adam's rounding as large)."""
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max()) for k in b) / max(float(w.abs().max()) for w in b.values())


@pytest.mark.parametrize(
    "variant",
    # the default suite: PPO with a critic on padded rows (packed rows: the forward's test above), and with LoRA in the
    # shared-prefix layout (gradient checkpointing: the forward's test above); the rest slow
    [
        pytest.param(v, marks=() if v in ("ppo-critic-padded", "lora-ppo-critic-shared-prefix") else pytest.mark.slow)
        for v in STEP_VARIANTS
    ],
)
def test_a_rollout_step_on_two_context_parallel_ranks_trains_the_one_rank_step(variant, tmp_path):
    """strategy=ddp (and fsdp), devices=2, context_parallel_size=2 (one group of 2 ranks sharing the samples): the experience
    (old and reference log-probs, values, advantages), the gradients of every optimizer step (summed over the group's
    token shares by DDP's average, scaled by the 2 ranks), the metrics row and the final weights are the one-rank
    step's, float32, < 1e-5 relative. Fails with the loss scaled by the data-parallel size alone (gradients half)."""
    from tests.helpers import free_port

    world = STEP_VARIANTS[variant][3]
    start_ranks(_step_rank, world, world, variant, free_port(), str(tmp_path))
    ranks = [torch.load(tmp_path / f"step{r}.pt", weights_only=False) for r in range(world)]
    for rank, report in enumerate(ranks):
        assert report["error"] is None, report["error"]
        # the slowest rank's seconds and the largest peak, over every rank (not only context-parallel rank 0's)
        assert report["row"]["perf/device_peak_memory_gib"] == float(world), rank
        timings = {k: v for k, v in report["row"].items() if k.startswith("timing/")}
        assert len(timings) >= 6 and timings == {k: ranks[0]["row"][k] for k in timings}, rank
        assert report["produced"] == ([0] if rank % 2 == 0 else []), rank  # a group's rank 0 alone generates
        assert report["engine"] == ("NullEngine" if rank % 2 == 0 else "FollowerEngine"), rank
        checkpointing = "gradient_checkpointing" in STEP_VARIANTS[variant][4]
        assert (report["recomputes"] > 0) == checkpointing, (rank, report["recomputes"])
    one = _train_step(tmp_path / "one", variant, 1)
    cp = ranks[0]
    counts = cp["plan"]["counts"]
    assert (counts["data_parallel_size"], counts["context_parallel_size"]) == (world // 2, 2)
    assert cp["plan"]["layout"]["sequence_length_divisor"] == 2
    assert cp["plan"]["layout"]["shared_prefix"] == ("shared_prefix" in STEP_VARIANTS[variant][4])
    errors = {}
    if world == 2:  # one data-parallel rank: its experience is the whole batch's
        errors["experience"] = _max_relative(cp["experience"], one["experience"])
    assert len(cp["grads"]) == len(one["grads"]) >= 2  # 2 optimizer steps (and the critic's)
    errors["gradients"] = max(_max_relative(a, b) for a, b in zip(cp["grads"], one["grads"], strict=True))
    errors["weights"] = _weights_apart(cp["weights"], one["weights"])
    for rank in range(1, world):
        errors[f"weights, rank {rank}"] = _weights_apart(ranks[rank]["weights"], one["weights"])
    print(variant, errors)  # the figures, with pytest -s
    assert max(errors.values()) < TOLERANCE, errors
    for key in STEP_METRICS + STEP_COUNTS:
        if key in one["row"]:
            assert cp["row"][key] == pytest.approx(one["row"][key], rel=1e-5, abs=1e-7), key
