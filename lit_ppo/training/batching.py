"""How a rank's samples become the model's inputs: micro-batches chosen by count or token budget
(`micro_batch_groups`), and the rows of one micro-batch laid out for a forward (`pack`: prompts left-padded, responses
right-padded, with the episodes' policy masks and the check of the ids vLLM produced).

Shapes: B samples of a micro-batch, P its widest prompt, T its longest response.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lit_ppo.batch import RolloutBatch
from lit_ppo.config import PPOConfig
from lit_ppo.distributed import global_max
from lit_ppo.errors import RolloutMismatchError
from lit_ppo.plan import StepPlan


@dataclass
class MicroBatch:
    input_ids: Tensor  # [B, P+T] prompt left-padded, response right-padded
    attention_mask: Tensor  # [B, P+T]
    position_ids: Tensor  # [B, P+T]
    response_ids: Tensor  # [B, T]
    response_mask: Tensor  # [B, T] float
    prompt_width: int  # P


def pack(
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    pad_id: int,
    device,
    policy_masks: list[list[int]] | None = None,
    expected_ids: list[list[int]] | None = None,
) -> MicroBatch:
    """Left-pad prompts and right-pad responses so every response starts at column P.

    `policy_masks` (multi-turn episodes): per response token 1 where the policy wrote it, 0 on observations;
    `response_mask` is then 1 on the policy's tokens only, so no loss, KL, entropy or token count reaches an
    observation (the model still reads them: they stay in the attention mask). `expected_ids`: per sample the
    ids vLLM was given and produced; every packed row must be exactly them (`check_packed_ids`)."""
    P = max(len(p) for p in prompt_ids)
    T = max(1, max(len(r) for r in response_ids))
    B = len(prompt_ids)
    input_ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    attention = torch.zeros((B, P + T), dtype=torch.long)
    policy = torch.zeros((B, T), dtype=torch.float32)
    for b, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        input_ids[b, P - len(p) : P] = torch.tensor(p)
        input_ids[b, P : P + len(r)] = torch.tensor(r, dtype=torch.long)
        attention[b, P - len(p) : P + len(r)] = 1
        if policy_masks is not None:
            if len(policy_masks[b]) != len(r):
                raise RolloutMismatchError(
                    f"sample {b} of a micro-batch: {len(policy_masks[b])} policy-mask entries for "
                    f"{len(r)} response tokens; the episode's mask and ids were built apart"
                )
            policy[b, : len(r)] = torch.tensor(policy_masks[b], dtype=torch.float32)
    if expected_ids is not None:
        check_packed_ids(input_ids, attention, expected_ids)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    response_mask = attention[:, P:].float()
    if policy_masks is not None:
        response_mask = response_mask * policy
    return MicroBatch(
        input_ids.to(device),
        attention.to(device),
        position_ids.to(device),
        input_ids[:, P:].to(device),
        response_mask.to(device),
        P,
    )


def padded_tokens(prompt_lengths: list[int], response_lengths: list[int], group: list[int]) -> int:
    """Positions `pack` lays out for the samples `group`: rows x (widest prompt + longest response, at least 1)."""
    return len(group) * (max(prompt_lengths[i] for i in group) + max(1, max(response_lengths[i] for i in group)))


def micro_batch_groups(
    prompt_lengths: list[int],
    response_lengths: list[int],
    indices: list[int],
    *,
    max_samples: int,
    max_tokens: int | None = None,
    min_count: int = 0,
) -> list[list[int]]:
    """Split the samples `indices` (one mini-batch, or the whole batch for the experience pass) into micro-batches.

    Both ways take the samples sorted by length (prompt + response, longest first; ties keep their order), so that
    samples of similar length share a micro-batch and pad little. The split does not change the update: the loss
    denominators are the mini-batch's (`loss_denominators`), and every micro-batch's gradient is summed into the
    same step. Fixed size (max_tokens None): consecutive runs of `max_samples` of that order. Token budget: each
    micro-batch filled while its padded size (`padded_tokens`) stays within `max_tokens`; a sample longer than the
    budget gets a micro-batch of its own. `min_count`: split the largest micro-batches in two until there are at
    least this many (data-parallel ranks must run as many forwards, FSDP gathers weights in each)."""
    order = sorted(indices, key=lambda i: prompt_lengths[i] + response_lengths[i], reverse=True)
    if max_tokens is None:
        return [order[start : start + max_samples] for start in range(0, len(order), max_samples)]
    groups: list[list[int]] = []
    for i in order:
        if groups and padded_tokens(prompt_lengths, response_lengths, groups[-1] + [i]) <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    while len(groups) < min_count:
        largest = max(range(len(groups)), key=lambda g: len(groups[g]))
        if len(groups[largest]) < 2:
            raise ValueError(f"cannot make {min_count} micro-batches of {len(indices)} samples")
        group = groups.pop(largest)
        half = len(group) // 2
        groups[largest:largest] = [group[:half], group[half:]]
    return groups


def padding_fraction(prompt_lengths: list[int], response_lengths: list[int], groups: list[list[int]]) -> float:
    """Share of the positions the forwards of `groups` compute that are padding (0: none)."""
    positions = sum(padded_tokens(prompt_lengths, response_lengths, g) for g in groups)
    real = sum(prompt_lengths[i] + response_lengths[i] for g in groups for i in g)
    return 1 - real / positions if positions else 0.0


def check_packed_ids(input_ids: Tensor, attention: Tensor, expected_ids: list[list[int]]) -> None:
    """Each packed row's attended ids are exactly `expected_ids` (what vLLM was given and produced for the
    episode): the trainer computes log-probs of the tokens that were sampled, in the context they were sampled
    in. Cheap: one comparison per token, on the CPU tensors before they move to the device."""
    for b, expected in enumerate(expected_ids):
        packed = input_ids[b][attention[b].bool()].tolist()
        if packed != list(expected):
            first = next(
                (i for i, (x, y) in enumerate(zip(packed, expected)) if x != y), min(len(packed), len(expected))
            )
            raise RolloutMismatchError(
                f"sample {b} of a micro-batch: the ids the trainer packs differ from the ids vLLM was given and produced "
                f"at position {first} of {len(expected)} (packed {packed[first : first + 5]}, vLLM {list(expected)[first : first + 5]}); "
                "the trajectory was rebuilt instead of kept (e.g. decoded and re-encoded); rollout.check_token_ids=false "
                "turns this check off"
            )


def rank_micro_batch_groups(
    batch: RolloutBatch, indices: list[int], ppo: PPOConfig, plan: StepPlan, device
) -> list[list[int]]:
    """This rank's micro-batches of `indices` (`micro_batch_groups`): ppo.micro_train_batch_size samples each, or by
    token budget (ppo.micro_train_max_tokens). Under data parallelism with a token budget every rank runs as many
    micro-batches as the rank that needs the most (FSDP gathers weights in each forward, a collective)."""
    max_samples, max_tokens = ppo.micro_train_batch_size, ppo.micro_train_max_tokens
    lengths = [len(p) for p in batch.prompt_ids], [len(r) for r in batch.response_ids]
    groups = micro_batch_groups(*lengths, indices, max_samples=max_samples, max_tokens=max_tokens)
    if max_tokens is not None and plan.data_parallel_size > 1:
        count = int(global_max(torch.tensor(float(len(groups)), device=device)))
        groups = micro_batch_groups(*lengths, indices, max_samples=max_samples, max_tokens=max_tokens, min_count=count)
    return groups


def packed_micro_batches(batch: RolloutBatch, groups: list[list[int]], pad_token_id: int, device):
    """(indices, MicroBatch) per group; episodes bring their policy masks and the ids the trainer must pack."""
    masks, expected = batch.policy_masks, batch.episode_ids
    for idx in groups:
        yield (
            idx,
            pack(
                [batch.prompt_ids[i] for i in idx],
                [batch.response_ids[i] for i in idx],
                pad_token_id,
                device,
                policy_masks=None if masks is None else [masks[i] for i in idx],
                expected_ids=None if expected is None else [expected[i] for i in idx],
            ),
        )
