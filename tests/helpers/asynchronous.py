"""Rollout-worker runs' shared test code (tests/rollout/test_async.py, test_async_dynamic_sampling.py,
test_schedule.py, workers/test_ranks.py, workers/test_servers.py): the tests' rollout settings with workers, a stand-in
for the workers' client (`QueueingWorkers`), a data module that records every batch it produced, a reward whose uniform
groups dynamic sampling drops (tests/rollout/test_dynamic_sampling.py too), and a signal to a worker mid-run."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import lightning as L

from lit_ppo.config import RolloutConfig, RolloutCorrectionConfig, WorkersConfig
from lit_ppo.contract import GenerateRequest, Generation
from lit_ppo.rollout.datamodule import RolloutDataModule
from tests.helpers import build_run, plan_of

STEPS = 6  # the schedule tests' run length (tests/rollout/test_schedule.py)
TIS = {"rollout_correction": RolloutCorrectionConfig(mode="tis")}  # build_run's keywords of TIS rollout correction


class SignalWorker(L.Callback):
    """Sends `sig` to rollout worker 0 during rollout step 1's updates: SIGKILL, or SIGSTOP (stuck); `group`: to its
    process group (a spawned server: the API server and its engine's processes). `pid`: the process signalled."""

    def __init__(self, sig, group: bool = False):
        self.sig, self.group, self.pid = sig, group, None

    def on_before_backward(self, trainer, module, loss):
        if module.rollout_step == 1 and self.pid is None:
            self.pid = trainer.datamodule.engine.procs[0].pid
            (os.killpg if self.group else os.kill)(self.pid, self.sig)


def disaggregated(k: int, **workers) -> RolloutConfig:
    """Rollouts of the tests' shape (temperature != 1, short responses) on one rollout worker; `workers`: its
    rollout.workers settings (WorkersConfig) beside the tests' timeouts."""
    return RolloutConfig(
        max_response_tokens=6,
        eval_samples_per_prompt=2,
        temperature=0.8,
        mode="disaggregated",
        max_staleness=k,
        workers=WorkersConfig(**{"start_timeout_s": 300.0, "batch_timeout_s": 120.0, **workers}),
    )


class RecordingDataModule(RolloutDataModule):
    batches: list = []

    @classmethod
    def fresh(cls) -> type:
        """A subclass with its own (empty) record: one per run, so runs in one test never share batches."""
        return type("Recording", (cls,), {"batches": []})

    def produce_rollout(self, rollout_step):
        batch = super().produce_rollout(rollout_step)
        type(self).batches.append(batch)
        return batch


def digit_share(prompts, responses, references, extras, **_) -> list[float]:
    """The share of digits in a response: a reward the random tiny model earns in varying amounts, so it learns."""
    return [sum(c.isdigit() for c in r) / max(len(r), 1) for r in responses]


def workers_run(
    model_dir, files, out: Path, rollout, steps: int, *, engine=None, callbacks=(), datamodule_class=None, **overrides
):
    """build_run's (trainer, module, data module, plan) of `steps` rollout steps with `rollout`'s settings, its batches
    recorded (`datamodule_class`: a RecordingDataModule, a fresh one by default): rewarded by `digit_share`, 8 prompts
    per rollout step in 2 optimizer steps of 16 samples (the policy moves between versions); `overrides`: build_run's
    keywords over these."""
    return build_run(
        model_dir,
        engine,
        files,
        out,
        total_rollout_steps=steps,
        rollout=rollout,
        callbacks=callbacks,
        datamodule_class=datamodule_class or RecordingDataModule.fresh(),
        **{
            "reward_fn": digit_share,
            "rollout_batch_size": 8,
            "train_batch_size": 16,
            "micro_train_batch_size": 8,
            **overrides,
        },
    )


def fit_then_close(trainer, module, datamodule, *, resume_from=None, close: bool = True, seed: int | None = 0) -> None:
    """`trainer.fit` (resumed from the checkpoint `resume_from`, if any) with torch's seed set first (None: left as
    is), then the data module's engine closed, also when the run raised (`close=False`: the test's shared engine)."""
    import torch

    if seed is not None:
        torch.manual_seed(seed)
    try:
        ckpt = str(resume_from) if resume_from else None
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt, weights_only=False)
    finally:
        if close and datamodule.engine is not None:
            datamodule.engine.close()


def even_answers_are_uniform(prompts, responses, references, extras):
    """Every sample of a prompt whose answer is even scores 1 (a uniform group, dropped); the others score a hash of
    their response in [0, 1), so their groups differ unless all samples are the same text."""
    return [
        1.0 if int(ref) % 2 == 0 else int.from_bytes(hashlib.sha256(r.encode()).digest()[:4], "little") / 2**32
        for r, ref in zip(responses, references)
    ]


class QueueingWorkers:
    """Stands in for the rollout workers' client (`RolloutWorkers`): each request is generated with the version pushed
    last before it (the workers' ordered commands), and its results are handed out when collected."""

    def __init__(self):
        self.version = 0  # the last version pushed
        self.submitted: list[int] = []  # rollout steps, in the order requested
        self.collected: list[int] = []  # rollout steps, in the order received

    def submit(self, request: GenerateRequest):
        step = request.seeds[0]  # `step_request`'s
        self.submitted.append(step)
        return (step, self.version, request.prompt_count, request.n)

    def collect(self, ticket):
        step, version, prompts, n = ticket
        self.collected.append(step)
        generations = [Generation(i // n, [step, i], False, "", [-1.0, -1.0]) for i in range(prompts * n)]
        return generations, [version] * (prompts * n), 0.5


def step_request(step: int, prompt_token_ids: list[list[int]], n: int) -> GenerateRequest:
    """A request of rollout step `step` as `QueueingWorkers` reads it: every prompt seeded with the step."""
    return GenerateRequest(
        prompt_token_ids, n=n, temperature=1.0, top_p=1.0, max_tokens=2, seeds=[step] * len(prompt_token_ids)
    )


def not_here():
    raise AssertionError("a source that generates ahead never generates in this process")


def plan(k: int):
    """A plan with rollout workers at staleness k, STEPS rollout steps."""
    return plan_of(256, rollout=RolloutConfig(mode="disaggregated", max_staleness=k), steps=STEPS)


def patch_child_processes(directory: Path, monkeypatch, source: str) -> None:
    """`source` as the sitecustomize of every Python process the test starts (workers, servers: their interpreters
    import it at start, and `source` picks its process by `sys.orig_argv`), first on their PYTHONPATH, which the
    test's end restores. No empty entry is added (one would put the working directory on `sys.path`)."""
    directory.mkdir()
    (directory / "sitecustomize.py").write_text(source)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH")])))
