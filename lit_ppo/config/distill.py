"""On-policy distillation's settings: `model.teacher` (the teacher model: where its weights are, its dtype, where it
runs) and `ppo.distill` (the weights of the teacher term and of the reward term in the advantage of
`ppo.advantage_estimator=on_policy_distill`), with their checks: each section's own (`__post_init__`), the run's
(`validate_distill`, called by `RunConfig`, with the sampling the teacher can score, `check_teacher_sampling`;
`check_ppo_for_distill`, by `PPOConfig`), and the teacher's tokenizer against the student's (`tokenizer_mismatch`,
called by the pre-flight before any model loads: lit_ppo/run/teacher_preflight.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lit_ppo.config_fields import above, at_least
from lit_ppo.errors import ConfigError

TEACHER_DTYPES = ("float32", "bfloat16", "float16")
TEACHER_IN_TRAINER = "trainer"  # model.teacher.where: the training process; else a vLLM server's URL
SERVER_SCHEMES = ("http://", "https://")
# The estimators whose advantage can be the reward term: those without a critic (the teacher term has no value).
DISTILL_REWARD_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")


@dataclass(frozen=True)
class TeacherConfig:
    """`model.teacher`: the model whose per-token log-probs of the student's samples make the distillation advantage.
    Frozen and LoRA-free: its weights are a whole Hugging Face model directory, loaded once, never trained, never
    checkpointed (the run reads it from `path` again on resume)."""

    path: str | None = None
    """A local directory (or hub name) of a causal LM with the student's tokenizer (where=trainer); null with a server."""
    dtype: str = "float32"
    """The in-process teacher's weights and forward: float32, bfloat16 or float16 (a server's are its own)."""
    where: str = TEACHER_IN_TRAINER
    """trainer: the teacher's forward runs in each training process, in the reference model's place; or the URL of a
    vLLM server (http://host:port) that serves the teacher: its prompt log-probs of the sampled sequences."""
    temperature: float | None = field(default=None, metadata=above(0))
    """The temperature the teacher scores at (logits / temperature); null: the rollout's sampling temperature."""

    def __post_init__(self) -> None:
        if self.dtype not in TEACHER_DTYPES:
            raise ConfigError(f"model.teacher.dtype={self.dtype!r} is unknown; fix: one of {', '.join(TEACHER_DTYPES)}")
        if self.where != TEACHER_IN_TRAINER and not self.where.startswith(SERVER_SCHEMES):
            raise ConfigError(
                f"model.teacher.where={self.where!r} is neither the trainer nor a server's URL; fix: "
                "model.teacher.where=trainer, or model.teacher.where=http://<host>:<port> (a vLLM server of the teacher)"
            )
        if self.on_server and self.path:
            raise ConfigError(
                f"model.teacher.path={self.path} with model.teacher.where={self.where}: the server's model is the "
                "teacher, the path would name another; fix: model.teacher.path=null (or model.teacher.where=trainer)"
            )

    @property
    def on_server(self) -> bool:
        """The teacher is a vLLM server's (model.teacher.where is its URL)."""
        return self.where != TEACHER_IN_TRAINER

    @property
    def url(self) -> str:
        """The server's URL without a trailing slash."""
        return self.where.rstrip("/")

    def scoring_temperature(self, sampling_temperature: float) -> float:
        """The temperature the teacher's log-probs are taken at: model.teacher.temperature, else the sampling one."""
        return sampling_temperature if self.temperature is None else self.temperature


@dataclass(frozen=True)
class DistillConfig:
    """`ppo.distill`: the advantage of `ppo.advantage_estimator=on_policy_distill`, per token,
    teacher_coef * -(log p_student - log p_teacher) + reward_coef * (the reward_estimator's advantage)."""

    teacher_coef: float = field(default=1.0, metadata=at_least(0))
    """Weight of the teacher term, the negative per-token reverse-KL estimate."""
    reward_coef: float = field(default=0.0, metadata=at_least(0))
    """Weight of the reward's advantage; 0: pure distillation (the reward is still computed and logged)."""
    reward_estimator: str = "grpo"
    """The estimator of the reward term: grpo, dr_grpo, rloo, reinforce_pp or reinforce_pp_baseline."""

    def __post_init__(self) -> None:
        if self.reward_estimator not in DISTILL_REWARD_ESTIMATORS:
            raise ConfigError(
                f"ppo.distill.reward_estimator={self.reward_estimator!r}: the reward term takes an estimator without a "
                f"critic; fix: one of {', '.join(DISTILL_REWARD_ESTIMATORS)}"
            )
        if self.teacher_coef == 0 and self.reward_coef == 0:
            raise ConfigError(
                "ppo.distill.teacher_coef=0 and ppo.distill.reward_coef=0: every advantage would be 0; fix: "
                "ppo.distill.teacher_coef=1"
            )


def check_ppo_for_distill(ppo) -> None:
    """`ppo`'s settings that cannot go with ppo.advantage_estimator=on_policy_distill (a `PPOConfig`)."""
    if ppo.advantage_estimator != "on_policy_distill":
        return
    if ppo.kl_coef > 0 and ppo.kl_mode == "reward":
        raise ConfigError(
            f"ppo.advantage_estimator=on_policy_distill with ppo.kl_mode=reward (ppo.kl_coef={ppo.kl_coef}): the KL to "
            "the reference is kept apart from the teacher term, as a loss term; fix: ppo.kl_mode=loss, or ppo.kl_coef=0"
        )
    if ppo.dynamic_sampling.enabled and ppo.distill.reward_coef == 0:
        raise ConfigError(
            "ppo.dynamic_sampling.enabled=true with ppo.distill.reward_coef=0: it would drop prompt groups of equal "
            "rewards, which pure distillation does not read, and their teacher signal with them; fix: "
            "ppo.dynamic_sampling.enabled=false, or ppo.distill.reward_coef>0"
        )


def validate_distill(
    distill: DistillConfig,
    *,
    estimator: str,
    teacher: TeacherConfig | None,
    n_samples_per_prompt: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
) -> None:
    """The run's distillation settings against each other: the estimator and the teacher go together, a group
    estimator of the reward term needs groups, the sampling (rollout.temperature, rollout.top_p) is one the teacher's
    log-probs can be compared with."""
    distilling = estimator == "on_policy_distill"
    if distilling and teacher is None:  # model.teacher absent: the preset, which declares it, was not used
        raise ConfigError(
            "ppo.advantage_estimator=on_policy_distill needs a teacher; fix: ppo=distill model.teacher.path=<a model "
            "directory> (or +model.teacher.path=<a model directory> without the preset)"
        )
    if distilling and not teacher.path and not teacher.on_server:
        raise ConfigError(
            "ppo.advantage_estimator=on_policy_distill needs a teacher; fix: model.teacher.path=<a model directory>, "
            "or model.teacher.where=http://<host>:<port> (a vLLM server of the teacher)"
        )
    if distilling:
        check_teacher_sampling(teacher, temperature, top_p)
    if not distilling and teacher is not None and (teacher.path or teacher.on_server):
        raise ConfigError(
            f"model.teacher.path={teacher.path} is set but ppo.advantage_estimator={estimator} never reads a teacher; "
            "fix: ppo=distill (ppo.advantage_estimator=on_policy_distill), or remove model.teacher"
        )
    if (
        distilling
        and distill.reward_coef > 0
        and n_samples_per_prompt < 2
        and distill.reward_estimator != "reinforce_pp"
    ):
        raise ConfigError(
            f"ppo.distill.reward_estimator={distill.reward_estimator} compares samples of one prompt but "
            f"ppo.n_samples_per_prompt={n_samples_per_prompt}; fix: ppo.n_samples_per_prompt=2 or more, or "
            "ppo.distill.reward_coef=0"
        )


SERVER_TRIES = 3  # a server teacher's request that fails without an answer, or with HTTP 5xx, is sent again
SERVER_RETRY_WAIT_S = 2.0  # before the second try, twice that before the third
SERVER_REQUEST_TIMEOUT_S = 500.0  # one request (a large teacher's prefill of 16 long sequences)


def server_teacher_wait_s() -> float:
    """The longest a server teacher's request waits before the run stops in one line: every try and the waits."""
    return SERVER_TRIES * SERVER_REQUEST_TIMEOUT_S + SERVER_RETRY_WAIT_S * (2 ** (SERVER_TRIES - 1) - 1)


def check_teacher_waits_fit_collectives(
    teacher: TeacherConfig | None, trainer_ranks: int, collective_timeout_s: float
) -> None:
    """Several trainer ranks with a server teacher: while one rank waits for the server (its tries), the others wait
    for it in a collective (a context-parallel group's other ranks in the broadcast of its rank 0's answer); that wait
    must outlast the tries, so that every rank stops with the teacher's line."""
    waits = server_teacher_wait_s()
    if teacher is not None and teacher.on_server and trainer_ranks > 1 and collective_timeout_s <= waits:
        raise ConfigError(
            f"trainer.collective_timeout_s={collective_timeout_s:g} with {trainer_ranks} trainer ranks and "
            f"model.teacher.where={teacher.where}: a rank waits up to {waits:g} s for the teacher's server (its tries), "
            f"and the others would stop on a collective's timeout without naming it; fix: "
            f"trainer.collective_timeout_s above {waits:g}"
        )


def check_teacher_sampling(teacher: TeacherConfig, temperature: float, top_p: float) -> None:
    """The teacher's log-probs are of the whole distribution at its scoring temperature: the student's samples must be
    drawn from the whole distribution (no nucleus), and a server's prompt log-probs are untempered (temperature 1)."""
    if top_p < 1:
        raise ConfigError(
            f"rollout.top_p={top_p} with ppo.advantage_estimator=on_policy_distill: the samples come from the nucleus "
            "while the teacher scores the whole distribution, so the teacher term is biased and its optimum is not the "
            "teacher; fix: rollout.top_p=1.0"
        )
    scoring = teacher.scoring_temperature(temperature)
    if teacher.on_server and scoring != 1:
        source = "model.teacher.temperature" if teacher.temperature is not None else "rollout.temperature"
        raise ConfigError(
            f"model.teacher.where={teacher.where} scores the teacher at temperature {scoring:g} ({source}), but a vLLM "
            "server's prompt log-probs are untempered; fix: rollout.temperature=1.0 (the student sampled at the "
            "teacher's temperature), or model.teacher.temperature=1.0 (the teacher at 1, the student at "
            f"{temperature:g})"
        )


def tokenizer_mismatch(student, teacher) -> str | None:
    """How the teacher's tokenizer differs from the student's, in a few words, or None when they read token ids alike:
    the vocabulary (token -> id), the special tokens among the added ones (id -> token) and the bos and eos tokens.
    Not the pad token (padding is masked out of every forward) nor the unk token (a byte-level vocabulary has none to
    give, and a tokenizer written by save_pretrained may name one that the one it was saved from did not). A teacher
    log-prob of a token id is the student's token's only where both read the ids alike."""
    student_vocab, teacher_vocab = student.get_vocab(), teacher.get_vocab()
    if student_vocab != teacher_vocab:
        only_student = sorted(set(student_vocab) - set(teacher_vocab))
        moved = sorted(t for t in set(student_vocab) & set(teacher_vocab) if student_vocab[t] != teacher_vocab[t])
        if only_student or len(teacher_vocab) != len(student_vocab):
            example = f" (e.g. {only_student[0]!r} is not the teacher's)" if only_student else ""
            return f"vocabularies of {len(student_vocab)} and {len(teacher_vocab)} tokens differ{example}"
        token = moved[0]
        return f"{len(moved)} tokens have other ids (e.g. {token!r}: {student_vocab[token]} and {teacher_vocab[token]})"

    def special(tokenizer) -> dict[int, str]:
        return {i: str(t) for i, t in tokenizer.added_tokens_decoder.items() if t.special}

    if special(student) != special(teacher):
        return f"special tokens {special(student)} and {special(teacher)} differ"
    for name in ("bos_token", "eos_token"):
        if getattr(student, name, None) != getattr(teacher, name, None):
            return f"{name} {getattr(student, name, None)!r} and {getattr(teacher, name, None)!r} differ"
    return None


def check_teacher_tokenizer(student, teacher, student_name: str, teacher_path: str) -> None:
    """Refuse, in one line, a teacher whose tokenizer is not the student's (`tokenizer_mismatch`)."""
    problem = tokenizer_mismatch(student, teacher)
    if problem:
        raise ConfigError(
            f"model.teacher.path={teacher_path}: its tokenizer is not the student's ({student_name}): {problem}; the "
            "teacher scores the student's token ids, so both must read them alike; fix: a teacher of the student's "
            "tokenizer (the same model family)"
        )
