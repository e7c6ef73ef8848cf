"""How a rank's samples become the model's inputs (which samples a rank holds, for the experience pass and of each
global mini-batch, is training/rank_samples.py's): micro-batches chosen by count or token budget
(`micro_batch_groups`, or `packed_micro_batch_groups`: a balanced partition by real tokens), and the rows of one
micro-batch laid out for a forward: `pack` (padded: prompts left-padded, responses right-padded) or `pack_samples`
(ppo.packing: whole samples end to end, position ids restarting at each, no padding between them), each with the
episodes' policy masks; and the check that the episodes' ids are the ones vLLM produced, made by every rank together
before a step's first forward (`check_rollout_ids`).

Shapes: B samples of a micro-batch, P its widest prompt, T its longest response; packed: R rows of L positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lit_ppo.batch import RolloutBatch
from lit_ppo.config import PPOConfig
from lit_ppo.distributed import all_gather_objects, global_max
from lit_ppo.errors import RolloutMismatchError
from lit_ppo.plan import StepPlan


@dataclass
class MicroBatch:
    input_ids: Tensor  # [B, P+T] prompt left-padded, response right-padded; packed: [R, L] samples end to end
    attention_mask: Tensor | None  # [B, P+T]; packed: None (transformers builds the mask from the position ids),
    # shared prefix: [R, 1, L, L] bool, True where a position attends (training/shared_prefix.py)
    position_ids: Tensor  # [B, P+T]; packed: [R, L], 0 at each sample's first token
    response_ids: Tensor  # [B, T]
    response_mask: Tensor  # [B, T] float
    prompt_width: int  # P; packed: 0 (no common column where responses start)
    # packed: [n] flat positions of input_ids.view(-1) whose hidden states predict the response tokens where
    # response_mask > 0, in the row-major order of those [B, T] entries (the LM head runs there only)
    head_index: Tensor | None = None
    layout_tokens: int | None = None  # shared prefix (ppo.shared_prefix): real tokens laid out, each prompt once
    # shared prefix: [2, R, L] each position's segment (a prompt, a response, a row's end) and the segment it may
    # attend to besides its own (its prompt), what the masks are built from (`shared_prefix.attention_mask_for`)
    segments: Tensor | None = None

    @property
    def packed(self) -> bool:
        return self.head_index is not None

    @property
    def positions(self) -> int:
        """Positions the forward computes (real tokens and padding)."""
        return self.input_ids.numel()


def pack(
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    pad_id: int,
    device,
    policy_masks: list[list[int]] | None = None,
) -> MicroBatch:
    """Left-pad prompts and right-pad responses so every response starts at column P.

    `policy_masks` (multi-turn episodes): per response token 1 where the policy wrote it, 0 on observations;
    `response_mask` is then 1 on the policy's tokens only, so no loss, KL, entropy or token count reaches an
    observation (the model still reads them: they stay in the attention mask). Each row holds exactly the sample's
    prompt + response, which `check_rollout_ids` compared with the ids vLLM was given and produced."""
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


def pack_samples(
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    pad_id: int,
    device,
    policy_masks: list[list[int]] | None = None,
    one_row: bool = False,
    row_tokens: int | None = None,
) -> MicroBatch:
    """Whole samples (prompt + response, with an episode's observations) laid end to end in rows, position ids
    restarting at 0 at each sample, no attention mask: transformers reads the packed position ids and keeps each
    sample's attention within itself (masking_utils.find_packed_sequence_indices: a block-diagonal causal mask for
    sdpa/eager; flash-attention's varlen kernel in one row). The outputs keep `pack`'s per-sample [B, T] layout.

    Rows: `one_row` for varlen kernels, whose cost is per sample. Otherwise the kernels compute the whole row's
    attention (a square of the row's length), so the samples fill rows of up to twice the longest sample (`packed_rows`): a
    row's attention then costs per token at most about twice a padded row's, while the rows' ends pad little even in
    small micro-batches (one forward and backward of 16 realistic samples on the 24 M bench model, CPU seconds: one
    row 1.1x the padded layout's, rows of twice the longest sample 0.73x, of the longest 0.69x, which pads 2 samples
    of 400 and 200 tokens to 800 positions). A row's unused end is a segment of its own (positions from 0) that no
    sample attends to.

    `row_tokens` (flex attention, `plan.layout.row_tokens`): one row padded to that many positions, so that every
    forward has the shape the kernel was compiled for (`fixed_row_length`)."""
    B = len(prompt_ids)
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
    T = max(1, max(len(r) for r in response_ids))
    if one_row or row_tokens is not None:
        rows = [list(range(B))]
    else:
        rows = packed_rows(lengths)
    L = max(sum(lengths[b] for b in row) for row in rows)
    if row_tokens is not None:
        L = fixed_row_length(L, row_tokens)
    input_ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), L), dtype=torch.long)
    start = [0] * B  # flat position of each sample's first token
    for r, row in enumerate(rows):
        offset = 0
        for b in row:
            ids = list(prompt_ids[b]) + list(response_ids[b])
            input_ids[r, offset : offset + len(ids)] = torch.tensor(ids, dtype=torch.long)
            position_ids[r, offset : offset + len(ids)] = torch.arange(len(ids))
            start[b] = r * L + offset
            offset += len(ids)
        position_ids[r, offset:] = torch.arange(L - offset)
    responses, response_mask = policy_mask_rows(response_ids, policy_masks, pad_id, T)
    # Response token t of sample b is predicted by the hidden state at its prompt's last position + t.
    b_index, t_index = response_mask.nonzero(as_tuple=True)  # row-major over [B, T]
    first = torch.tensor([start[b] + len(prompt_ids[b]) - 1 for b in range(B)], dtype=torch.long)
    head_index = first[b_index] + t_index
    return MicroBatch(
        input_ids.to(device),
        None,
        position_ids.to(device),
        responses.to(device),
        response_mask.to(device),
        0,
        head_index.to(device),
    )


def fixed_row_length(tokens: int, row_tokens: int) -> int:
    """The length of a fixed-budget row (flex attention) holding `tokens`: the budget, or, for a micro-batch over it (a
    sample longer than ppo.micro_train_max_tokens has one of its own), the next multiple of it (a shape compiled
    once more)."""
    return row_tokens * max(1, -(-tokens // row_tokens))


def policy_mask_rows(
    response_ids: list[list[int]], policy_masks: list[list[int]] | None, pad_id: int, T: int
) -> tuple[Tensor, Tensor]:
    """A packed micro-batch's responses [B, T] (right-padded) and response mask [B, T] (1 where the policy wrote the
    token; episodes' observations 0)."""
    responses = torch.full((len(response_ids), T), pad_id, dtype=torch.long)
    response_mask = torch.zeros((len(response_ids), T), dtype=torch.float32)
    for b, r in enumerate(response_ids):
        responses[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        if policy_masks is not None:
            if len(policy_masks[b]) != len(r):
                raise RolloutMismatchError(
                    f"sample {b} of a micro-batch: {len(policy_masks[b])} policy-mask entries for "
                    f"{len(r)} response tokens; the episode's mask and ids were built apart"
                )
            response_mask[b, : len(r)] = torch.tensor(policy_masks[b], dtype=torch.float32)
        else:
            response_mask[b, : len(r)] = 1.0
    return responses, response_mask


def packed_rows(lengths: list[int]) -> list[list[int]]:
    """Samples of `lengths` (real tokens) in rows for masked attention: as few rows of at most twice the longest sample
    as first-fit decreasing finds, then the samples spread over that many rows by real tokens (`balanced_partition`)
    where that makes the widest row narrower. Every row is padded to the widest, so first-fit's short last row padded
    most: on micro-batches of 8 samples of the realistic workload (prompts 60-200, responses 8-256 tokens) padding
    falls from 16.6 % to 6.0 %, and the rows' attention squares shrink with it."""
    rows = first_fit(lengths, 2 * max(lengths))
    balanced = [row for row in balanced_partition(lengths, list(range(len(lengths))), len(rows)) if row]
    widest = max(sum(lengths[i] for i in row) for row in rows)
    return balanced if max(sum(lengths[i] for i in row) for row in balanced) < widest else rows


def first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` in rows of at most `capacity` tokens: longest first, each into the first row with room
    (first-fit decreasing, within 11/9 of the fewest rows)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True):
        row = next((r for r in range(len(rows)) if room[r] >= lengths[i]), None)
        if row is None:
            rows.append([])
            room.append(capacity)
            row = len(rows) - 1
        rows[row].append(i)
        room[row] -= lengths[i]
    return rows


def balanced_partition(
    weights: list[int], indices: list[int], parts: int, max_count: int | None = None
) -> list[list[int]]:
    """`indices` in `parts` groups of near-equal total weight (`weights[i]`: real tokens): longest first, each to the
    lightest group (with fewer than `max_count` members) so far, the longest-processing-time rule, within 4/3 of the
    best split. Ties keep the order. `parts` x `max_count` must hold them all."""
    parts = max(1, min(parts, len(indices)))
    groups: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for i in sorted(indices, key=lambda i: weights[i], reverse=True):
        open_groups = [g for g in range(parts) if max_count is None or len(groups[g]) < max_count]
        g = min(open_groups, key=lambda g: loads[g])
        groups[g].append(i)
        loads[g] += weights[i]
    return groups


def packed_micro_batch_groups(
    prompt_lengths: list[int],
    response_lengths: list[int],
    indices: list[int],
    *,
    max_samples: int,
    max_tokens: int | None = None,
    min_count: int = 0,
) -> list[list[int]]:
    """Micro-batches for packed forwards (ppo.packing), balanced by real tokens (`balanced_partition`), so every
    forward of the step does about the same work. Fixed size (max_tokens None): as many micro-batches as
    `micro_batch_groups` makes, `max_samples` samples each. Token budget: the fewest micro-batches (at least
    `min_count`) whose real tokens (prompt + response) stay within `max_tokens`; a sample longer than the budget
    gets a micro-batch of its own. The loss denominators are the mini-batch's: the split does not change the update."""
    lengths = [p + r for p, r in zip(prompt_lengths, response_lengths)]
    if max_tokens is None:
        return balanced_partition(lengths, indices, -(-len(indices) // max_samples), max_count=max_samples)
    if min_count > len(indices):
        raise ValueError(f"cannot make {min_count} micro-batches of {len(indices)} samples")
    count = max(min_count, -(-sum(lengths[i] for i in indices) // max_tokens))
    while True:
        groups = balanced_partition(lengths, indices, count)
        if count >= len(indices) or all(len(g) == 1 or sum(lengths[i] for i in g) <= max_tokens for g in groups):
            return groups
        count += 1


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


def ids_difference(packed: list[int], expected: list[int]) -> str | None:
    """Where the ids the trainer lays out (`packed`) first differ from the ids vLLM was given and produced
    (`expected`), in words; None where they are the same."""
    if list(packed) == list(expected):
        return None
    first = next((i for i, (x, y) in enumerate(zip(packed, expected)) if x != y), min(len(packed), len(expected)))
    return (
        f"the ids the trainer packs differ from the ids vLLM was given and produced at position {first} of "
        f"{len(expected)} (packed {list(packed)[first : first + 5]}, vLLM {list(expected)[first : first + 5]}); the "
        "trajectory was rebuilt instead of kept (e.g. decoded and re-encoded)"
    )


def rollout_ids_mismatch(batch: RolloutBatch) -> str | None:
    """The first of `batch`'s episodes whose policy mask is not one entry per response token, or (with
    rollout.episodes.check_token_ids) whose prompt + response ids are not the ids vLLM was given and produced, in
    words; None when every one is as vLLM left it. What the layouts lay out is exactly prompt + response, so this is
    the check of what the trainer packs, made on the data once, before any forward."""
    masks, expected = batch.policy_masks, batch.episode_ids
    for i, (prompt, response) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
        where = f"rollout step {batch.rollout_step + 1}, sample {i} (prompt position {batch.prompt_positions[i]})"
        if masks is not None and len(masks[i]) != len(response):
            return (
                f"{where}: {len(masks[i])} policy-mask entries for {len(response)} response tokens; the episode's "
                "mask and ids were built apart"
            )
        difference = None if expected is None else ids_difference(list(prompt) + list(response), expected[i])
        if difference is not None:
            return f"{where}: {difference}"
    return None


def check_rollout_ids(batch: RolloutBatch) -> None:
    """Every rank's episodes checked (`rollout_ids_mismatch`) and the verdict shared before the step's first forward:
    on a mismatch every rank raises the same RolloutMismatchError, naming the rank and the sample, at this same
    point. A rank that raised alone would save the exception checkpoint (collectives) while the others were in the
    step's forwards and all-reduces: the run would hang until trainer.collective_timeout_s and lose the error. One
    all-gather of a few bytes per rollout step, only for episodes (their masks and ids exist on every rank or on
    none)."""
    if batch.policy_masks is None and batch.episode_ids is None:
        return
    gathered = all_gather_objects(rollout_ids_mismatch(batch))  # one line (or None) per rank
    found = [(rank, line) for rank, line in enumerate(gathered) if line]
    if not found:
        return
    rank, line = found[0]
    on_rank = f"rank {rank}: " if len(gathered) > 1 else ""
    raise RolloutMismatchError(
        f"{on_rank}{line}; the checkpoint of the step's start was saved; fix: keep each episode's ids and policy mask "
        "as vLLM and the environment gave them (a tokenization of the episode's text is not them), or set "
        "rollout.episodes.check_token_ids=false (the trainer then trains on ids vLLM did not sample), then resume=auto"
    )


def rank_micro_batch_groups(
    batch: RolloutBatch, indices: list[int], ppo: PPOConfig, plan: StepPlan, device, shared_prefix_split=None
) -> list[list[int]]:
    """This rank's micro-batches of `indices` (`micro_batch_groups`; packed: `packed_micro_batch_groups`, balanced
    by real tokens): ppo.micro_train_batch_size samples each, or by token budget (ppo.micro_train_max_tokens: padded
    tokens, real tokens when packed). Under data parallelism with a token budget every rank runs as many
    micro-batches as the rank that needs the most (FSDP gathers weights in each forward, a collective).
    `shared_prefix_split` (training/shared_prefix.py's, given where the plan lays prompts out once): keeps each
    prompt group together instead, split by the prompts' ids."""
    max_samples, max_tokens = ppo.micro_train_batch_size, ppo.micro_train_max_tokens
    lengths = [len(p) for p in batch.prompt_ids], [len(r) for r in batch.response_ids]
    split = packed_micro_batch_groups if plan.layout.packing else micro_batch_groups
    if shared_prefix_split is not None:  # prompt groups kept together, so that their prompt is laid out once
        split, lengths = shared_prefix_split, (batch.prompt_ids, lengths[1])
    groups = split(*lengths, indices, max_samples=max_samples, max_tokens=max_tokens)
    if max_tokens is not None and plan.counts.data_parallel_size > 1:
        count = int(global_max(torch.tensor(float(len(groups)), device=device)))
        groups = split(*lengths, indices, max_samples=max_samples, max_tokens=max_tokens, min_count=count)
    return groups


def packed_micro_batches(
    batch: RolloutBatch,
    groups: list[list[int]],
    pad_token_id: int,
    device,
    packing: bool = False,
    one_row: bool = False,
    pack_shared_prefix=None,
    row_tokens: int | None = None,
):
    """(indices, MicroBatch) per group; episodes bring their policy masks (their ids were checked before the step's
    first forward, on every rank together: `check_rollout_ids`; a check here would stop one rank alone).
    `packing`: laid out by `pack_samples` (in one row when `one_row`, padded to `row_tokens` where given; by
    `pack_shared_prefix`, training/shared_prefix.py's, where given: each group's prompt once), else by `pack`."""
    masks = batch.policy_masks
    for idx in groups:
        args = ([batch.prompt_ids[i] for i in idx], [batch.response_ids[i] for i in idx], pad_token_id, device)
        kwargs = dict(policy_masks=None if masks is None else [masks[i] for i in idx])
        if packing and pack_shared_prefix is not None:
            yield idx, pack_shared_prefix(*args, **kwargs, row_tokens=row_tokens)
        elif packing:
            yield idx, pack_samples(*args, **kwargs, one_row=one_row, row_tokens=row_tokens)
        else:
            yield idx, pack(*args, **kwargs)
