"""The micro-batch layout: micro-batches of a fixed size or within a token budget, packed or padded, split over the
ranks, and the tokens one of them is expected to hold given the data's prompt lengths (`PromptStats`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lit_ppo.config import PPOConfig, RunConfig
from lit_ppo.errors import ConfigError
from lit_ppo.plan.counts import Counts
from lit_ppo.plan.table import Row


@dataclass(frozen=True)
class PromptStats:
    """The training prompts' lengths in tokens as the run reads them (after the chat template and
    data.max_prompt_length): what the plan's expected tokens per micro-batch rest on. Measured by the pre-flight
    (`run/prepare.py:preflight`, `mode=plan`) and by a training run from the prompts it loaded; None where the prompts
    or the tokenizer are not on this machine."""

    count: int  # prompts
    mean_tokens: float
    min_tokens: int
    max_tokens: int

    @classmethod
    def of(cls, lengths) -> PromptStats | None:
        """The statistics of `lengths` (tokens per prompt); None for no prompts."""
        lengths = [int(n) for n in lengths]
        if not lengths:
            return None
        return cls(len(lengths), sum(lengths) / len(lengths), min(lengths), max(lengths))


@dataclass(frozen=True)
class LayoutPlan:
    """How a mini-batch is laid out: micro-batches of a fixed size or within a token budget, packed or padded, and
    split over the ranks."""

    micro_train_batch_size: int
    grad_accumulation_steps: int
    micro_train_max_tokens: int | None = None  # token-budget micro-batches (tokens / forward-backward / rank)
    packing: bool = False  # ppo.packing resolved: whole samples end to end, no padding between them
    attn_implementation: str | None = None  # model.attn_implementation (None: transformers' default, sdpa)
    # ppo.shared_prefix resolved: packed, a prompt group's samples in one micro-batch share their prompt's tokens
    # (training/shared_prefix.py); the tokens it saves per micro-batch and rank with the expected tokens' assumptions
    shared_prefix: bool = False
    expected_prefix_tokens_saved_per_micro_batch: float | None = None
    # Packed under data parallelism: after generation the ranks' whole prompt groups are split again by real tokens,
    # as many on every rank (training/rank_samples.py:balanced_rank_batch); else each rank trains what it generated.
    rank_balance: bool = False
    max_micro_batch_tokens: int = 0  # tokens one forward-backward lays out at most (real tokens when packed)
    # Packed with flex attention: each micro-batch one row padded to this many positions (max_micro_batch_tokens), the
    # one shape its compiled kernel sees (training/packing.py:fixed_row); None otherwise.
    row_tokens: int | None = None
    # Expected tokens per training micro-batch (`expected_micro_batch_tokens`) with every response at the limit
    # (counts.max_response_tokens) and prompts of the data's lengths (`prompt_stats`); None without the data's prompts.
    prompt_stats: PromptStats | None = None
    expected_real_tokens_per_micro_batch: float | None = None  # this run's layout (its micro-batch count)
    expected_packed_tokens_per_micro_batch: float | None = None  # positions packed (row ends not counted)
    expected_padded_layout_tokens_per_micro_batch: float | None = None  # positions padded, at most
    # flex attention's fixed rows: positions of a row expected to hold no token (`expected_row_padding`)
    expected_row_padding_tokens_per_micro_batch: float | None = None
    # Context parallelism (counts.context_parallel_size C > 1): rows padded to a multiple of C (the sequence-length
    # divisor), each rank of a group running the model on 1/C of every row's positions: this many at most
    sequence_length_divisor: int = 1
    tokens_per_rank_per_micro_batch: int = 0

    def rows(self, counts: Counts) -> list[Row]:
        if self.micro_train_max_tokens is None:
            micro = [
                ("micro batch", self.micro_train_batch_size, "samples / forward-backward / rank"),
                ("gradient accumulation", self.grad_accumulation_steps, "micro-batches / optimizer step / rank"),
            ]
        else:
            micro = [
                (
                    "micro batch",
                    self.micro_train_max_tokens,
                    "real tokens / forward-backward / rank at most (balanced by real tokens; the count varies)"
                    if self.packing
                    else "padded tokens / forward-backward / rank at most (sorted by length; the count varies)",
                )
            ]
        if self.packing:
            if self.attn_implementation in ("flash_attention_2", "flash_attention_3"):
                attention = f"{self.attn_implementation}: one row per micro-batch, varlen kernels per sample"
            elif self.row_tokens is not None:
                attention = (
                    f"{self.attn_implementation}: one row per micro-batch padded to {self.row_tokens} positions, the "
                    "one shape it compiles for (per forward kind), blocks no sample attends to skipped"
                )
            else:
                attention = (
                    f"{self.attn_implementation or 'sdpa, transformers default'}: rows of up to twice the longest "
                    "sample, block-diagonal mask"
                )
            packing = (
                f"whole samples end to end, position ids from 0 at each; attention within a sample ({attention}); LM "
                "head at response positions only, in the model's own forward; proven against the padded layout on "
                "the first micro-batch"
            ) + (
                "; shared prefix: a prompt group's prompt once, each response attending to it and to itself "
                f"({'block mask' if self.row_tokens is not None else '4-D mask'}), groups kept together in micro-batches"
                + (" and on a rank" if counts.data_parallel_size > 1 else "")
                + " (ppo.shared_prefix)"
                if self.shared_prefix
                else ""
            )
        else:
            packing = "rows padded: prompts left, responses right (ppo.packing)"
        rows = [
            *micro,
            ("packing", "on" if self.packing else "off", packing),
            (
                "micro-batch tokens",
                self.max_micro_batch_tokens,
                "real tokens at most, padded ~0 (row ends only; perf/padding_fraction)"
                if self.packing
                else "padded positions at most (rows x (widest prompt + longest response); perf/padding_fraction)",
            ),
            *self.expected_tokens_rows(counts.max_response_tokens, counts.n_samples_per_prompt),
        ]
        rows += self.context_parallel_rows()
        if counts.data_parallel_size > 1:
            rows.append(
                (
                    "rank split",
                    "by tokens" if self.rank_balance else "generated",
                    "experience: whole prompt groups over the ranks by real tokens after generation, as many on "
                    "each (heaviest - lightest rank <= heaviest - lightest group; perf/rank_token_imbalance); "
                    + (
                        "updates: each global mini-batch's samples, a prompt group's on one rank where one has room "
                        "(its prompt laid out once), by the tokens laid out"
                        if self.shared_prefix
                        else "updates: each global mini-batch's samples, by real tokens"
                    )
                    if self.rank_balance
                    else "experience: the prompt groups each rank generated (contiguous shares; by tokens when "
                    "packed); updates: each global mini-batch's samples, in runs of its shuffled order",
                )
            )
        return rows

    def context_parallel_rows(self) -> list[Row]:
        C = self.sequence_length_divisor
        if C == 1:
            return []
        return [
            (
                "tokens per rank",
                self.tokens_per_rank_per_micro_batch,
                f"/ micro-batch at most: the micro-batch tokens over the {C} context-parallel ranks (activations "
                f"1/{C}; attention over whole rows with 1/{C} of the heads, exchanged all-to-all)",
            ),
            ("sequence-length divisor", C, "rows padded on the right to a multiple of it (context parallelism)"),
        ]

    def expected_tokens_rows(self, max_response_tokens: int, n_samples_per_prompt: int = 1) -> list[Row]:
        """The rows of expected tokens per training micro-batch (`expected_micro_batch_tokens`), or the row saying
        they are unknown without the data's prompts."""
        stats = self.prompt_stats
        if stats is None:
            return [
                (
                    "expected micro-batch tokens",
                    "unknown",
                    "the data's prompt lengths are not on this machine (mode=plan without the tokenizer or the "
                    "prompt files); the bound above holds",
                )
            ]
        real = self.expected_real_tokens_per_micro_batch
        packed, padded = self.expected_packed_tokens_per_micro_batch, self.expected_padded_layout_tokens_per_micro_batch
        assumed = (
            f"/ micro-batch / rank, responses at the limit ({max_response_tokens} tokens) and prompts at the "
            f"data's mean ({stats.mean_tokens:.1f} tokens; {stats.count} prompts of {stats.min_tokens}-"
            f"{stats.max_tokens})"
        )
        if self.packing:
            laid_out = (
                "expected laid-out tokens",
                round(packed),
                "/ micro-batch / rank packed: the real tokens (+ row ends, a few %; none in flash-attention's one "
                f"row); padded they would be {round(padded)} at most (prompts padded to the longest)",
            )
        else:
            laid_out = (
                "expected laid-out tokens",
                round(padded),
                f"/ micro-batch / rank padded, at most (prompts padded to the longest, {stats.max_tokens}); packed "
                f"(ppo.packing) they would be ~{round(packed)}",
            )
        rows = [("expected real tokens", round(real), assumed), laid_out]
        saved = self.expected_prefix_tokens_saved_per_micro_batch
        if self.expected_row_padding_tokens_per_micro_batch is not None:
            rows.append(
                (
                    "expected row padding",
                    round(self.expected_row_padding_tokens_per_micro_batch),
                    f"/ micro-batch / rank: positions of the {self.row_tokens}-position row that hold no token (the "
                    "layers compute them, the attention skips their blocks); ppo.micro_train_max_tokens near the "
                    "real tokens narrows it",
                )
            )
        if self.shared_prefix and saved is not None:
            rows.append(
                (
                    "expected prefix tokens saved",
                    round(saved),
                    f"/ micro-batch / rank: {min(n_samples_per_prompt, self.micro_train_batch_size)} samples of a "
                    f"prompt share its tokens, computed once (~{saved / real:.0%} of the real tokens; "
                    "perf/prefix_tokens_saved)",
                )
            )
        return rows


def layout_plan(config: RunConfig, counts: Counts, prompt_stats: PromptStats | None) -> LayoutPlan:
    """The micro-batches: their size or token budget, packed or padded, and the tokens one of them is expected to
    hold given the data's prompt lengths."""
    ppo, data_parallel_size = config.ppo, counts.data_parallel_size
    packing = ppo.packing is not False  # null: on; the pre-flight resolved it where it knew the model's type
    C = counts.context_parallel_size
    shared_prefix = resolve_shared_prefix(ppo, packing, config.model.attn_implementation)
    max_tokens = ppo.micro_train_max_tokens or ppo.micro_train_batch_size * config.rollout.max_model_len
    expected = (None, None, None)
    if prompt_stats is not None:
        expected = expected_micro_batch_tokens(
            ppo, ppo.train_batch_size // data_parallel_size, counts.max_response_tokens, prompt_stats, packing
        )
    saved = (
        expected[0] * prefix_fraction(ppo, counts.max_response_tokens, prompt_stats)
        if shared_prefix and prompt_stats is not None
        else None
    )
    row_tokens = max_tokens if packing and config.model.attn_implementation == "flex_attention" else None
    return LayoutPlan(
        micro_train_batch_size=ppo.micro_train_batch_size,
        grad_accumulation_steps=ppo.train_batch_size // (ppo.micro_train_batch_size * data_parallel_size),
        micro_train_max_tokens=ppo.micro_train_max_tokens,
        packing=packing,
        attn_implementation=config.model.attn_implementation,
        shared_prefix=shared_prefix,
        expected_prefix_tokens_saved_per_micro_batch=saved,
        rank_balance=packing and data_parallel_size > 1,
        max_micro_batch_tokens=max_tokens,
        row_tokens=row_tokens,
        prompt_stats=prompt_stats,
        expected_real_tokens_per_micro_batch=expected[0],
        expected_packed_tokens_per_micro_batch=expected[1],
        expected_padded_layout_tokens_per_micro_batch=expected[2],
        expected_row_padding_tokens_per_micro_batch=expected_row_padding(row_tokens, expected[1], saved),
        sequence_length_divisor=C,
        tokens_per_rank_per_micro_batch=(
            ppo.micro_train_batch_size * -(-config.rollout.max_model_len // C)  # each row padded to a multiple of C
            if ppo.micro_train_max_tokens is None
            else -(-max_tokens // C)
        ),
    )


def expected_micro_batch_tokens(
    ppo: PPOConfig, samples_per_mini_batch: int, response_tokens: int, prompts: PromptStats, packing: bool
) -> tuple[float, float, float]:
    """(real tokens, packed positions, padded-layout positions) per training micro-batch of a rank, when every
    response is at the limit `response_tokens` (R): the most a rollout step trains, what runs whose responses are cut
    at the limit train. A rank's mini-batch of M = `samples_per_mini_batch` samples holds M x (mean prompt + R) real
    tokens. Packed, the positions are the real tokens (row ends aside). Padded, every sample is counted at the data's
    longest prompt + R, an upper bound (micro-batches sorted by length pad to their own widest prompt).

    Micro-batches per mini-batch: M / micro_train_batch_size; with a token budget (ppo.micro_train_max_tokens K)
    packed the fewest within it, ceil(M x (mean + R) / K) (at most M), padded ceil(M / floor(K / (longest + R))) (a
    sample wider than K alone). The real tokens are this run's layout's (`packing`): its count of micro-batches."""
    M, budget = samples_per_mini_batch, ppo.micro_train_max_tokens
    sample, widest = prompts.mean_tokens + response_tokens, prompts.max_tokens + response_tokens
    if budget is None:
        packed_count = padded_count = M / ppo.micro_train_batch_size
    else:
        packed_count = min(M, max(1, math.ceil(M * sample / budget)))
        padded_count = math.ceil(M / max(1, budget // widest))
    real = M * sample / (packed_count if packing else padded_count)
    return real, M * sample / packed_count, M * widest / padded_count


def prefix_fraction(ppo: PPOConfig, response_tokens: int, prompts: PromptStats) -> float:
    """The share of a micro-batch's real tokens that the shared-prefix layout does not compute, with responses at the
    limit and prompts at the data's mean: a micro-batch holds whole prompt groups (or runs of one group), k =
    min(n_samples_per_prompt, micro_train_batch_size) samples each, whose prompt is laid out once: (k - 1) / k of
    their prompt tokens. With a token budget the groups stay whole (k = n)."""
    k = ppo.n_samples_per_prompt
    if ppo.micro_train_max_tokens is None:
        k = min(k, ppo.micro_train_batch_size)
    return (k - 1) * prompts.mean_tokens / (k * (prompts.mean_tokens + response_tokens))


def expected_row_padding(row_tokens: int | None, packed: float | None, saved: float | None) -> float | None:
    """Flex attention's fixed rows (`row_tokens`): the positions of a row expected to hold no token, the row less the
    expected packed tokens less the prompt tokens the shared prefix lays out once (`saved`); None without fixed rows
    or the data's prompts."""
    if row_tokens is None or packed is None:
        return None
    return max(0.0, row_tokens - (packed - (saved or 0.0)))


def resolve_shared_prefix(ppo: PPOConfig, packing: bool, attn_implementation: str | None) -> bool:
    """ppo.shared_prefix resolved: null is on where the layout is exact and saves tokens (packed, several samples per
    prompt, an attention implementation that takes a ready mask: sdpa, eager, flex_attention's block mask); true where
    it is not is refused in one line. (A
    model with sliding-window layers is refused when it loads: `training/packing.py:shared_prefix_unsupported`.)"""
    reason = None
    if not packing:
        reason = "it lays out packed micro-batches, and ppo.packing is off"
    elif ppo.n_samples_per_prompt < 2:
        reason = "ppo.n_samples_per_prompt=1: no two samples share a prompt"
    elif attn_implementation not in (None, "sdpa", "eager", "flex_attention"):
        reason = f"model.attn_implementation={attn_implementation} takes no ready mask (sdpa, eager, flex_attention do)"
    if reason and ppo.shared_prefix:
        raise ConfigError(f"ppo.shared_prefix=true: {reason}; fix: set ppo.shared_prefix=null or false")
    return reason is None and ppo.shared_prefix is not False
