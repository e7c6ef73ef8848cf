"""`rollout.engine=hf`: the actor itself generates the rollouts, through Hugging Face `generate`.

For machines without vLLM (Apple, some AMD set-ups, a GPU box where vLLM's build does not fit) and for debugging.
It has `VLLMEngine`'s interface and semantics, so the data module, the episodes and the trainer's log-prob check
work unchanged:

- the weights are the actor's own tensors (no copy): `update_weights` has nothing to load and only counts versions;
- each sample draws from its own `torch.Generator`, seeded like vLLM's (prompt seed + sample index, from
  `rollout.sampling_seeds`), one uniform number per token, so a sample does not depend on the other prompts of the
  call, on their order or padding, or on the number of ranks, and the global torch RNG (dropout, shuffles: training
  reproducibility) is never touched;
- temperature, then top-p, with the sampled token's log-prob of that processed distribution (what vLLM reports with
  `logprobs_mode="processed_logprobs"`: top-p renormalized over the kept tokens; greedy: the raw distribution);
- a response ends at the tokenizer's and the generation config's EOS ids and `stop_token_ids` (kept as its last
  token, not in its text), at a `stop` string (the tokens up to the one that completed it are kept, the text is cut
  before it), or at its token limit (`truncated`).

Precision: generation runs in the trainer's compute precision, so the trainer's log-probs of the sampled tokens are
those of the same function: float32 under 32-true; under bf16-mixed inside `torch.autocast(bfloat16)` (also outside
the training step: the start-of-run evaluation); bf16-true has bf16 weights. The two sides then differ only by the
order of summation (KV cache against one forward over the sequence): ~1e-7 nats per token in float32, bf16 noise
under bf16.

In a rollout worker (rollout.mode=disaggregated, `from_model_dir`) the engine holds a model of its own, loaded from
`model_dir` as the trainer loads its actor, and the trainer's pushes are applied to it: full weights copied in by
Hugging Face name (`sync_weights`), or with model.lora the adapter (`sync_adapter`: the model wrapped in peft once,
each pushed adapter loaded into it and recorded as `adapter_version` on every sample).

Ranks: under DDP every rank holds the whole actor and generates its own share with no collective, as vLLM does.
FSDP is refused at config time (`config.validate_rollout_engine`): a sharded actor gathers every layer for every
decoded token, on every rank in lock-step, so ranks whose responses end sooner would have to keep stepping.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from lit_ppo.contract import GenerateRequest, Generation, WeightUpdate
from lit_ppo.errors import WeightSyncError


class _SeededSampler(LogitsProcessor):
    """Samples each row with its own generator and hands `generate` a row that only the sampled token can win
    (`generate` runs greedily around it), recording the sampled token's log-prob under the processed distribution.

    Inverse-CDF sampling: one uniform number per row and token, drawn on the CPU so that the same seed gives the same
    sample on any device; the index is the first whose cumulative probability exceeds it. Tokens of zero probability
    (cut by top-p) cannot be drawn."""

    def __init__(self, generators: list[torch.Generator] | None, temperature: float, top_p: float):
        self.generators = generators  # None: greedy
        self.warpers = []
        if temperature > 0:
            if temperature != 1.0:
                self.warpers.append(TemperatureLogitsWarper(temperature))
            if top_p < 1.0:
                self.warpers.append(TopPLogitsWarper(top_p))
        self.logprobs: list[torch.Tensor] = []  # per step, [rows]: the sampled tokens' log-probs

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        logp = scores.float().log_softmax(-1)
        if self.generators is None:  # greedy: vLLM's argmax of the raw logits, and their log-softmax
            tokens = scores.argmax(-1)
        else:
            probs = logp.exp()
            cdf = probs.cumsum(-1)
            u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in self.generators])
            thresholds = (u.float().to(cdf.device) * cdf[:, -1]).unsqueeze(-1)  # MPS has no float64
            tokens = torch.searchsorted(cdf, thresholds, right=True).squeeze(-1)
            # A threshold rounded up to the total would index past the end or a zero-probability tail token.
            last_positive = (probs > 0).cumsum(-1).argmax(-1)
            tokens = torch.minimum(tokens, last_positive)
        self.logprobs.append(logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1))
        chosen = torch.full_like(scores, float("-inf"))
        return chosen.scatter_(-1, tokens.unsqueeze(-1), 0.0)


class _Stops(StoppingCriteria):
    """Per row: its token limit, the stop token ids and the stop strings, with vLLM's precedence (a stop token or
    string ends a response as `stop` even on its last allowed token). Records where and why each row ended;
    `generate` keeps appending tokens to finished rows until all are done, and those are cut off afterwards."""

    def __init__(self, prompt_width: int, limits: list[int], stop_token_ids: set[int], stop: list[str], tokenizer):
        self.prompt_width = prompt_width
        self.limits = limits
        self.stop_token_ids = torch.tensor(sorted(stop_token_ids), dtype=torch.long)
        self.stop = stop
        self.tokenizer = tokenizer
        self.lengths: list[int | None] = [None] * len(limits)  # response tokens, once ended
        self.reasons: list[str] = [""] * len(limits)  # "stop" or "length"
        self.texts: list[str | None] = [None] * len(limits)  # the text cut before a stop string

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        length = input_ids.shape[1] - self.prompt_width
        last = input_ids[:, -1].cpu()
        stopped = torch.isin(last, self.stop_token_ids).tolist()
        for row, limit in enumerate(self.limits):
            if self.lengths[row] is not None:
                continue
            reason = "stop" if stopped[row] else ""
            if not reason and self.stop:
                text = self.tokenizer.decode(input_ids[row, self.prompt_width :].tolist(), skip_special_tokens=True)
                cuts = [text.find(s) for s in self.stop if s in text]
                if cuts:
                    reason, self.texts[row] = "stop", text[: min(cuts)]
            if not reason and length >= limit:
                reason = "length"
            if reason:
                self.lengths[row], self.reasons[row] = length, reason
        return torch.tensor([n is not None for n in self.lengths], device=input_ids.device)


class HFEngine:
    """The rollout engine of `rollout.engine=hf`: `model` (the trainer's actor, shared) generates."""

    sleep_supported = False

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        precision: str = "32-true",
        seed: int = 0,
        max_batch_sequences: int | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.precision = precision
        self.max_batch_sequences = max_batch_sequences
        self.weights_version = (
            0  # update_weights calls seen: the engine always samples from the actor's current weights
        )
        # Unseeded sampling (seeds=None at a temperature > 0) draws its samples' seeds here, never from the global RNG.
        self.unseeded = torch.Generator().manual_seed(seed)
        # vLLM ends a response at the tokenizer's EOS and at the generation config's EOS ids, besides stop_token_ids.
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_token_ids = {int(i) for i in eos + [tokenizer.eos_token_id] if i is not None}
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_token_ids)

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str,
        *,
        precision: str = "32-true",
        seed: int = 0,
        max_batch_sequences: int | None = None,
        lora: bool = False,
        attn_implementation: str | None = None,
    ) -> "HFEngine":
        """An engine with a model of its own (a rollout worker's), loaded from `model_dir` in the dtype the trainer
        loads its actor in (`training.models.load_models`: float32; bf16 under bf16-true, and a LoRA base's under
        bf16-mixed), on the first GPU if there is one."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        bf16 = precision == "bf16-true" or (lora and precision == "bf16-mixed")
        attention = {"attn_implementation": attn_implementation} if attn_implementation else {}
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16 if bf16 else torch.float32, **attention
        )
        model = model.to("cuda" if torch.cuda.is_available() else "cpu").eval().requires_grad_(False)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        return cls(model, tokenizer, precision=precision, seed=seed, max_batch_sequences=max_batch_sequences)

    # ------------------------------------------------------------ the engine interface

    def generate(self, request: GenerateRequest) -> list[Generation]:
        """`VLLMEngine.generate`: n responses per prompt, grouped (prompt 0's n first); sample j of prompt i is
        seeded `seeds[i] + j`, as vLLM seeds a request's n samples."""
        prompt_token_ids, n, temperature, seeds = (
            request.prompt_token_ids,
            request.n,
            request.temperature,
            request.seeds,
        )
        limits = request.limits
        rows = [(i, j) for i in range(len(prompt_token_ids)) for j in range(n)]
        row_seeds = None
        if temperature > 0:
            if seeds is None:
                seeds = torch.randint(0, 2**62, (len(prompt_token_ids),), generator=self.unseeded).tolist()
            row_seeds = [seeds[i] + j for i, j in rows]
        # Longest prompts first, so a batch pads little; the samples do not depend on the batches (own generators).
        order = sorted(range(len(rows)), key=lambda r: -len(prompt_token_ids[rows[r][0]]))
        size = self.max_batch_sequences or len(rows) or 1
        stops = self.eos_token_ids | {int(i) for i in request.stop_token_ids}
        results: list[Generation | None] = [None] * len(rows)
        for start in range(0, len(order), size):
            batch = order[start : start + size]
            generated = self._generate_batch(
                [prompt_token_ids[rows[r][0]] for r in batch],
                [limits[rows[r][0]] for r in batch],
                None if row_seeds is None else [row_seeds[r] for r in batch],
                temperature,
                request.top_p,
                stops,
                list(request.stop),
            )
            for r, (token_ids, logprobs, reason, text) in zip(batch, generated):
                results[r] = Generation(
                    prompt_index=rows[r][0],
                    token_ids=token_ids,
                    truncated=reason == "length",
                    text=text,
                    logprobs=logprobs,
                    adapter_version=self.adapter_version,
                )
        return results

    # Sharing the actor, the adapter (model.lora) is the actor's own too: samples record adapter version 0, as the
    # base's. An engine of its own (a rollout worker's) records the version of the adapter pushed last.
    adapter_version = 0

    def update_weights(self, update: WeightUpdate) -> int:
        """Nothing to load: the engine generates with the actor's own tensors (with LoRA, its adapter). The update's
        tensors are not read (a sharded actor would gather every one); nothing moves."""
        self.weights_version += 1
        return 0

    @torch.no_grad()
    def sync_weights(self, named_tensors) -> None:
        """An engine of its own (`from_model_dir`): copy the pushed tensors, by Hugging Face name, into its model."""
        own = self.model.state_dict()
        for name, tensor in named_tensors:
            if name not in own:
                raise WeightSyncError(
                    f"HF engine: the pushed weights name {name!r}, which its model ({type(self.model).__name__}) "
                    "lacks; fix: start the rollout workers from the actor's model_dir"
                )
            own[name].copy_(tensor)

    @torch.no_grad()
    def sync_adapter(self, tensors: dict[str, torch.Tensor], peft_config: dict, version: int) -> None:
        """An engine of its own, model.lora: load the adapter (peft's tensor names and adapter config) into its model,
        wrapped in peft at the first one, and record `version` on every later sample; every adapter tensor must be
        loaded."""
        import dataclasses

        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

        if not hasattr(self.model, "peft_config"):
            fields = {f.name for f in dataclasses.fields(LoraConfig) if f.init}
            config = LoraConfig(**{k: v for k, v in peft_config.items() if k in fields})
            self.model = get_peft_model(self.model, config).eval().requires_grad_(False)
        loaded = set_peft_model_state_dict(self.model, tensors)
        if loaded.unexpected_keys:
            raise WeightSyncError(
                f"HF engine: adapter version {version} has {len(loaded.unexpected_keys)} tensors its peft model does "
                f"not take (e.g. {loaded.unexpected_keys[0]}); the rollouts would not sample from the trained policy"
            )
        self.adapter_version = version

    # ------------------------------------------------------------ a rollout worker's end of the weight transfer

    def open_weight_transfer(self, init_info: dict) -> None:
        """Receive every push as it is sent, as vLLM's engine does (`backend.StagedReceiver`)."""
        from lit_ppo.rollout.weight_transfer.backend import GlooInitInfo, StagedReceiver

        self.receiver = StagedReceiver.joining(GlooInitInfo(**init_info))  # one process: the first rank
        self.receiver.start()

    def apply_weight_transfer(self, update_infos: list[dict], version: int) -> None:
        if self.receiver is None:
            raise RuntimeError("HF engine: a weight push applied before open_weight_transfer")
        self.sync_weights(self.receiver.take_all(update_infos))
        self.weight_version = version

    def apply_adapter_transfer(self, update_infos: list[dict], peft_config: dict, version: int) -> None:
        self.sync_adapter(dict(self.receiver.take_all(update_infos)), peft_config, version)

    def close_weight_transfer(self) -> None:
        if self.receiver is not None:
            self.receiver.stop()
            self.receiver = None

    weight_version = 0  # a worker's engine: the policy version it applied last
    receiver = None  # a worker's engine: its end of the weight push, once open
    weight_transfer_name = "lit-ppo's receiver of the lit_ppo_gloo backend (StagedReceiver; no vLLM engine)"

    def set_weight_version(self, version: int) -> None:
        self.weight_version = version

    @torch.no_grad()
    def sequence_logprobs(self, prompt_token_ids: list[int], response_token_ids: list[int]) -> list[float]:
        """The model's log-probability of each response token given the prompt (teacher-forced, raw logits)."""
        ids = list(prompt_token_ids) + list(response_token_ids)
        with self._generating() as device:
            logits = self.model(input_ids=torch.tensor([ids], device=device)).logits[0].float()
        logp = logits[len(prompt_token_ids) - 1 : -1].log_softmax(-1)
        return logp.gather(-1, torch.tensor(response_token_ids, device=logp.device).unsqueeze(-1)).squeeze(-1).tolist()

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        self.model = None

    # ------------------------------------------------------------ one generate call

    @contextlib.contextmanager
    def _generating(self):
        """The model in eval mode (Hugging Face turns the KV cache off under gradient checkpointing in training
        mode), without gradients, in the trainer's compute precision; each module's mode restored afterwards."""
        model = self.model
        modes = [(m, m.training) for m in model.modules()]
        device = next(model.parameters()).device
        autocast = (
            torch.autocast(device.type, dtype=torch.bfloat16)
            if self.precision == "bf16-mixed"
            else contextlib.nullcontext()
        )
        model.eval()
        try:
            with torch.no_grad(), autocast:
                yield device
        finally:
            for module, training in modes:
                module.training = training

    def _generate_batch(self, prompts, limits, seeds, temperature, top_p, stop_token_ids, stop):
        """(token ids, log-probs, "stop" | "length", text) per row of one `generate` call."""
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left-padded: every response starts at column `width`
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
        generators = None if seeds is None else [torch.Generator().manual_seed(s) for s in seeds]
        sampler = _SeededSampler(generators, temperature, top_p)
        stops = _Stops(width, limits, stop_token_ids, stop, self.tokenizer)
        # Only what is set here: the model's own generation config (e.g. Qwen's repetition_penalty, top_k) would
        # otherwise fill the unset fields and change the distribution the trainer compares against.
        config = GenerationConfig(
            max_new_tokens=max(limits),
            do_sample=False,  # the sampler above draws; generate takes the only finite score
            pad_token_id=self.pad_token_id,
            eos_token_id=None,  # the stopping criterion handles every stop
            use_cache=True,
        )
        # A LoRA actor (a peft model) generates through its base model, whose generation config generate reads.
        owner = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        own_config = owner.generation_config
        owner.generation_config = GenerationConfig()
        try:
            with self._generating() as device:
                sequences = self.model.generate(
                    input_ids=input_ids.to(device),
                    attention_mask=attention_mask.to(device),
                    generation_config=config,
                    logits_processor=LogitsProcessorList([sampler]),
                    stopping_criteria=StoppingCriteriaList([stops]),
                )
        finally:
            owner.generation_config = own_config
        responses = sequences[:, width:].cpu().tolist()
        logprobs = torch.stack(sampler.logprobs, dim=1).float().cpu().tolist()
        out = []
        for row in range(len(prompts)):
            length = stops.lengths[row]
            ids = responses[row][:length]
            text = stops.texts[row]
            if text is None:  # vLLM's text leaves out the stop token that ended the response (EOS, stop ids)
                shown = ids[:-1] if stops.reasons[row] == "stop" else ids
                text = self.tokenizer.decode(shown, skip_special_tokens=True)
            out.append((ids, logprobs[row][:length], stops.reasons[row], text))
        return out


# ------------------------------------------------------------ how the registry starts it (lit_ppo/engine_registry.py)


def start_on_actor(datamodule, actor) -> HFEngine:
    """rollout.mode=colocated: the trainer's actor generates (`run.build.build_run` starts it once the module holds
    the actor)."""
    return HFEngine(
        actor,
        datamodule.tokenizer,
        precision=datamodule.plan.models.precision,
        seed=datamodule.seed,
        max_batch_sequences=datamodule.rollout.hf.max_batch_sequences,
    )


def worker_settings(datamodule, plan) -> dict:
    """`HFEngine.from_model_dir`'s keywords in a rollout worker: the model as the trainer loads its actor (precision,
    attention, a LoRA base's dtype), the run's seed and rollout.hf.max_batch_sequences."""
    return dict(
        model_dir=datamodule.model_dir,
        precision=plan.models.precision,
        seed=datamodule.seed,
        max_batch_sequences=datamodule.rollout.hf.max_batch_sequences,
        lora=plan.lora is not None,
        attn_implementation=datamodule.attn_implementation,
    )


def start_in_worker(settings: dict) -> HFEngine:
    """A rollout worker's engine: a copy of the actor loaded from `model_dir`, generating with Hugging Face `generate`
    (seeded per sample as in colocated runs); pushed weights are received by the same receiver as vLLM's
    (`StagedReceiver`) and copied into it, a pushed adapter wraps it in peft once and is loaded into it."""
    return HFEngine.from_model_dir(**settings)
