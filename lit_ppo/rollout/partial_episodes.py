"""Tool episodes with partial rollouts (rollout.partial with rollout.episodes.environment, docs/async.md).

An episode's generated (policy) tokens are cut every `step_tokens` per rollout step, as a single-turn response's are;
its observations do not count against the cut and are never cut. Within a step the episodes in flight advance
together, one batched generate per round (`ChunkLoop`): each continues its open turn, or starts its next one, within
what is left of its turn's, its episode's and the step's token budget. A turn that ends (a stop, the turn's or the
episode's budget) is read by the environment at once and its observation appended whole; a turn the step's cut stops
is continued next step from its tokens, by that step's policy, and the environment reads it once it has ended. So a
cut falls inside a turn or between turns (after the observation), never inside an observation. Generate call c of an
episode (its turns' chunks, in order) is seeded `continuation_seed(seed, c)`; call 0 by `seed`, turn 0's seed
without partial rollouts.

The environments of carried episodes stay alive between steps (`PartialEpisodes.environments`). After a resume or a
dropped step an episode's environment is rebuilt by replaying it (`replayed`: reset, then its ended turns in order),
and one that answers otherwise than it did stops the run in one line: carried episodes need environments whose
answers depend only on the record and the turns. A replayed call that fails or times out (each under
rollout.episodes.environment_timeout_s) is the episode's failure, as a live call's (reward.on_error)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from lit_ppo.config.partial import groups_in_flight
from lit_ppo.contract import Generation
from lit_ppo.environments import TokenIds, call_all_with_timeout, check_observation, check_step_result
from lit_ppo.errors import EnvironmentFailure
from lit_ppo.preemption import stop_point
from lit_ppo.rollout.cut_stops import stopped_across_cut
from lit_ppo.rollout.engine import sampling_seeds
from lit_ppo.rollout.episodes import Episode, EpisodeLoop, _Running
from lit_ppo.rollout.partial import CarriedGroup, CarriedSample, check_adapter_advances, continuation_seed
from lit_ppo.rollout.prompt_stream import round_purpose


@dataclass(frozen=True)
class EpisodeState:
    """A carried episode's fields beyond a sample's (plain values: a checkpoint's)."""

    policy_mask: tuple[int, ...]  # per response token: 1 policy, 0 observation
    turns: tuple[tuple[int, int], ...]  # each ended turn's (first token, end) in the response
    open_turn: int | None  # the first token of the turn the cut stopped; None: between turns
    reward: float = 0.0
    tool_calls: int = 0
    observation_tokens: int = 0
    failure: str | None = None
    cut_observation_tokens: int = 0
    info: tuple[tuple[str, float], ...] = ()
    episode_ids: tuple[int, ...] = ()  # the last call's prompt + output (rollout.episodes.check_token_ids)

    @classmethod
    def of(cls, fields: dict) -> "EpisodeState":
        """From a checkpoint's plain values."""
        tuples = {"turns": tuple(tuple(t) for t in fields["turns"]), "info": tuple(tuple(i) for i in fields["info"])}
        sequences = {k: tuple(fields[k]) for k in ("policy_mask", "episode_ids")}
        return cls(**{**fields, **tuples, **sequences})

    def cut(self, sample: CarriedSample) -> CarriedSample:
        """`sample` ended by a cut (at max_age_steps, or to fill a batch), trained as truncated. Cut between turns, it
        ends at its last turn, as an episode out of turns does: the observation after it, which the policy never
        read, is left out whole."""
        ended = replace(sample, finished=True, truncated=True)
        if self.open_turn is not None or not self.turns:
            return ended
        end = self.turns[-1][1]
        spans = tuple(s for s in sample.spans if s[0] < end)
        state = replace(
            self,
            policy_mask=self.policy_mask[:end],
            observation_tokens=self.observation_tokens - (len(sample.token_ids) - end),
        )
        tokens, logprobs = sample.token_ids[:end], sample.logprobs[:end]
        adapters = sample.adapters[: len(spans)]
        return replace(ended, token_ids=tokens, logprobs=logprobs, spans=spans, adapters=adapters, episode=state)

    def generation(self, sample: CarriedSample, prompt_index: int, text: str, adapter: int) -> Episode:
        """The episode as the rewards and the trainer take it (`partial.generation_of`)."""
        opened = self.open_turn is not None and self.open_turn < len(sample.token_ids)
        return Episode(
            prompt_index,
            list(sample.token_ids),
            sample.truncated,
            text,
            list(sample.logprobs),
            adapter,
            policy_mask=list(self.policy_mask),
            episode_ids=list(self.episode_ids),
            reward=self.reward,
            turns=len(self.turns) + opened,
            tool_calls=self.tool_calls,
            observation_tokens=self.observation_tokens,
            failure=self.failure,
            cut_observation_tokens=self.cut_observation_tokens,
            info=dict(self.info),
        )


@dataclass
class _Open:
    """A running episode's partial-rollout fields within a chunk."""

    key: tuple  # (generation round, dataset index, sample j): its environment's in `PartialEpisodes.environments`
    sample: CarriedSample  # as the chunk found it (fresh: empty, with its seed)
    turns: list[tuple[int, int]]
    open_turn: int | None
    left: int = 0  # policy tokens the chunk may still generate
    calls: int = 0


class ChunkLoop(EpisodeLoop):
    """One chunk of the episodes in flight (`run_chunk`): the fresh ones started and reset, then rounds of one batched
    generate for the episodes with tokens left in the chunk, the ended turns stepped and observed as `EpisodeLoop`
    does (its failures, timeouts, budgets and warnings)."""

    def __init__(self, engine, owner: "PartialEpisodes", temperature: float, top_p: float, where: str):
        super().__init__(
            engine,
            owner.make_environment,
            owner.tokenizer,
            owner.settings,
            owner.encoder,
            temperature=temperature,
            top_p=top_p,
            seeds=None,
            where=where,
        )
        self.open: list[_Open] = []

    def add(self, prompt, key: tuple, sample: CarriedSample, environment, failure: tuple | None = None) -> None:
        """A carried episode, continued with `environment` (in its state after the episode's ended turns); `failure`:
        (the call, its exception) where its replay failed or timed out (`PartialEpisodes.replayed`), handled as a
        live call's failure (reward.on_error: the run stops in one line, or the episode ends scored 0)."""
        state = sample.episode
        episode = Episode(0, list(sample.token_ids), False, "", list(sample.logprobs), self.engine.adapter_version)
        episode.policy_mask, episode.episode_ids = list(state.policy_mask), list(state.episode_ids)
        episode.reward, episode.turns, episode.info = state.reward, len(state.turns), dict(state.info)
        episode.tool_calls, episode.observation_tokens = state.tool_calls, state.observation_tokens
        self.running.append(_Running(len(self.running), prompt, environment, episode))
        self.open.append(_Open(key, sample, list(state.turns), state.open_turn, calls=sample.chunks))
        if failure is not None:
            self.positions = list(range(len(self.running)))
            self.failed(self.running[-1], *failure)

    def run_chunk(self, step_tokens: int) -> None:
        """Up to `step_tokens` policy tokens per episode; each ended turn stepped and its observation appended."""
        self.positions = list(range(len(self.running)))
        self.takes_ids = [bool(getattr(r.environment, "takes_token_ids", False)) for r in self.running]
        self.vocab_size = len(self.tokenizer)
        for o in self.open:
            o.left = step_tokens
        while ready := [r for r in self.running if r.active and self.open[r.position].left > 0]:
            ended = self.generate_chunk(ready)
            if ended:
                results = self.step([r for r, _ in ended], [turn for _, turn in ended])
                for (r, turn), result in zip(ended, results):
                    self.observe(r.episode.turns - 1, [r], [turn], [result])
        self.finish()

    def generate_chunk(self, ready: list[_Running]) -> list[tuple[_Running, Generation]]:
        """One generate for `ready`: each continues its open turn or starts its next within its budgets. Returns the
        turns that ended (each whole, over its chunks); a turn the chunk's cut stopped stays open."""
        settings, limits, cut_binds, seeds = self.settings, [], [], []
        for r in ready:
            o, tokens = self.open[r.position], r.episode.token_ids
            if o.open_turn is None:
                o.open_turn = len(tokens)
            room = min(
                settings.max_turn_tokens - (len(tokens) - o.open_turn), settings.max_episode_tokens - len(tokens)
            )
            limits.append(min(room, o.left))
            cut_binds.append(o.left < room)
            seeds.append(o.sample.seed if o.calls == 0 else continuation_seed(o.sample.seed, o.calls))
        contexts, outputs = self.continue_episodes(ready, limits, seeds)
        ended = []
        for r, context, out, binds in zip(ready, contexts, outputs, cut_binds):
            o, ep = self.open[r.position], r.episode
            out = stopped_across_cut(ep.token_ids[o.open_turn :], out, settings.stop, self.tokenizer)  # rollout.stop
            r.append(list(out.token_ids), policy=True, logprobs=list(out.logprobs))
            o.calls, o.left = o.calls + 1, o.left - len(out.token_ids)
            ep.episode_ids = context + list(out.token_ids)  # what the engine was given and gave back
            if out.truncated and binds:  # the step's cut, inside the turn: continued next step
                o.left = 0
                continue
            ep.turns, ep.truncated = ep.turns + 1, out.truncated
            o.turns.append((o.open_turn, len(ep.token_ids)))
            turn = ep.token_ids[o.open_turn :]
            ended.append((r, Generation(r.position, turn, out.truncated, "", ep.logprobs[o.open_turn :])))
            o.open_turn = None
        return ended

    def samples(self, version: int) -> list[CarriedSample]:
        """Each episode as a carried sample after the chunk, its tokens of this chunk spanned as `version`'s."""
        out = []
        for r, o in zip(self.running, self.open):
            ep, before = r.episode, o.sample
            spans, adapters = before.spans, before.adapters
            if len(ep.token_ids) > len(before.token_ids) and (not spans or spans[-1][1] != version):
                spans, adapters = spans + ((len(before.token_ids), version),), adapters + (ep.adapter_version,)
            check_adapter_advances(spans, adapters)
            state = EpisodeState(
                tuple(ep.policy_mask),
                tuple(o.turns),
                o.open_turn,
                ep.reward,
                ep.tool_calls,
                ep.observation_tokens,
                ep.failure,
                ep.cut_observation_tokens,
                tuple(sorted(ep.info.items())),
                tuple(ep.episode_ids),
            )
            ended = not r.active
            tokens, logprobs = tuple(ep.token_ids), tuple(ep.logprobs)
            truncated = ended and ep.truncated
            out.append(
                CarriedSample(before.seed, tokens, logprobs, spans, "", o.calls, ended, truncated, adapters, state)
            )
        return out


class PartialEpisodes:
    """The data module's tool episodes of partial rollouts: the environments of the episodes in flight, and the chunk
    that advances them (`chunk`)."""

    def __init__(self, make_environment, tokenizer, settings, encoder, seed: int, step_tokens: int):
        self.make_environment, self.tokenizer, self.settings, self.encoder = (
            make_environment,
            tokenizer,
            settings,
            encoder,
        )
        self.seed, self.step_tokens = seed, step_tokens
        self.environments: dict[tuple, tuple[object, int]] = {}  # key -> (environment, turns it has read)

    @staticmethod
    def state_of(fields: dict) -> EpisodeState:
        return EpisodeState.of(fields)

    def first_seeds(self, purpose: str, positions: range, n: int) -> list[int]:
        """Each fresh episode's seed (prompt position q, sample j): turn 0's without partial rollouts
        (`episodes.episode_seeds`)."""
        return sampling_seeds(self.seed, f"{purpose}/turn=0", [q * n + j for q in positions for j in range(n)], 1)

    def chunk(self, engine, groups, fresh: list[tuple], seeds: list[int], n: int, version: int, sampling: dict):
        """`groups` (in flight) and the fresh groups (`fresh`: (dataset index, prompt, rollout step, generation round)
        each; `seeds`: their samples' first seeds, n per prompt) advanced by one chunk of policy `version`: the
        groups in that order. `sampling`: temperature, top_p and where."""
        loop = ChunkLoop(engine, self, sampling["temperature"], sampling["top_p"], sampling["where"])
        loop.start([f[1] for f in fresh], n, None)
        loop.reset()
        empty = CarriedSample(0, (), (), (), "", 0, False, False, episode=EpisodeState((), (), None))
        for i, (index, _, _, generation_round) in enumerate(fresh):
            for j in range(n):
                key = (generation_round, index, j)
                loop.open.append(_Open(key, replace(empty, seed=seeds[i * n + j]), [], None))
        slots = [(g, j) for g, group in enumerate(groups) for j, s in enumerate(group.samples) if not s.finished]
        for g, j in slots:
            group, sample = groups[g], groups[g].samples[j]
            key = (group.generation_round, group.dataset_index, j)
            environment, read = self.environments.pop(key, (None, -1))  # held by the chunk until it ends
            failure = None
            if read != len(sample.episode.turns):
                environment, failure = self.replayed(group.prompt, sample, loop.where)
            loop.add(group.prompt, key, sample, environment, failure)
        loop.run_chunk(self.step_tokens)
        advanced = loop.samples(version)
        for r, o, sample in zip(loop.running, loop.open, advanced):
            if not sample.finished:
                self.environments[o.key] = (r.environment, len(o.turns))
        made = iter(advanced[len(fresh) * n :])
        samples = [list(group.samples) for group in groups]
        for g, j in slots:
            samples[g][j] = next(made)
        carried = [replace(group, samples=tuple(s)) for group, s in zip(groups, samples)]
        new = [CarriedGroup(*f, samples=tuple(advanced[i * n : (i + 1) * n])) for i, f in enumerate(fresh)]
        return carried + new

    def replayed(self, prompt, sample: CarriedSample, where: str) -> tuple[object, tuple | None]:
        """A carried episode's environment rebuilt (after a resume or a dropped step): reset, then each ended turn
        stepped in order, every observation checked against the one the episode holds; (the environment, None), or
        (it, (the call, its exception)) where a call failed or ran past rollout.episodes.environment_timeout_s (each
        call under it, `call_all_with_timeout`, as the live calls): the caller handles that as a live failure."""
        environment, tokens, state = self.make_environment(), list(sample.token_ids), sample.episode
        takes_ids, vocab = bool(getattr(environment, "takes_token_ids", False)), len(self.tokenizer)
        record = {"prompt": prompt.text, "reference": prompt.reference, **prompt.extras}
        last = len(tokens) if state.open_turn is None else state.open_turn
        starts = [start for start, _ in state.turns] + [last]
        held = [tokens[: starts[0]]] + [tokens[end:after] for (_, end), after in zip(state.turns, starts[1:])]
        ((ok, first),) = call_all_with_timeout(
            [(lambda: check_observation(environment.reset(record), "reset", vocab), ())], self.settings.timeout_s
        )
        if not ok:
            return environment, ("reset (replayed after a resume or a dropped step)", first)
        answers = [self.first_ids(first) if first else []]
        for t, (start, end) in enumerate(state.turns):
            turn = tokens[start:end]
            action = turn if takes_ids else self.tokenizer.decode(turn, skip_special_tokens=True)
            ((ok, result),) = call_all_with_timeout(
                [(lambda a: check_step_result(environment.step(a), vocab), (action,))], self.settings.timeout_s
            )
            if not ok:
                return environment, (f"step (turn {t + 1} replayed after a resume or a dropped step)", result)
            observation, _, done, _ = result
            answers.append(None if done else (self.encoder(observation, turn) if observation else []))
        if answers != held:
            raise EnvironmentFailure(
                f"{where}: a carried episode's environment ({type(environment).__name__}), rebuilt after a resume or a "
                f"dropped step by replaying its {len(state.turns)} ended turns, answered otherwise than it did "
                f"(prompt {prompt.text[:80]!r}): partial rollouts carry tool episodes across steps only with "
                "environments whose answers depend on the record and the turns alone; fix: make the environment "
                "deterministic, or rollout.partial.step_tokens=null"
            )
        return environment, None

    def first_ids(self, observation) -> list[int]:
        """The reset's observation's ids, as `EpisodeLoop.reset` appends them."""
        if isinstance(observation, TokenIds):
            return self.encoder(observation, [])
        return list(self.tokenizer(observation, add_special_tokens=False).input_ids)

    def keep_only(self, groups) -> None:
        """The environments of `groups`' unfinished samples kept, the others' (cut, dropped) let go."""
        keys = {(g.generation_round, g.dataset_index, j) for g in groups for j, s in enumerate(g.samples)}
        self.environments = {k: v for k, v in self.environments.items() if k in keys}

    def generate(self, partial, dm, rollout_step: int):
        """`PartialRollouts.generate` with episodes (colocated: rollout workers are refused with them): the step's
        chunk for the groups in flight and the fresh rounds topping them up, each fresh episode seeded as turn 0 of
        its round without partial rollouts. (the groups, oldest first, the fresh rounds, generate seconds); None: a
        preemption signal dropped it."""
        counts = dm.plan.counts
        size, n, per_round = counts.rollout_batch_size, counts.n_samples_per_prompt, counts.prompts_per_generation_round
        rounds = (groups_in_flight(partial.settings, size) - len(partial.groups)) // size
        fresh, seeds = [], []
        for r in range(rounds):
            generation_round = dm.stream.next_generation_round + r
            indices = dm.stream.round_prompt_indices(generation_round, range(per_round))
            fresh += [(i, dm.train_prompts.prompts[i], rollout_step, generation_round) for i in indices]
            seeds += self.first_seeds(round_purpose(rollout_step, r), range(per_round), n)
        self.keep_only(partial.groups)
        scheduled = self.scheduled(dm, rollout_step, partial.groups, fresh, seeds)
        if scheduled is None:
            return None
        return scheduled.generations, rounds, scheduled.generate_seconds

    def scheduled(self, dm, rollout_step: int, groups, fresh=(), seeds=()):
        """One chunk of `rollout_step`'s policy for `groups` and `fresh`, through the data module's source (a
        stop point after it); None: a preemption signal dropped it."""
        engine, n = dm.start_engine(), dm.plan.counts.n_samples_per_prompt
        sampling = {"temperature": dm.rollout.temperature, "top_p": dm.rollout.top_p}
        sampling["where"] = f"rollout step {rollout_step + 1}"

        def generate() -> list:
            engine.wake_up()
            return self.chunk(engine, groups, list(fresh), list(seeds), n, rollout_step, sampling)

        scheduled = dm.source.take(rollout_step, engine, generate, None, 0)
        stop_point(dm.device)
        return scheduled
