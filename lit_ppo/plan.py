"""The step plan: every count the run will perform, computed once from the config.

Vocabulary (README "Glossary of steps"):
- rollout step: generate responses for one rollout batch of prompts, then train on them.
- optimizer step: one `optimizer.step()` of the actor (the critic takes the same number).
- data epoch: one pass over the prompt dataset.

`compute_plan` is the only place these numbers are derived. The data module, the PPO
loops, the LR schedulers, the logs and the runtime check all read the `StepPlan` it returns.

A `StepPlan` is the counts every run has (`Counts`), the models and engine (`ModelsPlan`), the micro-batch layout
(`LayoutPlan`) and the source of the old log-probs (`OldLogprobsPlan`), plus one section per feature, None when the
feature is off: dynamic sampling, episodes, LoRA, rollout workers. Each section writes its own rows of the table and
has its run-time checks (`check_*`) beside it; plan.json is the same sections (`StepPlan.to_dict`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from lit_ppo.config import PPOConfig, RunConfig, TrainerConfig, positive, vllm_only_settings_set
from lit_ppo.errors import ConfigError, StalenessError, StepAccountingError
from lit_ppo.precision import describe as describe_precision
from lit_ppo.precision import resolve_precision, resolve_rollout_dtype

# OldLogprobsPlan.source: where the PPO ratio's old log-probs come from in this run.
OLD_LOGPROBS_SOURCES = {
    "experience forward": "a no-grad forward of the actor before the updates",
    "training forward": "on-policy: the training forward's own log-probs, detached (ratio 1; no experience forward)",
    "vLLM": "the sampler's log-probs (no experience forward)",
}

Row = tuple[str, Any, str]  # (name, value, unit) of one line of the table


@dataclass(frozen=True)
class PromptStats:
    """The training prompts' lengths in tokens as the run reads them (after the chat template and
    data.max_prompt_length): what the plan's expected tokens per micro-batch rest on. Measured by the pre-flight
    (`run/entry.py:preflight`, `mode=plan`) and by a training run from the prompts it loaded; None where the prompts
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
class LoraTargets:
    """The linear modules that `model.lora.target_modules` adapts in the model and the adapter's size, matched by the
    pre-flight on the model's architecture built from its config.json on the meta device (`preflight.lora_targets`);
    None where config.json is not on this machine (`mode=plan`)."""

    modules: tuple[str, ...]
    """Whole module names, in the model's order: model.layers.0.self_attn.q_proj, ..."""
    adapter_parameters: int
    """One model's (the actor's) adapter: rank x (in + out features) summed over `modules`."""

    @property
    def names(self) -> list[str]:
        """The adapted modules' own names (the last part), each once, in the model's order: q_proj, v_proj."""
        return list(dict.fromkeys(module.rsplit(".", 1)[-1] for module in self.modules))


# ---------------------------------------------------------------- counts: the sizes every loop reads


@dataclass(frozen=True)
class Counts:
    """The derived sizes of every run: prompts, samples, rollout steps, optimizer steps, the LR schedule's length."""

    data_parallel_size: int
    dataset_prompts: int
    rollout_batch_size: int
    n_samples_per_prompt: int
    samples_per_rollout_step: int
    rollout_steps_per_data_epoch: int
    prompts_dropped_per_data_epoch: int
    total_rollout_steps: int
    data_epochs: float
    prompt_passes: float
    ppo_epochs: int
    train_batch_size: int
    mini_batches_per_ppo_epoch: int
    optimizer_steps_per_rollout_step: int
    total_optimizer_steps: int
    samples_per_rank_per_rollout_step: int
    total_samples_generated: int
    max_response_tokens: int  # the response width the trainer plans for (an episode's budget with episodes)
    max_tokens_generated: int
    lr_scheduler_unit: str
    lr_warmup_steps: int
    lr_total_steps: int
    # Generation rounds: a rollout step draws 1 round of prompts, or up to dynamic_sampling.max_generation_rounds;
    # the prompt order advances by rounds, generation_rounds_per_data_epoch of them per data epoch.
    prompts_per_generation_round: int
    generation_rounds_per_data_epoch: int

    def rollout_rows(self, plan: StepPlan) -> list[Row]:
        return [
            ("data-parallel size", self.data_parallel_size, "ranks"),
            ("dataset", self.dataset_prompts, "prompts"),
            ("rollout batch", self.rollout_batch_size, "prompts / rollout step"),
            ("samples per prompt", self.n_samples_per_prompt, "responses"),
            ("samples per rollout step", self.samples_per_rollout_step, "responses"),
            ("rollout steps per data epoch", self.rollout_steps_per_data_epoch, "rollout steps"),
            (
                "prompts dropped per data epoch",
                self.prompts_dropped_per_data_epoch,
                "prompts (last partial rollout batch; reshuffled each data epoch)",
            ),
            ("total rollout steps", self.total_rollout_steps, "rollout steps"),
        ]

    def update_rows(self, plan: StepPlan) -> list[Row]:
        critic = plan.models.critic_enabled
        return [
            ("data epochs", round(self.data_epochs, 3), "rollout steps / rollout steps per data epoch"),
            ("prompt passes", round(self.prompt_passes, 3), "prompts generated for / dataset prompts"),
            ("PPO epochs", self.ppo_epochs, "passes over each rollout batch"),
            ("train batch", self.train_batch_size, "samples / optimizer step"),
            ("mini-batches per PPO epoch", self.mini_batches_per_ppo_epoch, "optimizer steps"),
            (
                "optimizer steps per rollout step",
                self.optimizer_steps_per_rollout_step,
                "actor, and the critic as many" if critic else "actor (no critic)",
            ),
            ("total optimizer steps", self.total_optimizer_steps, "actor" + (" (critic the same)" if critic else "")),
        ]

    def total_rows(self, plan: StepPlan) -> list[Row]:
        return [
            ("samples generated", self.total_samples_generated, "episodes" if plan.episodes else "responses"),
            ("generated tokens (upper bound)", self.max_tokens_generated, "tokens"),
            ("LR warm-up", self.lr_warmup_steps, self.lr_scheduler_unit + "s"),
            ("LR schedule length", self.lr_total_steps, self.lr_scheduler_unit + "s"),
            ("critic", "yes" if plan.models.critic_enabled else "no", ""),
        ]


def check_step_accounting(plan: StepPlan, rollout_step: int, actor_steps: int, critic_steps: int) -> None:
    """The runtime proof of the plan: after each rollout step's updates, the actor and the critic took exactly the
    optimizer steps the plan states (the critic none without one)."""
    counts = plan.counts
    expected = counts.optimizer_steps_per_rollout_step
    expected_critic = expected if plan.models.critic_enabled else 0
    if actor_steps != expected or critic_steps != expected_critic:
        raise StepAccountingError(
            f"rollout step {rollout_step + 1}: the actor took {actor_steps} and the critic {critic_steps} optimizer steps, "
            f"but the plan says {expected} each (ppo_epochs={counts.ppo_epochs} x {counts.mini_batches_per_ppo_epoch} "
            "mini-batches); the update loop is not doing what the configuration says"
        )


def check_sample_use(plan: StepPlan, rollout_step: int, use_counts: list[list[int]]) -> None:
    """The runtime proof of the global mini-batches: summed over the ranks, every sample of the rollout step's global
    batch was trained exactly once in each PPO epoch (`use_counts`: [ppo_epochs][samples]), so the ranks' shares of
    each mini-batch neither overlap nor leave a sample out, and the update is one process's."""
    counts = plan.counts
    samples = counts.samples_per_rollout_step
    wrong = [(e, i, n) for e, epoch in enumerate(use_counts) for i, n in enumerate(epoch) if n != 1]
    if len(use_counts) != counts.ppo_epochs or any(len(epoch) != samples for epoch in use_counts) or wrong:
        found = (
            f"sample {wrong[0][1]} trained {wrong[0][2]} times in PPO epoch {wrong[0][0] + 1}"
            if wrong
            else f"{len(use_counts)} PPO epochs of {[len(epoch) for epoch in use_counts]} samples"
        )
        raise StepAccountingError(
            f"rollout step {rollout_step + 1}: over the {counts.data_parallel_size} rank(s), {found}, but the plan says "
            f"each of {samples} samples once in each of {counts.ppo_epochs} PPO epochs; the ranks' shares of the "
            "mini-batches are not doing what the plan states"
        )


# ---------------------------------------------------------------- the models and the engine


@dataclass(frozen=True)
class ModelsPlan:
    """Which models train and how: critic, reference, precision, and the engine that generates."""

    critic_enabled: bool
    reference_enabled: bool
    precision: str = "32-true"  # resolved (lit_ppo.precision): 32-true, bf16-mixed or bf16-true
    rollout_dtype: str = "float32"  # vLLM's dtype (rollout.engine=hf: the trainer's compute dtype)
    rollout_engine: str = "vllm"  # rollout.engine: vllm, or hf (the actor generates; shares its weights, no sync)

    def rows(self, plan: StepPlan) -> list[Row]:
        where = "in each rollout worker" if plan.workers else "in this process"
        synced = "pushed over gloo" if plan.workers else "synced"
        if self.rollout_engine == "hf" and plan.workers:
            what = "only the adapter" if plan.lora else "the actor's weights"
            engine = (
                "engine",
                "hf",
                f"Hugging Face generate {where}: a copy of the actor loaded from model_dir, {what} {synced} after "
                "each rollout step",
            )
        elif self.rollout_engine == "hf":
            engine = ("engine", "hf", "the actor generates (Hugging Face generate): shares its weights, no sync")
        elif plan.lora:
            engine = (
                "engine",
                "vllm",
                f"vLLM {where}: the base loaded once, only the adapter {synced} after each rollout step "
                f"(a new adapter version; max_lora_rank {plan.lora.vllm_max_lora_rank})",
            )
        else:
            engine = ("engine", "vllm", f"vLLM {where}: the actor's weights {synced} after each rollout step")
        return [
            (
                "reference model",
                "yes" if self.reference_enabled else "no",
                "the actor with its adapter disabled (no copy of the weights)"
                if self.reference_enabled and plan.lora
                else "",
            ),
            ("precision", self.precision, describe_precision(self.precision)),
            engine,
            ("vLLM dtype" if self.rollout_engine == "vllm" else "rollout dtype", self.rollout_dtype, "sampling"),
        ]


# ---------------------------------------------------------------- the micro-batch layout


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
    # as many on every rank (training/batching.py:balanced_rank_batch); else each rank trains what it generated.
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

    def rows(self, plan: StepPlan) -> list[Row]:
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
                + (" and on a rank" if plan.counts.data_parallel_size > 1 else "")
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
            *self.expected_tokens_rows(plan.counts.max_response_tokens, plan.counts.n_samples_per_prompt),
        ]
        if plan.counts.data_parallel_size > 1:
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


def check_micro_batches(plan: StepPlan, rollout_step: int, micro_batches: list[tuple[int, int]]) -> None:
    """The runtime proof of one mini-batch's micro-batches on this rank, given as (samples, tokens) each (tokens: real
    ones when packed, laid-out positions when padded): with a fixed micro-batch size, the gradient accumulation steps
    the plan states, micro_train_batch_size samples each; with a token budget, each within it (a longer sample
    alone)."""
    layout = plan.layout
    budget = layout.micro_train_max_tokens
    if budget is None:
        sizes = [samples for samples, _ in micro_batches]
        if len(sizes) != layout.grad_accumulation_steps or any(n != layout.micro_train_batch_size for n in sizes):
            raise StepAccountingError(
                f"rollout step {rollout_step + 1}: a mini-batch ran as micro-batches of {sizes} samples, but the plan says "
                f"{layout.grad_accumulation_steps} of {layout.micro_train_batch_size} (gradient accumulation); the "
                "micro-batch split is not doing what the configuration says"
            )
        return
    over = [(n, tokens) for n, tokens in micro_batches if tokens > budget and n > 1]
    if over:
        raise StepAccountingError(
            f"rollout step {rollout_step + 1}: a micro-batch of {over[0][0]} samples laid out {over[0][1]} tokens, over "
            f"ppo.micro_train_max_tokens={budget}; the micro-batch split is not doing what the configuration says"
        )


def check_layout_tokens(plan: StepPlan, rollout_step: int, laid_out: int, real_tokens: int, shared: int) -> None:
    """The runtime proof of the shared-prefix layout (`StepPlan.layout.shared_prefix`) on one micro-batch: it laid out the
    samples' real tokens less the prompt tokens their groups share (`shared`, training/shared_prefix.py:
    prefix_tokens_saved), no more and no fewer: each prompt exactly once, every response whole."""
    if laid_out != real_tokens - shared:
        raise StepAccountingError(
            f"rollout step {rollout_step + 1}: a shared-prefix micro-batch laid out {laid_out} tokens, but its samples "
            f"hold {real_tokens} real tokens of which {shared} are prompts shared in their group ({real_tokens - shared} "
            "to lay out); the layout is not what the plan states; fix: set ppo.shared_prefix=false and report this"
        )


def check_rank_balance(
    plan: StepPlan, rollout_step: int, rank_samples: list[int], rank_tokens: list[int], group_tokens: list[int]
) -> None:
    """The runtime proof of the plan's rank split (`LayoutPlan.rank_balance`), given every rank's samples and real
    tokens after the split and the prompt groups' real tokens: every rank trains samples_per_rank_per_rollout_step
    samples (its mini-batches and micro-batches, and so the collectives in them, follow from that count), and the
    heaviest rank is within the partition's bound of the lightest (the heaviest group minus the lightest)."""
    bound = max(group_tokens) - min(group_tokens) if group_tokens else 0
    expected = plan.counts.samples_per_rank_per_rollout_step
    if any(n != expected for n in rank_samples) or max(rank_tokens) - min(rank_tokens) > bound:
        raise StepAccountingError(
            f"rollout step {rollout_step + 1}: the ranks' samples split by real tokens gave {rank_samples} samples and "
            f"{rank_tokens} real tokens, but the plan says {expected} samples each, their tokens within {bound} of each "
            "other; the rank split is not doing what the plan states"
        )


# ---------------------------------------------------------------- the old log-probs


@dataclass(frozen=True)
class OldLogprobsPlan:
    """Where the PPO ratio's old log-probs come from (`old_logprobs_plan`)."""

    source: str = "experience forward"  # a key of OLD_LOGPROBS_SOURCES

    def rows(self, plan: StepPlan) -> list[Row]:
        return [("old log-probs", self.source, OLD_LOGPROBS_SOURCES[self.source])]


# ---------------------------------------------------------------- dynamic sampling (ppo.dynamic_sampling)


@dataclass(frozen=True)
class DynamicSamplingPlan:
    """A rollout step draws rounds of counts.prompts_per_generation_round prompts, up to max_generation_rounds, until
    the rollout batch holds enough groups whose rewards differ; then `on_shortfall`.

    The expected rounds assume each group differs with probability expected_informative_fraction, independently
    (`expected_dynamic_sampling_rounds`). With rollout workers (rollout.mode=disaggregated) each rollout step is
    requested ahead, at the version the schedule gives it, with `rounds_requested_ahead` rounds; rounds beyond those
    (refill) are requested once the step's rewards show too few informative groups, from version s itself
    (`StepPlan.generating_version`), and requested rounds the step did not need give their prompts back to the stream.
    """

    max_generation_rounds: int
    on_shortfall: str = "fill"
    expected_informative_fraction: float = 0.5
    expected_rounds: float | None = None  # generation rounds / rollout step used, expected
    rounds_requested_ahead: int | None = None  # rollout.mode=disaggregated: rounds each step is requested ahead with
    expected_refill_rounds: float | None = None  # ... then requested after the step's rewards, expected
    expected_returned_rounds: float | None = None  # ... requested ahead but not needed (prompts returned), expected

    def rows(self, plan: StepPlan) -> list[Row]:
        counts = plan.counts
        rows = [
            (
                "dynamic sampling: prompts per round",
                counts.prompts_per_generation_round,
                "prompts drawn per generation round (groups with equal rewards are dropped)",
            ),
            (
                "dynamic sampling: rounds",
                self.max_generation_rounds,
                f"generation rounds / rollout step at most (then: {self.on_shortfall})",
            ),
        ]
        if self.expected_rounds is not None:
            rows.append(
                (
                    "dynamic sampling: expected",
                    f"{self.expected_rounds:.2f}",
                    f"generation rounds / rollout step used, if {self.expected_informative_fraction:g} of the groups "
                    "differ (ppo.dynamic_sampling.expected_informative_fraction)",
                )
            )
        if self.rounds_requested_ahead is not None:
            k = plan.max_staleness
            per_round = counts.prompts_per_generation_round * counts.n_samples_per_prompt
            rows += [
                (
                    "dynamic sampling: ahead",
                    self.rounds_requested_ahead,
                    "generation rounds / rollout step requested ahead, by the version the schedule gives the step",
                ),
                (
                    "dynamic sampling: refill",
                    f"{self.expected_refill_rounds:.2f}",
                    f"rounds / rollout step expected after its rewards, generated by version s ({per_round} samples "
                    f"each; the trainer waits for them" + (f", behind the {k} step(s) requested ahead)" if k else ")"),
                ),
                (
                    "dynamic sampling: returned",
                    f"{self.expected_returned_rounds:.2f}",
                    "rounds / rollout step expected to be requested ahead but not needed: generated, their prompts "
                    "given to the next requests",
                ),
            ]
        return rows + [("generation rounds per data epoch", counts.generation_rounds_per_data_epoch, "rounds")]


def expected_dynamic_sampling_rounds(
    groups_per_round: int, groups_needed: int, informative_fraction: float, max_rounds: int, rounds_ahead: int
) -> tuple[float, float, float]:
    """(rounds used, refill rounds beyond `rounds_ahead`, requested rounds not needed), expected per rollout step when
    each group differs with probability `informative_fraction`, independently: R, the rounds until `groups_needed`
    differing groups are drawn (at most `max_rounds`), has P(R > r) = P(Binomial(r x groups_per_round, f) <
    groups_needed), so E[R] = sum_{r < max} P(R > r), E[max(0, R - a)] = sum_{a <= r < max} P(R > r) and
    E[max(0, a - R)] = a - sum_{r < a} P(R > r)."""

    def more_than(rounds: int) -> float:  # P(R > rounds)
        trials, f = rounds * groups_per_round, informative_fraction
        if f >= 1:
            return float(trials < groups_needed)
        total = 0.0
        for k in range(min(groups_needed, trials + 1)):
            log_pmf = (
                math.lgamma(trials + 1)
                - math.lgamma(k + 1)
                - math.lgamma(trials - k + 1)
                + k * math.log(f)
                + (trials - k) * math.log1p(-f)
            )
            total += math.exp(log_pmf)
        return min(1.0, total)

    tail = [more_than(r) for r in range(max_rounds)]
    used = sum(tail)
    return used, sum(tail[rounds_ahead:]), rounds_ahead - sum(tail[:rounds_ahead])


# ---------------------------------------------------------------- episodes (rollout.episodes.environment)


@dataclass(frozen=True)
class EpisodesPlan:
    """Multi-turn episodes: a sample is one episode of at most max_turns policy turns and max_episode_tokens response
    tokens (turns and observations), which is then counts.max_response_tokens."""

    max_turns: int
    max_episode_tokens: int

    def rows(self, plan: StepPlan) -> list[Row]:
        return [
            ("episode: policy turns", self.max_turns, "turns / episode at most (one vLLM call each)"),
            (
                "episode: token budget",
                self.max_episode_tokens,
                "response tokens / episode at most (turns + observations)",
            ),
        ]


# ---------------------------------------------------------------- LoRA (model.lora)


@dataclass(frozen=True)
class LoraPlan:
    """A PEFT adapter on a frozen base: the reference is the actor with its adapter disabled (no copy), and only the
    adapter goes to vLLM (vllm_max_lora_rank: vLLM's slot size for it)."""

    rank: int
    alpha: float
    target_modules: str | list[str]
    vllm_max_lora_rank: int
    # Matched on the model by the pre-flight (LoraTargets): the adapted linear modules' own names, how many modules
    # that is in the whole model, and the actor's adapter parameters; [] / 0 / None where config.json was not read.
    adapted_names: list[str] = field(default_factory=list)
    adapted_modules: int = 0
    adapter_parameters: int | None = None

    def rows(self, plan: StepPlan) -> list[Row]:
        trained = ", adapter and value head" if plan.models.critic_enabled else ", adapter"
        rows = [
            (
                "LoRA",
                f"rank {self.rank}",
                f"alpha {self.alpha:g}, targets {self.target_modules}; base weights frozen"
                + (" in bf16" if plan.models.precision == "bf16-mixed" else "")
                + trained
                + " trained in float32",
            )
        ]
        if self.adapter_parameters is not None:
            rows += [
                (
                    "LoRA adapted modules",
                    self.adapted_modules,
                    f"linear modules {', '.join(self.adapted_names)}, matched on the model's architecture",
                ),
                (
                    "LoRA adapter parameters",
                    f"{self.adapter_parameters / 1e6:.3f} M",
                    f"per model: rank x (in + out features) of each adapted module ({self.adapter_parameters:,})",
                ),
            ]
        return rows


# ---------------------------------------------------------------- rollout workers (rollout.mode=disaggregated)


@dataclass(frozen=True)
class WorkersPlan:
    """Asynchronous rollouts: rollout step s is generated by the policy after max(0, s - max_staleness) rollout steps,
    on `count` worker processes of devices_per_worker devices each. launch: spawn (the trainer starts its workers on
    its own node) or external (the user's launcher starts them on any node, and they connect to `address`, the
    trainer's store, host:port). driver_rank: the trainer rank that drives them (requests every rank's prompts,
    hands each rank its share of every step and pushes each version once; lit_ppo/rollout/workers/ranks.py)."""

    max_staleness: int
    count: int
    devices_per_worker: int
    launch: str
    address: str = ""
    driver_rank: int = 0
    server_urls: tuple[str, ...] = ()

    def launch_rows(self, plan: StepPlan) -> list[Row]:
        """How the workers start: spawned processes, a launcher's, or vLLM servers (spawned, or given by URL)."""
        trainer = f"trainer: {plan.counts.data_parallel_size} device(s)"
        own = (
            f"{self.devices_per_worker} device(s) each"
            if self.devices_per_worker
            else "sharing the trainer's first device"
        )
        if self.launch == "server":
            return [
                ("rollout workers", self.count, f"vLLM servers (vllm serve), driven over HTTP; {trainer}"),
                (
                    "worker launch",
                    "server",
                    f"given: {', '.join(self.server_urls)}"
                    if self.server_urls
                    else f"the trainer spawns them on free ports of its node, {own} "
                    "on GPUs (their URLs and logs: run.log, <run>/logs/rollout_server<N>.log)",
                ),
                (
                    "weight push",
                    "waits",
                    "a server applies a push as it receives it: each push waits until every request sent before it "
                    "(the steps in flight) has finished, then /pause?mode=wait, push, /resume",
                ),
            ]
        spawn = self.launch == "spawn"
        return [
            (
                "rollout workers",
                self.count,
                (
                    f"processes, {own} on GPUs (CPU: own process); "
                    if spawn
                    else "processes, on the devices their launcher gives them; "
                )
                + trainer,
            ),
            (
                "worker launch",
                self.launch,
                "the trainer starts them on its own node"
                if spawn
                else f"the launcher starts them on any node; they connect to {self.address}: "
                f"python -m lit_ppo.rollout.workers --connect {self.address} "
                "(worker number: --worker, SLURM_PROCID or RANK)",
            ),
        ]

    def rows(self, plan: StepPlan) -> list[Row]:
        return [
            ("rollout mode", "disaggregated", "rollout workers generate while the trainer trains"),
            (
                "max staleness",
                self.max_staleness,
                "rollout steps: step s is generated by version max(0, s - k)"
                + ("; dynamic sampling's refill rounds by s" if plan.dynamic_sampling else ""),
            ),
            ("schedule", "", plan.schedule()),
            *self.launch_rows(plan),
        ] + (
            [
                (
                    "workers driven by",
                    f"rank {self.driver_rank}",
                    f"of {plan.counts.data_parallel_size} trainer ranks: it requests every rank's prompts, each rank "
                    "receives every step and trains its share; it pushes each version once (FSDP: gathered tensor by "
                    "tensor)",
                )
            ]
            if plan.counts.data_parallel_size > 1
            else []
        )


def check_policy_versions(
    plan: StepPlan,
    rollout_step: int,
    policy_versions: list[int] | None,
    rounds_in_step: list[int] | None = None,
    rounds_ahead: int | None = None,
) -> None:
    """The runtime proof of the generation schedule: every sample about to be trained in `rollout_step` was generated
    by the policy version the plan states for it (`StepPlan.generating_version` of its step and of its generation
    round, `rounds_in_step`: None, every sample of round 0; `rounds_ahead`: the rounds the step was requested ahead
    with, None: the plan's), never by whatever was newest."""
    if policy_versions is None:  # batches that no engine produced (benchmarks with fixed responses)
        return
    rounds = rounds_in_step if rounds_in_step is not None else [0] * len(policy_versions)
    expected = [plan.generating_version(rollout_step, r, rounds_ahead) for r in rounds]
    wrong = [(v, e) for v, e in zip(policy_versions, expected) if v != e]
    if wrong:
        mode = "disaggregated" if plan.workers else "colocated"
        versions, planned = sorted({v for v, _ in wrong}), sorted({e for _, e in wrong})
        raise StalenessError(
            f"rollout step {rollout_step + 1}: {len(wrong)} of {len(policy_versions)} "
            f"samples were generated by policy version(s) {versions} (lag {[rollout_step - v for v in versions]}), but "
            f"the plan says version {planned[0] if len(planned) == 1 else planned} (rollout.max_staleness="
            f"{plan.max_staleness}, mode={mode}); the rollout schedule is not what the plan states"
        )


# ---------------------------------------------------------------- the plan


# The table's order: (section, its rows method); a section that is None (its feature off) has no rows.
TABLE = (
    ("counts", "rollout_rows"),
    ("dynamic_sampling", "rows"),
    ("counts", "update_rows"),
    ("layout", "rows"),
    ("old_logprobs", "rows"),
    ("episodes", "rows"),
    ("counts", "total_rows"),
    ("lora", "rows"),
    ("models", "rows"),
    ("workers", "rows"),
)


@dataclass(frozen=True)
class StepPlan:
    """What the run will do, in numbers. Every loop and scheduler reads this."""

    counts: Counts
    models: ModelsPlan
    layout: LayoutPlan
    old_logprobs: OldLogprobsPlan
    dynamic_sampling: DynamicSamplingPlan | None = None
    episodes: EpisodesPlan | None = None
    lora: LoraPlan | None = None
    workers: WorkersPlan | None = None
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # settings that run but train off what was sampled

    @property
    def max_staleness(self) -> int:
        """k of the generation schedule: the rollout workers' (rollout.max_staleness), 0 without them."""
        return self.workers.max_staleness if self.workers else 0

    def generating_version(self, rollout_step: int, round_in_step: int = 0, rounds_ahead: int | None = None) -> int:
        """The policy version (the weights after that many rollout steps) that generates `rollout_step`'s samples of
        its generation round `round_in_step` (0: the first): max(0, s - k), except the refill rounds of dynamic
        sampling with rollout workers (those beyond the rounds requested ahead), which are requested once the step's
        rewards are in, from the workers' newest version, s. `rounds_ahead`: the rounds the step was requested ahead
        with, where a checkpoint kept it under other dynamic sampling settings (None: the plan's)."""
        ds = self.dynamic_sampling
        ahead = rounds_ahead if rounds_ahead is not None else (ds.rounds_requested_ahead if ds is not None else None)
        if ds is not None and ahead is not None and round_in_step >= ahead:
            return rollout_step
        return max(0, rollout_step - self.max_staleness)

    def schedule(self) -> str:
        """The generation schedule in words: which policy version generates which rollout step (0-based)."""
        k, last = self.max_staleness, self.counts.total_rollout_steps - 1
        shown = [s for s in range(min(last + 1, k + 3))]
        text = ", ".join(f"step {s} <- v{self.generating_version(s)}" for s in shown)
        return text + (f", ..., step {last} <- v{self.generating_version(last)}" if last not in shown else "")

    def to_dict(self) -> dict[str, Any]:
        """plan.json: {section: {field: value} or None (the feature off), notes, warnings}."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> str:
        """A human-readable table, one line per number, with its unit."""
        rows = []
        for name, part in TABLE:
            section = getattr(self, name)
            if section is not None:
                rows += getattr(section, part)(self)
        width = max(len(r[0]) for r in rows)
        lines = ["Step plan", "-" * (width + 30)]
        lines += [f"{name:<{width}}  {value!s:>10}  {unit}" for name, value, unit in rows]
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


# plan.json before the plan had sections (a flat dict: checkpoints written then still load, `sections_of`): each
# flat key that is not its section field's own name -> (section, field); the others keep their names. A feature's
# section was on where its flag (below) says so.
RENAMED_FLAT_KEYS = {
    "old_logprobs_source": ("old_logprobs", "source"),
    "dynamic_sampling_on_shortfall": ("dynamic_sampling", "on_shortfall"),
    "lora_rank": ("lora", "rank"),
    "lora_alpha": ("lora", "alpha"),
    "lora_target_modules": ("lora", "target_modules"),
    "lora_adapted_names": ("lora", "adapted_names"),
    "lora_adapted_modules": ("lora", "adapted_modules"),
    "lora_adapter_parameters": ("lora", "adapter_parameters"),
    "rollout_workers": ("workers", "count"),
    "rollout_devices_per_worker": ("workers", "devices_per_worker"),
    "rollout_worker_launch": ("workers", "launch"),
    "rollout_worker_address": ("workers", "address"),
}
FLAT_FEATURE_FLAGS = {  # section -> whether a flat plan had it on
    "dynamic_sampling": lambda flat: bool(flat.get("dynamic_sampling")),
    "episodes": lambda flat: bool(flat.get("max_episode_tokens")),
    "lora": lambda flat: bool(flat.get("lora_rank")),
    "workers": lambda flat: flat.get("rollout_mode") == "disaggregated",
}
SECTIONS = {
    "counts": Counts,
    "models": ModelsPlan,
    "layout": LayoutPlan,
    "old_logprobs": OldLogprobsPlan,
    "dynamic_sampling": DynamicSamplingPlan,
    "episodes": EpisodesPlan,
    "lora": LoraPlan,
    "workers": WorkersPlan,
}


def sections_of(record: dict) -> dict[str, Any]:
    """A plan.json (or a checkpoint's plan) by section, as `StepPlan.to_dict` writes it; a flat one written before
    the plan had sections is mapped to them (RENAMED_FLAT_KEYS; a key it lacks is left out of its section)."""
    if "counts" in record:
        return record
    owner = {}  # flat key -> (section, field)
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            owner[f.name] = (section, f.name)
    owner.update(RENAMED_FLAT_KEYS)
    nested: dict[str, Any] = {section: {} for section in SECTIONS}
    for key, value in record.items():
        if key in owner:
            section, name = owner[key]
            nested[section][name] = value
    for section, on in FLAT_FEATURE_FLAGS.items():
        if not on(record):
            nested[section] = None
    return {**nested, "notes": record.get("notes", []), "warnings": record.get("warnings", [])}


def compute_plan(
    config: RunConfig,
    dataset_prompts: int,
    prompt_stats: PromptStats | None = None,
    lora_targets: LoraTargets | None = None,
) -> StepPlan:
    """Derive every count of the run from its typed settings and the number of training prompts, or raise
    ConfigError naming the inconsistent keys. `prompt_stats`, the training prompts' lengths, give the expected tokens
    per micro-batch (`expected_micro_batch_tokens`); without them the plan says they are unknown. `lora_targets`, the
    modules model.lora adapts as the pre-flight matched them on the model, give the adapter's size.

    The precision and vLLM's dtype are resolved here (`lit_ppo.precision`). With an environment a sample is an episode
    of up to `rollout.episodes.max_turns` turns whose response is at most `rollout.episode_tokens()` tokens, which is
    then the response width the trainer plans for. Each section is computed by its own function below."""
    ppo, rollout = config.ppo, config.rollout
    check_batch_sizes(ppo, config.strategy.data_parallel_size, dataset_prompts)
    dynamic_sampling = dynamic_sampling_plan(
        ppo, config.trainer, config.strategy.data_parallel_size, dataset_prompts, rollout.mode == "disaggregated"
    )
    counts = counts_plan(config, dataset_prompts)
    source, old_logprobs_note = old_logprobs_plan(ppo, counts.mini_batches_per_ppo_epoch)
    models = models_plan(config)
    return StepPlan(
        counts=counts,
        models=models,
        layout=layout_plan(config, counts, prompt_stats),
        old_logprobs=OldLogprobsPlan(source),
        dynamic_sampling=dynamic_sampling,
        episodes=EpisodesPlan(rollout.episodes.max_turns, rollout.episode_tokens())
        if rollout.episodes.environment
        else None,
        lora=lora_plan(config, lora_targets),
        workers=workers_plan(config),
        notes=plan_notes(config, counts, dynamic_sampling, old_logprobs_note),
        warnings=plan_warnings(config, models),
    )


def check_batch_sizes(ppo: PPOConfig, data_parallel_size: int, dataset_prompts: int) -> None:
    """The batch sizes divide into each other, over the ranks, within the dataset; else ConfigError naming the keys."""
    if not isinstance(data_parallel_size, int) or data_parallel_size <= 0:
        raise ConfigError(
            f"strategy.devices x strategy.num_nodes = {data_parallel_size} ranks; fix: use at least 1 device and 1 node"
        )
    if dataset_prompts <= 0:
        raise ConfigError(
            f"data: the prompt dataset is empty ({dataset_prompts} prompts); fix: point data at a file with prompts"
        )
    samples_per_rollout_step = ppo.rollout_batch_size * ppo.n_samples_per_prompt
    if samples_per_rollout_step % ppo.train_batch_size:
        raise ConfigError(
            f"ppo.rollout_batch_size={ppo.rollout_batch_size} x ppo.n_samples_per_prompt={ppo.n_samples_per_prompt} "
            f"= {samples_per_rollout_step} samples is not a multiple of ppo.train_batch_size={ppo.train_batch_size}; "
            f"fix: make train_batch_size a divisor of {samples_per_rollout_step}"
        )
    per_update_per_rank = ppo.micro_train_batch_size * data_parallel_size
    if ppo.train_batch_size % per_update_per_rank:
        raise ConfigError(
            f"ppo.train_batch_size={ppo.train_batch_size} is not a multiple of ppo.micro_train_batch_size={ppo.micro_train_batch_size} "
            f"x data-parallel size {data_parallel_size} = {per_update_per_rank}; fix: choose micro_train_batch_size dividing "
            f"{ppo.train_batch_size // data_parallel_size if ppo.train_batch_size % data_parallel_size == 0 else 'train_batch_size / ranks'}"
        )
    if ppo.rollout_batch_size % data_parallel_size:
        raise ConfigError(
            f"ppo.rollout_batch_size={ppo.rollout_batch_size} prompts cannot be split evenly over {data_parallel_size} ranks; "
            f"fix: use a multiple of {data_parallel_size}"
        )
    if ppo.rollout_batch_size > dataset_prompts:
        raise ConfigError(
            f"ppo.rollout_batch_size={ppo.rollout_batch_size} prompts is larger than the dataset ({dataset_prompts} prompts); "
            f"fix: set ppo.rollout_batch_size to at most {dataset_prompts} or use more data"
        )


def prompts_per_generation_round(ppo: PPOConfig) -> int:
    """The prompts one generation round draws: the rollout batch, or ppo.dynamic_sampling.prompts_per_round."""
    ds = ppo.dynamic_sampling
    return (ds.prompts_per_round or ppo.rollout_batch_size) if ds.enabled else ppo.rollout_batch_size


def dynamic_sampling_plan(
    ppo: PPOConfig, run: TrainerConfig, data_parallel_size: int, dataset_prompts: int, disaggregated: bool = False
) -> DynamicSamplingPlan | None:
    """The dynamic sampling section (None when ppo.dynamic_sampling is off), or ConfigError naming the keys; with
    rollout workers (`disaggregated`) the rounds each step is requested ahead with, and the refill they leave."""
    ds = ppo.dynamic_sampling
    if not ds.enabled:
        return None
    per_round = prompts_per_generation_round(ppo)
    if per_round % data_parallel_size or per_round > dataset_prompts:
        raise ConfigError(
            f"ppo.dynamic_sampling.prompts_per_round={per_round} must be a multiple of the {data_parallel_size} ranks and "
            f"at most the dataset's {dataset_prompts} prompts; fix: set ppo.dynamic_sampling.prompts_per_round"
        )
    if run.data_epochs is not None:
        raise ConfigError(
            f"trainer.data_epochs={run.data_epochs} with ppo.dynamic_sampling.enabled=true: the prompts a rollout step "
            "consumes vary, so data epochs do not give a number of rollout steps; fix: set trainer.total_rollout_steps "
            "(and trainer.data_epochs=null)"
        )
    needed, f, most = ppo.rollout_batch_size, ds.expected_informative_fraction, ds.max_generation_rounds
    ahead = min(most, math.ceil(needed / (per_round * f) - 1e-9))
    used, refill, returned = expected_dynamic_sampling_rounds(per_round, needed, f, most, ahead)
    return DynamicSamplingPlan(
        most,
        ds.on_shortfall,
        expected_informative_fraction=f,
        expected_rounds=used,
        **(
            dict(rounds_requested_ahead=ahead, expected_refill_rounds=refill, expected_returned_rounds=returned)
            if disaggregated
            else {}
        ),
    )


def planned_rollout_steps(run: TrainerConfig, rollout_steps_per_data_epoch: int) -> int:
    """trainer.total_rollout_steps, or trainer.data_epochs in rollout steps (exactly one of the two is set)."""
    if (run.total_rollout_steps is None) == (run.data_epochs is None):
        raise ConfigError(
            f"trainer.total_rollout_steps={run.total_rollout_steps} and trainer.data_epochs={run.data_epochs}: "
            "set exactly one of the two; fix: e.g. trainer.total_rollout_steps=100 trainer.data_epochs=null"
        )
    if run.total_rollout_steps is not None:
        positive("trainer", total_rollout_steps=run.total_rollout_steps)
        return run.total_rollout_steps
    if run.data_epochs <= 0:
        raise ConfigError(f"trainer.data_epochs={run.data_epochs} must be positive; fix: e.g. trainer.data_epochs=1")
    return max(1, math.ceil(run.data_epochs * rollout_steps_per_data_epoch - 1e-9))


def counts_plan(config: RunConfig, dataset_prompts: int) -> Counts:
    """The sizes every run has, from the batch sizes (checked by `check_batch_sizes`) and the run's length."""
    ppo, data_parallel_size = config.ppo, config.strategy.data_parallel_size
    per_round = prompts_per_generation_round(ppo)
    rollout_steps_per_data_epoch = dataset_prompts // ppo.rollout_batch_size
    rounds_per_data_epoch = dataset_prompts // per_round
    total_rollout_steps = planned_rollout_steps(config.trainer, rollout_steps_per_data_epoch)
    samples_per_rollout_step = ppo.rollout_batch_size * ppo.n_samples_per_prompt
    mini_batches = samples_per_rollout_step // ppo.train_batch_size
    optimizer_steps_per_rollout_step = mini_batches * ppo.ppo_epochs
    total_optimizer_steps = optimizer_steps_per_rollout_step * total_rollout_steps
    samples = samples_per_rollout_step * total_rollout_steps
    response_width = config.rollout.episode_tokens() or config.rollout.max_response_tokens
    return Counts(
        data_parallel_size=data_parallel_size,
        dataset_prompts=dataset_prompts,
        rollout_batch_size=ppo.rollout_batch_size,
        n_samples_per_prompt=ppo.n_samples_per_prompt,
        samples_per_rollout_step=samples_per_rollout_step,
        rollout_steps_per_data_epoch=rollout_steps_per_data_epoch,
        prompts_dropped_per_data_epoch=dataset_prompts - rounds_per_data_epoch * per_round,
        total_rollout_steps=total_rollout_steps,
        data_epochs=total_rollout_steps / rollout_steps_per_data_epoch,
        prompt_passes=total_rollout_steps * ppo.rollout_batch_size / dataset_prompts,
        ppo_epochs=ppo.ppo_epochs,
        train_batch_size=ppo.train_batch_size,
        mini_batches_per_ppo_epoch=mini_batches,
        optimizer_steps_per_rollout_step=optimizer_steps_per_rollout_step,
        total_optimizer_steps=total_optimizer_steps,
        samples_per_rank_per_rollout_step=samples_per_rollout_step // data_parallel_size,
        total_samples_generated=samples,
        max_response_tokens=response_width,
        max_tokens_generated=samples * response_width,
        lr_scheduler_unit="optimizer_step",
        lr_warmup_steps=math.ceil(ppo.lr_warmup_ratio * total_optimizer_steps),
        lr_total_steps=total_optimizer_steps,
        prompts_per_generation_round=per_round,
        generation_rounds_per_data_epoch=rounds_per_data_epoch,
    )


def models_plan(config: RunConfig) -> ModelsPlan:
    """The models the run trains and holds, the precision and vLLM's dtype resolved (`lit_ppo.precision`)."""
    precision = resolve_precision(config.strategy.precision, config.strategy.accelerator)
    return ModelsPlan(
        critic_enabled=config.ppo.advantage_estimator == "gae",
        reference_enabled=config.ppo.kl_coef > 0,
        precision=precision,
        rollout_dtype=resolve_rollout_dtype(precision, config.rollout.dtype),
        rollout_engine=config.rollout.engine,
    )


def layout_plan(config: RunConfig, counts: Counts, prompt_stats: PromptStats | None) -> LayoutPlan:
    """The micro-batches: their size or token budget, packed or padded, and the tokens one of them is expected to
    hold given the data's prompt lengths."""
    ppo, data_parallel_size = config.ppo, counts.data_parallel_size
    packing = ppo.packing is not False  # null: on; the pre-flight resolved it where it knew the model's type
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
    )


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


def prefix_fraction(ppo: PPOConfig, response_tokens: int, prompts: PromptStats) -> float:
    """The share of a micro-batch's real tokens that the shared-prefix layout does not compute, with responses at the
    limit and prompts at the data's mean: a micro-batch holds whole prompt groups (or runs of one group), k =
    min(n_samples_per_prompt, micro_train_batch_size) samples each, whose prompt is laid out once: (k - 1) / k of
    their prompt tokens. With a token budget the groups stay whole (k = n)."""
    k = ppo.n_samples_per_prompt
    if ppo.micro_train_max_tokens is None:
        k = min(k, ppo.micro_train_batch_size)
    return (k - 1) * prompts.mean_tokens / (k * (prompts.mean_tokens + response_tokens))


def lora_plan(config: RunConfig, targets: LoraTargets | None) -> LoraPlan | None:
    """The LoRA section (None without model.lora), with the pre-flight's matched modules where it read them."""
    lora = config.model.lora
    if not lora.enabled:
        return None
    return LoraPlan(
        rank=lora.rank,
        alpha=lora.alpha,
        target_modules=lora.target_modules,
        vllm_max_lora_rank=lora.vllm_max_lora_rank,
        adapted_names=targets.names if targets else [],
        adapted_modules=len(targets.modules) if targets else 0,
        adapter_parameters=targets.adapter_parameters if targets else None,
    )


def workers_plan(config: RunConfig) -> WorkersPlan | None:
    """The rollout workers' section (None unless rollout.mode=disaggregated)."""
    rollout = config.rollout
    if rollout.mode != "disaggregated":
        return None
    return WorkersPlan(
        max_staleness=rollout.staleness(),
        count=rollout.workers.count,
        devices_per_worker=rollout.workers.devices,
        launch=rollout.workers.launch,
        address=f"{rollout.workers.trainer_address_host()}:{rollout.workers.port}"
        if rollout.workers.launch == "external"
        else "",
        server_urls=tuple(rollout.workers.server_urls) if rollout.workers.launch == "server" else (),
    )


def plan_notes(
    config: RunConfig, counts: Counts, dynamic_sampling: DynamicSamplingPlan | None, old_logprobs_note: str
) -> list[str]:
    """What the plan says in words beside its numbers: dropped prompts, partial data epochs, what dynamic sampling and
    asynchronous rollouts do to the counts, settings a run does not use."""
    ppo, rollout = config.ppo, config.rollout
    per_round, rounds_per_data_epoch = counts.prompts_per_generation_round, counts.generation_rounds_per_data_epoch
    notes = []
    if counts.prompts_dropped_per_data_epoch:
        notes.append(
            f"each data epoch uses {rounds_per_data_epoch * per_round} of {counts.dataset_prompts} prompts; "
            f"the last {counts.prompts_dropped_per_data_epoch} (a partial {'generation round' if dynamic_sampling else 'rollout batch'}) are dropped and the order is reshuffled every data epoch"
        )
    if dynamic_sampling:
        max_rounds, steps = dynamic_sampling.max_generation_rounds, counts.total_rollout_steps
        notes.append(
            f"dynamic sampling: each rollout step draws rounds of {per_round} prompts ({max_rounds} at most) until "
            f"{ppo.rollout_batch_size} prompts with differing rewards are collected; the optimizer steps per rollout step "
            f"stay {counts.optimizer_steps_per_rollout_step}. Data epochs and samples generated are lower bounds (up to "
            f"{max_rounds * per_round * steps / (rounds_per_data_epoch * per_round):.3f} data epochs and "
            f"{max_rounds * per_round * ppo.n_samples_per_prompt * steps} samples)"
        )
    elif abs(counts.data_epochs - round(counts.data_epochs)) > 1e-9:
        notes.append(
            f"the run ends inside data epoch {math.ceil(counts.data_epochs)} ({counts.data_epochs:.3f} data epochs)"
        )
    if old_logprobs_note:
        notes.append(old_logprobs_note)
    k = rollout.staleness()
    if rollout.mode == "disaggregated" and k > 0:
        notes.append(
            f"asynchronous rollouts: samples are up to {k} rollout step(s) old; the PPO ratio's old log-probs are "
            "recomputed with the weights each step starts from and ppo.rollout_correction="
            f"{ppo.rollout_correction.mode} weights the tokens by old / behaviour (vLLM's) probability (docs/async.md)"
        )
    unused = vllm_only_settings_set(rollout) if rollout.engine == "hf" else []
    if unused:  # e.g. an experiment written for vLLM, run with rollout.engine=hf: said, not silently dropped
        notes.append(f"rollout.engine=hf does not use the vLLM setting(s) {', '.join(unused)}")
    return notes


def plan_warnings(config: RunConfig, models: ModelsPlan) -> list[str]:
    """Settings that run but train off what was sampled, or barely train."""
    warnings = []
    if config.rollout.top_p < 1:
        warnings.append(
            f"rollout.top_p={config.rollout.top_p} < 1: vLLM samples from the truncated distribution but the trainer's "
            "log-probs are of the whole one, so updates are off-distribution (rollout/logprob_abs_diff shows by how "
            "much); fix: top_p=1"
        )
    if models.precision == "bf16-true":
        warnings.append(
            "strategy.precision=bf16-true keeps weights and AdamW states in bf16: an update smaller than 2^-8 of a weight "
            "rounds away (lr 1e-6 on |w| = 0.02 changes almost nothing); fix: strategy.precision=bf16-mixed (float32 "
            "master weights)"
        )
    return warnings


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


def old_logprobs_plan(ppo: PPOConfig, mini_batches_per_ppo_epoch: int) -> tuple[str, str]:
    """`ppo.old_logprobs` resolved: the source of the old log-probs (a key of OLD_LOGPROBS_SOURCES) and, when auto
    keeps the experience forward of an on-policy update, a note saying why.

    The update is exactly on-policy when the rollout step takes one optimizer step (one PPO epoch, one mini-batch):
    every training forward then runs on the weights that generated the batch, so its detached log-probs are the old
    ones and the experience forward would compute the same numbers again. Two other readers of the old log-probs need
    them before the update and keep the forward: a KL penalty in the reward (advantages come from it) and the rollout
    correction's weights."""
    if ppo.old_logprobs == "rollout":
        return "vLLM", ""
    if ppo.old_logprobs == "recompute":
        return "experience forward", ""
    on_policy = ppo.ppo_epochs == 1 and mini_batches_per_ppo_epoch == 1
    kl_in_reward = ppo.kl_coef > 0 and ppo.kl_mode == "reward"
    if on_policy and not kl_in_reward and not ppo.rollout_correction.active():
        return "training forward", ""
    if not on_policy:  # the usual case (several updates per rollout step): nothing to say
        return "experience forward", ""
    if kl_in_reward:
        why = "the KL penalty in the reward (ppo.kl_mode=reward) needs them before the update"
    else:
        why = f"ppo.rollout_correction.mode={ppo.rollout_correction.mode} needs them before the update"
    return (
        "experience forward",
        f"old log-probs: the update is on-policy, but the actor's experience forward runs because {why}",
    )


def minibatch_schedule(plan: StepPlan, num_samples: int, generator) -> list[list[list[int]]]:
    """Per PPO epoch, the global mini-batches of train_batch_size indices of the rollout step's `num_samples` samples
    (all ranks', in one process's order), reshuffled every epoch by `generator` (seeded by ppo.shuffle_seed, the same
    on every rank, checkpointed): the same on any number of ranks, each of which trains its share of every
    mini-batch (`training/batching.py:rank_share`)."""
    import torch  # the plan itself needs no torch (mode=plan)

    size = plan.counts.train_batch_size
    schedule = []
    for _ in range(plan.counts.ppo_epochs):
        order = torch.randperm(num_samples, generator=generator).tolist()
        schedule.append([order[start : start + size] for start in range(0, num_samples, size)])
    return schedule
