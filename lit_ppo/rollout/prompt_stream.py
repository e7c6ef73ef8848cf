"""The order in which a run draws its training prompts (`PromptStream`): data epoch e visits a permutation seeded by
(seed, e) in generation rounds of `prompts_per_generation_round` prompts, the last partial round of each data epoch
dropped (the plan reports how many prompts that is). Without dynamic sampling a round is a rollout step's rollout
batch; with it, a rollout step draws rounds until it has enough informative prompt groups, rounds drawn ahead and not
needed are given back to be drawn again first, and the stream's position is part of a checkpoint."""

from __future__ import annotations

import torch

from lit_ppo.plan import StepPlan


def round_purpose(rollout_step: int, round_in_step: int) -> str:
    """What seeds round `round_in_step` of `rollout_step` (`sampling_seeds`); the first round keeps the seeds a run
    without dynamic sampling has."""
    return f"rollout_step={rollout_step}" + (f"/round={round_in_step}" if round_in_step else "")


class PromptStream:
    """The run's generation rounds of `prompts` training prompts: which prompts each round draws, which rounds each
    rollout step uses (dynamic sampling), and the position a checkpoint keeps."""

    def __init__(self, plan: StepPlan, prompts: int, seed: int):
        self.plan, self.prompts, self.seed = plan, prompts, seed
        self.next_generation_round = 0  # the next fresh round (= the next rollout step without dynamic sampling)
        # Dynamic sampling (`generation_round_of`): rounds drawn but not used, drawn again first, and per rollout step
        # not yet trained the (run-wide) rounds drawn for it.
        self.returned_generation_rounds: list[int] = []
        self.step_generation_rounds: dict[int, list[int]] = {}

    def round_prompt_indices(self, generation_round: int, positions: range) -> list[int]:
        """The dataset indices of the prompts at `positions` of generation round `generation_round` (counted over the
        run), in global order."""
        data_epoch, offset = divmod(generation_round, self.plan.counts.generation_rounds_per_data_epoch)
        order = torch.randperm(self.prompts, generator=torch.Generator().manual_seed(self.seed * 100003 + data_epoch))
        size = self.plan.counts.prompts_per_generation_round
        batch = order[offset * size : (offset + 1) * size]
        return batch[positions.start : positions.stop].tolist()

    def generation_round_of(self, rollout_step: int, round_in_step: int) -> int:
        """The run-wide generation round (`round_prompt_indices`) whose prompts round `round_in_step` of `rollout_step`
        generates. Without dynamic sampling: the step. With it, rounds are drawn in the order they are asked for
        (requested ahead for later steps, or generated now): first the rounds drawn before and given back unused (the
        oldest first), then the next fresh one; a round once drawn for a step stays its. So when every round is drawn
        in the step that generates it (colocated, and rollout workers with k = 0), a step's rounds follow the last one
        the step before used, as colocated dynamic sampling draws them; and no round is used twice or skipped."""
        if self.plan.dynamic_sampling is None:
            return rollout_step
        rounds = self.step_generation_rounds.setdefault(rollout_step, [])
        if round_in_step < len(rounds):
            return rounds[round_in_step]
        if round_in_step != len(rounds):
            raise RuntimeError(
                f"rollout step {rollout_step}: round {round_in_step} asked for before round {len(rounds)}"
            )
        if self.returned_generation_rounds:
            rounds.append(self.returned_generation_rounds.pop(0))
        else:
            rounds.append(self.next_generation_round)
            self.next_generation_round += 1
        return rounds[-1]

    def finish_rounds(self, rollout_step: int, used: int) -> list[int]:
        """The run-wide rounds `rollout_step` used (its first `used`); the rest drawn for it (requested ahead, not
        needed) are given back to the stream, to be drawn again first."""
        rounds = self.step_generation_rounds.pop(rollout_step, [])
        self.returned_generation_rounds = sorted(self.returned_generation_rounds + rounds[used:])
        return rounds[:used]

    def state(self) -> dict:
        """The stream's position (a copy)."""
        return {
            "next_generation_round": self.next_generation_round,
            "returned_generation_rounds": list(self.returned_generation_rounds),
            "step_generation_rounds": {step: list(r) for step, r in self.step_generation_rounds.items()},
        }

    def set_state(self, state: dict) -> None:
        self.next_generation_round = state["next_generation_round"]
        self.returned_generation_rounds = list(state.get("returned_generation_rounds", []))
        self.step_generation_rounds = {
            int(step): list(r) for step, r in state.get("step_generation_rounds", {}).items()
        }
