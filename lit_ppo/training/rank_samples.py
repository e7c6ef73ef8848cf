"""Which of the rollout step's samples each data-parallel rank holds: for the experience pass, under packing with data
parallelism, the ranks' whole prompt groups split again by real tokens (`balanced_rank_batch`, by
`equal_count_partition`); for the updates every rank's samples in one process's order (`global_batch`) and this
rank's share of each global mini-batch (`rank_share`; with the shared prefix a prompt group's samples on one rank,
`group_rank_partition`). The update does not depend on any of these splits, nor on the number of ranks.
"""

from __future__ import annotations

import heapq

from lit_ppo.batch import RolloutBatch
from lit_ppo.distributed import all_gather_objects
from lit_ppo.plan import StepPlan, check_rank_balance


def equal_count_partition(weights: list[int], parts: int) -> list[list[int]]:
    """The indices of `weights` in `parts` parts of as many members each and near-equal total weight, by the largest
    differencing method (Karmarkar-Karp) for equal counts: the weights, longest first, in chunks of `parts` (one
    member per part, the parts' spread the chunk's heaviest minus its lightest); then, while more than one remains,
    the two of the largest spread merge, the heaviest part of one with the lightest of the other.

    Bound: a merge pairs loads a_1 >= ... >= a_m with b_1 <= ... <= b_m, and (a_i + b_i) - (a_j + b_j) is at most
    a_i - a_j for i < j and b_i - b_j for i > j, so the merged spread is at most the larger of the two; the heaviest
    part's load minus the lightest's is therefore at most max(weights) - min(weights), and the heaviest is within
    that of the mean. (The longest-processing-time rule of `balanced_partition` has no such bound once the parts'
    counts are capped.) Then, while one narrows them, a swap between the heaviest and the lightest part: it leaves
    both within their old loads, so the bound holds. Deterministic; each part's indices ascending, the parts in the
    order of their first index."""
    if parts <= 0 or len(weights) % parts:
        raise ValueError(f"cannot split {len(weights)} weights into {parts} parts of as many each")
    order = sorted(range(len(weights)), key=lambda i: weights[i], reverse=True)
    heap = []  # (-spread, tie, parts' (load, members), heaviest first)
    for start in range(0, len(order), parts):
        chunk = [(weights[i], [i]) for i in order[start : start + parts]]
        heapq.heappush(heap, (chunk[-1][0] - chunk[0][0], len(heap), chunk))
    tie = len(heap)
    while len(heap) > 1:
        a, b = heapq.heappop(heap)[2], heapq.heappop(heap)[2]
        merged = [(la + lb, ma + mb) for (la, ma), (lb, mb) in zip(a, reversed(b))]
        merged.sort(key=lambda part: part[0], reverse=True)
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], tie, merged))
        tie += 1
    groups = [members for _, members in heap[0][2]]
    loads = [load for load, _ in heap[0][2]]
    for _ in range(len(weights)):  # then swaps between the heaviest and the lightest part while one narrows them
        heavy, light = loads.index(max(loads)), loads.index(min(loads))
        spread = loads[heavy] - loads[light]
        swaps = [(i, j) for i in groups[heavy] for j in groups[light] if 0 < weights[i] - weights[j] < spread]
        if not swaps:
            break
        i, j = min(swaps, key=lambda s: abs(spread - 2 * (weights[s[0]] - weights[s[1]])))
        groups[heavy][groups[heavy].index(i)], groups[light][groups[light].index(j)] = j, i
        loads[heavy] -= weights[i] - weights[j]
        loads[light] += weights[i] - weights[j]
    return sorted((sorted(members) for members in groups), key=lambda members: members[0])


def balanced_rank_batch(batch: RolloutBatch, plan: StepPlan, rank: int) -> tuple[RolloutBatch, dict[str, float]]:
    """This rank's samples of the rollout step once every rank's are split again by real tokens (`plan.layout.rank_balance`:
    packed, under data parallelism): the ranks' whole prompt groups (samples of a prompt stay together, in prompt
    order, for the group estimators) in `equal_count_partition` by prompt + response tokens, as many groups on every
    rank (so the ranks run as many mini-batches and micro-batches, and the collectives in them match). Each rank
    generated a contiguous share of the rollout batch, whose tokens follow its prompts' and responses' lengths; the
    training forwards and backwards then wait for the heaviest rank at every gradient all-reduce. The updates draw their
    mini-batches from every rank's samples (`global_batch`): the update does not depend on this split.
    Every rank receives every rank's samples (ids and texts, once per rollout step: one all-gather). Returns the
    batch and the ranks' heaviest over mean real tokens, after and as generated (`perf/rank_token_imbalance`,
    `perf/rank_token_imbalance_contiguous`)."""
    n = plan.counts.n_samples_per_prompt
    shares = all_gather_objects(batch)
    groups = [(s, start) for s, share in enumerate(shares) for start in range(0, len(share.response_ids), n)]
    tokens = [
        sum(len(shares[s].prompt_ids[i]) + len(shares[s].response_ids[i]) for i in range(start, start + n))
        for s, start in groups
    ]
    parts = equal_count_partition(tokens, plan.counts.data_parallel_size)
    loads = [sum(tokens[g] for g in part) for part in parts]
    check_rank_balance(plan, batch.rollout_step, [len(part) * n for part in parts], loads, tokens)
    generated = [sum(t for (s, _), t in zip(groups, tokens) if s == r) for r in range(len(shares))]
    picks = [(groups[g][0], groups[g][1] + j) for g in parts[rank] for j in range(n)]
    mean = sum(loads) / len(loads)
    return batch.with_samples(shares, picks), {
        "perf/rank_token_imbalance": max(loads) / mean if mean else 1.0,
        "perf/rank_token_imbalance_contiguous": max(generated) / mean if mean else 1.0,
    }


def global_batch(batch: RolloutBatch, rank: int) -> tuple[RolloutBatch, list[tuple[int, int]], list[int]]:
    """Every rank's samples of the rollout step as one batch in the order one process holds them (by prompt position;
    a prompt's samples together, in their order), what each rank trains its share of every global mini-batch from
    (`rank_share`), so the mini-batches are the same sets of samples whatever the number of ranks. Returns that batch
    (this rank's per-rank fields kept: `RolloutBatch.with_samples`), its samples as (rank, sample index) of the ranks'
    batches (for `experience.global_experience`), and where this rank's own samples are in it. One all-gather of the
    ranks' batches (ids and texts); on one process the batch itself."""
    shares = all_gather_objects(batch)
    if len(shares) == 1:
        return batch, [(0, i) for i in range(len(batch.response_ids))], list(range(len(batch.response_ids)))
    picks = [(r, i) for r, share in enumerate(shares) for i in range(len(share.response_ids))]
    picks.sort(key=lambda pick: shares[pick[0]].prompt_positions[pick[1]])  # stable: a prompt's samples keep order
    where = {pick: j for j, pick in enumerate(picks)}
    return batch.with_samples(shares, picks), picks, [where[(rank, i)] for i in range(len(batch.response_ids))]


def rank_share(batch: RolloutBatch, minibatch: list[int], plan: StepPlan, rank: int) -> list[int]:
    """This rank's samples of the global mini-batch `minibatch` (indices of `global_batch`'s batch): train_batch_size /
    ranks of them, so the ranks run as many micro-batches. Packed (`plan.layout.rank_balance`): split by real tokens
    (`equal_count_partition`), so the ranks' forwards and backwards take about as long; with the shared prefix
    (`plan.layout.shared_prefix`) a prompt group's samples on one rank (`group_rank_partition`), so that its prompt is
    laid out once there and not once per rank; otherwise consecutive runs of the shuffled order. The loss denominators
    are the whole mini-batch's (`loss_denominators`): the update does not depend on the split, nor on the number of
    ranks."""
    world = plan.counts.data_parallel_size
    if world == 1:
        return minibatch
    if plan.layout.shared_prefix:
        prompts = [batch.prompt_ids[i] for i in minibatch]
        responses = [len(batch.response_ids[i]) for i in minibatch]
        return [minibatch[j] for j in group_rank_partition(prompts, responses, world)[rank]]
    if plan.layout.rank_balance:
        tokens = [len(batch.prompt_ids[i]) + len(batch.response_ids[i]) for i in minibatch]
        return [minibatch[j] for j in equal_count_partition(tokens, world)[rank]]
    size = len(minibatch) // world
    return minibatch[rank * size : (rank + 1) * size]


def group_rank_partition(prompt_ids: list[list[int]], response_lengths: list[int], parts: int) -> list[list[int]]:
    """The positions of a mini-batch's samples in `parts` parts of as many samples each that keep prompt groups (the
    same prompt ids) together: groups largest first (then by the tokens the shared-prefix layout computes for them:
    the prompt once and each response), each to the part with room for it whole that computes the fewest tokens so
    far; a group no part has room for fills the parts with the most room, largest pieces first (a piece's prompt is
    then laid out once per part). Deterministic (every rank computes the same split); each part's positions
    ascending."""
    if parts <= 0 or len(prompt_ids) % parts:
        raise ValueError(f"cannot split {len(prompt_ids)} samples into {parts} parts of as many each")
    groups: dict[tuple[int, ...], list[int]] = {}
    for j, prompt in enumerate(prompt_ids):
        groups.setdefault(tuple(prompt), []).append(j)

    def tokens(members: list[int]) -> int:
        return len(prompt_ids[members[0]]) + sum(response_lengths[j] for j in members)

    room = [len(prompt_ids) // parts] * parts
    loads = [0] * parts
    shares: list[list[int]] = [[] for _ in range(parts)]
    for members in sorted(groups.values(), key=lambda m: (len(m), tokens(m)), reverse=True):
        fits = [p for p in range(parts) if room[p] >= len(members)]
        pieces = []
        if fits:
            pieces.append((min(fits, key=lambda p: loads[p]), members))
        else:
            rest = list(members)
            for p in sorted(range(parts), key=lambda p: room[p], reverse=True):
                if rest and room[p]:
                    pieces.append((p, rest[: room[p]]))
                    rest = rest[room[p] :]
        for p, piece in pieces:
            shares[p].extend(piece)
            room[p] -= len(piece)
            loads[p] += tokens(piece)
    return [sorted(share) for share in shares]
