"""Multi-turn episodes: all episodes of a rollout step advance together, one batched vLLM call per turn.

Token-exact by construction: an episode's response is the concatenation of the policy's turns, as the token
ids vLLM produced them, and of the observations, each tokenized once when it arrives. Nothing is decoded and
re-encoded (the decoded text of a turn is only given to the environment to read). The next turn's prompt is
`prompt ids + response so far`, so vLLM's prefix cache reuses every earlier turn. `policy_mask` marks the
policy's tokens (1) against the observations' (0): the trainer computes log-probs over the whole sequence but
takes loss, KL, entropy and their token counts over the policy's tokens only.

An episode ends when its environment says done, after `max_turns` policy turns, or when its response
(turns and observations) would exceed `max_episode_tokens`; the last two mark it truncated.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Callable

from lit_ppo.contract import GenerateRequest
from lit_ppo.environments import (
    EnvironmentTimeout,
    TokenIds,
    build_environment_factory,
    call_all_with_timeout,
    check_observation,
    check_step_result,
)
from lit_ppo.errors import EnvironmentFailure
from lit_ppo.rollout.engine import Generation, sampling_seeds
from lit_ppo.rollout.observations import ObservationEncoder
from lit_ppo.rollout.prompts import Prompt
from lit_ppo.signals import raised_by_code

log = logging.getLogger("lit_ppo")

# Counted per episode and summed over ranks: rollout/<name> means per episode (see `episode_metrics`).
EPISODE_STATS = (
    "episodes",
    "turns",
    "tool_calls",
    "tool_call_episodes",
    "observation_tokens",
    "episode_tokens",
    "environment_errors",
    "environment_timeouts",
    "observations_cut",
)


@dataclass
class Episode(Generation):
    """One finished episode; `token_ids` is the whole response (turns and observations), `logprobs` vLLM's log-prob
    of each policy token (0.0 on observation tokens), `truncated` true when it ran out of turns or tokens."""

    policy_mask: list[int] = field(default_factory=list)  # per response token: 1 policy, 0 observation
    episode_ids: list[int] = field(default_factory=list)  # the last turn's vLLM prompt + its output, for the check
    reward: float = 0.0  # the environment's rewards, summed over the episode
    turns: int = 0
    tool_calls: int = 0
    observation_tokens: int = 0
    failure: str | None = None  # "error" or "timeout" when the environment failed (reward.on_error=zero)
    cut_observation_tokens: int = 0  # the observation that ended it, not fitting the budget left (0: none did)
    info: dict[str, float] = field(default_factory=dict)  # numeric `info` entries, the last value of each


@dataclass(frozen=True)
class EpisodeSettings:
    max_turns: int
    max_episode_tokens: int
    max_turn_tokens: int  # rollout.max_response_tokens
    timeout_s: float | None  # rollout.episodes.environment_timeout_s
    on_error: str  # reward.on_error: raise | zero
    stop_token_ids: list[int]
    stop: list[str]


@dataclass
class _Running:
    """An episode in progress."""

    position: int  # index into the episodes of this call (seeds, messages)
    prompt: Prompt
    environment: object
    episode: Episode
    active: bool = True
    failure_message: str = ""

    def append(self, ids: list[int], policy: bool, logprobs: list[float] | None = None) -> None:
        ep = self.episode
        ep.token_ids.extend(ids)
        ep.policy_mask.extend([1 if policy else 0] * len(ids))
        ep.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))


class EpisodeLoop:
    """n episodes per prompt advancing together, in named steps: `start` (an environment per episode), `reset` (each
    environment's first observation), then per turn `generate` (one batched call for the active episodes), `step`
    (each environment reads its episode's turn) and `observe` (the observations appended, or the episode ended), and
    `finish` (the warnings on failed and cut episodes, the episodes' texts). `run` runs them in order."""

    def __init__(
        self,
        engine,
        make_environment: Callable[[], object],
        tokenizer,
        settings: EpisodeSettings,
        encoder: ObservationEncoder,
        *,
        temperature: float,
        top_p: float,
        seeds: Callable[[int], list[int]] | None,
        where: str,
    ):
        self.engine, self.make_environment, self.tokenizer = engine, make_environment, tokenizer
        self.settings, self.encoder, self.where = settings, encoder, where
        self.temperature, self.top_p, self.seeds = temperature, top_p, seeds
        self.running: list[_Running] = []
        self.positions: list[int] = []
        self.takes_ids: list[bool] = []

    def run(self, prompts: list[Prompt], n: int, sample_positions: list[int] | None = None) -> list[Episode]:
        """n episodes per prompt, grouped like `VLLMEngine.generate`'s samples (prompt 0's n first). `seeds(turn)`
        gives one vLLM seed per episode for that turn (None: unseeded, e.g. greedy); `where` names the rollout step in
        messages; `sample_positions` are the episodes' global positions (for messages)."""
        self.start(prompts, n, sample_positions)
        self.reset()
        for turn in range(self.settings.max_turns):
            active = [r for r in self.running if r.active]
            if not active:
                break
            outputs = self.generate(turn, active)
            self.observe(turn, active, outputs, self.step(active, outputs))
        return self.finish()

    def start(self, prompts: list[Prompt], n: int, sample_positions: list[int] | None) -> None:
        """An episode and its environment for each of n samples per prompt (prompt 0's n first)."""
        for i, prompt in enumerate(prompts):
            for _ in range(n):
                episode = Episode(
                    prompt_index=i,
                    token_ids=[],
                    truncated=False,
                    text="",
                    logprobs=[],
                    adapter_version=self.engine.adapter_version,  # every turn of the episode uses this one
                )
                try:
                    environment = self.make_environment()
                except KeyboardInterrupt as e:
                    if not raised_by_code(e):
                        raise
                    name = getattr(self.make_environment, "__name__", self.make_environment)
                    raise EnvironmentFailure(
                        f"{self.where}: building the environment ({name}) raised KeyboardInterrupt, which no Ctrl-C "
                        "sent (lit-ppo handles Ctrl-C itself): the run stops here; fix: raise an Exception there, or "
                        "stop the run with a signal"
                    ) from e
                self.running.append(_Running(len(self.running), prompt, environment, episode))
        self.positions = sample_positions or list(range(len(self.running)))
        self.takes_ids = [bool(getattr(r.environment, "takes_token_ids", False)) for r in self.running]
        self.vocab_size = len(self.tokenizer)

    def failed(self, r: _Running, what: str, e: BaseException) -> None:
        """An environment call failed: stop the run (on_error=raise) or end the episode with reward 0."""
        where, position = self.where, self.positions[r.position]
        if raised_by_code(e):  # the environment's code asked to stop: not a failure to score 0
            raise EnvironmentFailure(
                f"{where}: the environment {type(r.environment).__name__}.{what} raised KeyboardInterrupt in episode "
                f"{position} (turn {r.episode.turns}), which no Ctrl-C sent (lit-ppo handles Ctrl-C "
                "itself, stopping at a safe point with a checkpoint): the run stops here whatever reward.on_error "
                "says; fix: raise an Exception for a call that fails (reward.on_error decides then), or stop the run "
                "with a signal"
            ) from e
        if not isinstance(e, Exception):  # a Ctrl-C under Python's default handler, a preemption: not its failure
            raise e
        timed_out = isinstance(e, EnvironmentTimeout)
        if self.settings.on_error == "raise":
            raise EnvironmentFailure(
                f"{where}: the environment {type(r.environment).__name__}.{what} "
                f"{'timed out' if timed_out else 'failed'} in episode {position} (turn {r.episode.turns}, "
                f"prompt {r.prompt.text[:200]!r}): {type(e).__name__}: {e}; fix: correct the environment, or set "
                "reward.on_error=zero to score such episodes 0"
            ) from e
        r.episode.failure = "timeout" if timed_out else "error"
        r.failure_message = f"{type(r.environment).__name__}.{what}: {type(e).__name__}: {e}"
        r.episode.reward = 0.0
        r.active = False
        log.info(
            "environment: episode %d %s and scores 0: %s", position, r.episode.failure, e, extra={"console": False}
        )

    def reset(self) -> None:
        """Every episode's reset, run concurrently under one timeout (call_all_with_timeout), and its first
        observation appended (an episode it fills is cut)."""
        records = [{"prompt": r.prompt.text, "reference": r.prompt.reference, **r.prompt.extras} for r in self.running]
        resets = call_all_with_timeout(
            [
                (lambda rec, env=r.environment: check_observation(env.reset(rec), "reset", self.vocab_size), (record,))
                for r, record in zip(self.running, records)
            ],
            self.settings.timeout_s,
        )
        for r, (ok, first) in zip(self.running, resets):
            if not ok:
                self.failed(r, "reset", first)
                continue
            if first:
                ids = (
                    self.encoder(first, [])
                    if isinstance(first, TokenIds)
                    else list(self.tokenizer(first, add_special_tokens=False).input_ids)
                )
                if len(ids) >= self.settings.max_episode_tokens:
                    r.active, r.episode.truncated = False, True
                    r.episode.cut_observation_tokens = len(ids)
                else:
                    r.append(ids, policy=False)
                    r.episode.observation_tokens += len(ids)

    def continue_episodes(
        self, running: list[_Running], max_tokens: list[int], seeds: list[int] | None
    ) -> tuple[list[list[int]], list[Generation]]:
        """One batched generate that continues each of `running` from `prompt ids + response so far` (its context)
        within `max_tokens`, with the episodes' sampling and stops: (the contexts, the generations)."""
        contexts = [list(r.prompt.prompt_ids) + r.episode.token_ids for r in running]
        outputs = self.engine.generate(
            GenerateRequest(
                contexts,
                n=1,
                temperature=self.temperature,
                top_p=self.top_p,
                max_tokens=max_tokens,
                seeds=seeds,
                stop_token_ids=self.settings.stop_token_ids,
                stop=self.settings.stop,
            )
        )
        return contexts, outputs

    def generate(self, turn: int, active: list[_Running]) -> list[Generation]:
        """Turn `turn` of the active episodes, one batched generate: each continues `prompt ids + response so far`
        within its turn's and its episode's token budget; the policy's tokens appended to each episode."""
        settings = self.settings
        budgets = [
            min(settings.max_turn_tokens, settings.max_episode_tokens - len(r.episode.token_ids)) for r in active
        ]
        turn_seeds = None if self.seeds is None else [self.seeds(turn)[r.position] for r in active]
        contexts, outputs = self.continue_episodes(active, budgets, turn_seeds)
        for r, context, out in zip(active, contexts, outputs):
            ep = r.episode
            r.append(list(out.token_ids), policy=True, logprobs=list(out.logprobs))
            ep.turns += 1
            ep.episode_ids = context + list(out.token_ids)  # what vLLM was given and gave back
            ep.truncated = out.truncated
        return outputs

    def step(self, active: list[_Running], outputs: list[Generation]) -> list[tuple[bool, object]]:
        """Each active episode's environment steps on its turn (the decoded text, or the token ids where it takes
        them), concurrently under one timeout: (ok, its result or exception) per episode."""
        actions = [
            list(out.token_ids)
            if self.takes_ids[r.position]
            else self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            for r, out in zip(active, outputs)
        ]
        return call_all_with_timeout(
            [
                (lambda a, env=r.environment: check_step_result(env.step(a), self.vocab_size), (a,))
                for r, a in zip(active, actions)
            ],
            self.settings.timeout_s,
        )

    def observe(self, turn: int, active: list[_Running], outputs: list[Generation], steps: list) -> None:
        """Each step's reward and info taken, and its observation appended, or the episode ended: done, out of
        turns, or no room for the observation and one more token (cut)."""
        settings = self.settings
        for r, out, (ok, result) in zip(active, outputs, steps):
            ep = r.episode
            if not ok:
                self.failed(r, "step", result)
                continue
            observation, reward, done, info = result
            ep.reward += reward
            if info.get("tool_call"):
                ep.tool_calls += 1
            ep.info.update({k: float(v) for k, v in info.items() if isinstance(v, (int, float)) and k != "tool_call"})
            if done:
                r.active = False
                continue
            ids = self.encoder(observation, list(out.token_ids)) if observation else []
            # Out of turns, or no room for the observation and one more token: the episode is cut here.
            if turn + 1 == settings.max_turns:
                r.active, ep.truncated = False, True
                continue
            if len(ep.token_ids) + len(ids) >= settings.max_episode_tokens:
                r.active, ep.truncated = False, True
                ep.cut_observation_tokens = len(ids)
                continue
            r.append(ids, policy=False)
            ep.observation_tokens += len(ids)

    def finish(self) -> list[Episode]:
        """The episodes, their texts decoded; the episodes that failed (on_error=zero) or were cut at an observation
        said in one warning each."""
        running, where, budget = self.running, self.where, self.settings.max_episode_tokens
        failed_kinds = [r.episode.failure for r in running if r.episode.failure]
        if (
            failed_kinds
        ):  # on_error=zero: counted in rollout/environment_errors and _timeouts, and said, as reward failures are
            log.warning(
                "%s: %d of %d episodes scored 0 after environment errors and %d after timeouts (reward.on_error=zero); "
                "the first: %s",
                where,
                failed_kinds.count("error"),
                len(running),
                failed_kinds.count("timeout"),
                next(r.failure_message for r in running if r.episode.failure),
            )
        cut = [r.episode for r in running if r.episode.cut_observation_tokens]
        if cut:  # every such episode ends truncated, without the tool's answer: said, or a run learns nothing unseen
            longest = max(cut, key=lambda ep: ep.cut_observation_tokens)
            log.warning(
                "%s: %d of %d episodes were cut at an observation that did not fit the episode's budget "
                "(rollout.episodes.max_tokens=%d: prompt excluded, turns and observations; the longest cut observation "
                "had %d tokens, with %d left); fix: raise rollout.episodes.max_tokens or shorten the environment's "
                "observations",
                where,
                len(cut),
                len(running),
                budget,
                longest.cut_observation_tokens,
                budget - len(longest.token_ids),
            )
        episodes = []
        for r in running:
            ep = r.episode
            if not ep.episode_ids:  # no turn was generated (reset failed or filled the budget)
                ep.episode_ids = list(r.prompt.prompt_ids) + ep.token_ids
            ep.text = self.tokenizer.decode(ep.token_ids, skip_special_tokens=True)
            episodes.append(ep)
        return episodes


def episode_seeds(seed: int, purpose: str | None, samples: list[int]) -> Callable[[int], list[int]] | None:
    """Per turn, one seed per episode: turn t of the episode at global sample position q is seeded
    base(purpose, turn t) + q, so episodes do not depend on the number of ranks or rollout workers; `purpose=None`:
    unseeded (greedy evaluation)."""
    if purpose is None:
        return None
    cache: dict[int, list[int]] = {}

    def seeds(turn: int) -> list[int]:
        if turn not in cache:
            cache[turn] = sampling_seeds(seed, f"{purpose}/turn={turn}", samples, 1)
        return cache[turn]

    return seeds


@dataclass(frozen=True)
class EpisodeSpec:
    """A run's multi-turn settings as plain values, which a rollout worker builds its episodes from (its WorkerSpec):
    rollout.episodes.environment (a `_target_` node), the episode settings, the tokenizer's directory, how
    observations are encoded, and the run's seed."""

    environment: dict
    settings: EpisodeSettings
    model_dir: str
    chat_template: bool
    observation_role: str
    seed: int


@dataclass(frozen=True)
class EpisodeRequest:
    """n episodes of each prompt, the request of multi-turn rollouts (`EpisodeRunner.run`; `GenerateRequest`'s
    counterpart, which each turn's generate takes): `positions` are the prompts' global positions in the round,
    `purpose` seeds the turns (`episode_seeds`; None: unseeded, greedy), `where` names the rollout step in
    messages."""

    prompts: list[Prompt]
    positions: list[int]
    n: int
    temperature: float
    top_p: float
    purpose: str | None
    where: str

    @property
    def prompt_count(self) -> int:
        return len(self.prompts)

    def share(self, start: int, stop: int) -> "EpisodeRequest":
        """The request of prompts start..stop - 1 (a rollout worker's contiguous share)."""
        return replace(self, prompts=self.prompts[start:stop], positions=self.positions[start:stop])


class EpisodeRunner:
    """Runs n episodes per prompt of a request (an `EpisodeLoop`) with the run's environment, tokenizer, settings and
    observation encoder, seeded per turn and global sample position (`episode_seeds`): the data module's, and a
    rollout worker's built from the run's `EpisodeSpec` (`from_spec`), so both generate the same episodes."""

    def __init__(self, make_environment, tokenizer, settings: EpisodeSettings, encoder: ObservationEncoder, seed: int):
        self.make_environment, self.tokenizer, self.settings, self.encoder, self.seed = (
            make_environment,
            tokenizer,
            settings,
            encoder,
            seed,
        )

    @classmethod
    def from_spec(cls, spec: EpisodeSpec) -> "EpisodeRunner":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(spec.model_dir)
        encoder = ObservationEncoder(tokenizer, spec.chat_template, spec.observation_role)
        return cls(build_environment_factory(spec.environment), tokenizer, spec.settings, encoder, spec.seed)

    def run(self, engine, request: EpisodeRequest) -> list[Episode]:
        """n episodes of each of the request's prompts."""
        n = request.n
        samples = [position * n + j for position in request.positions for j in range(n)]
        loop = EpisodeLoop(
            engine,
            self.make_environment,
            self.tokenizer,
            self.settings,
            self.encoder,
            temperature=request.temperature,
            top_p=request.top_p,
            seeds=episode_seeds(self.seed, request.purpose, samples),
            where=request.where,
        )
        return loop.run(request.prompts, n, samples)


def episode_stats(episodes: list) -> dict[str, float]:
    """This rank's sums over its episodes (EPISODE_STATS), for `metrics.episode_metrics`."""
    stats = dict.fromkeys(EPISODE_STATS, 0.0)
    for ep in episodes:
        stats["episodes"] += 1
        stats["turns"] += ep.turns
        stats["tool_calls"] += ep.tool_calls
        stats["tool_call_episodes"] += ep.tool_calls > 0
        stats["observation_tokens"] += ep.observation_tokens
        stats["episode_tokens"] += len(ep.token_ids)
        stats["environment_errors"] += ep.failure == "error"
        stats["environment_timeouts"] += ep.failure == "timeout"
        stats["observations_cut"] += ep.cut_observation_tokens > 0
    return stats
