"""Preemption: SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 stop the run at the next safe point with a checkpoint of the last
completed rollout step, and the process exits with 128 + the signal's number (143 for SIGTERM, 130 for SIGINT, 138 for
SIGUSR1), with one console line saying what happened and how to continue.

Why that status: it is what the scheduler would have seen had the signal's default action killed the process (a
shell reports exactly 128 + N for a child killed by signal N), so whatever treats "killed by the scheduler's signal"
as "not finished" (SLURM's RequeueExit, Kubernetes' restartPolicy: OnFailure, torchrun's restarts, a retry loop in a
batch script) requeues the run instead of taking it for a finished one, as it would with 0.

Lightning 2.6 has its own SIGTERM handling, which this replaces for the duration of `fit` (Lightning's teardown puts
the earlier handlers back): its handler broadcasts a tensor from inside the signal handler, a collective at whatever
point the rank was interrupted in, and its loops then stop with `SIGTERMException`, a SystemExit with status 0 and no
checkpoint. Its SLURM auto-requeue handler for SIGUSR1 writes `hpc_ckpt_N.ckpt` from inside the handler, in the middle
of an update, non-atomically, where `resume=auto` never looks. What is kept of Lightning: forwarding the signal to the
ranks its launcher started, and `Preempted` is a `SIGTERMException`, so Lightning's `on_exception` hooks see the kind
of exception they expect.

Safe points. A rollout step first produces data that nothing keeps (generation, rewards, the experience forwards) and
then changes the models (optimizer steps). The first part runs in `interruptible` regions: the signal handler raises
inside them, so even one long vLLM call or a hanging reward stops within a fraction of a second, and the region's
work is dropped (not where the region itself runs collectives: FSDP's forwards, a tensor-parallel engine; those
are only stopped at their end). Each region is followed by `stop_point`, where the ranks agree (an all-reduce of the flag; every
rank passes the same stop points in the same order) and, if any rank was signalled, all raise `Preempted` together.
The optimizer steps cannot be dropped halfway, so between micro-batches the run stops only when the last completed
rollout step is already on disk (nothing is saved then); otherwise the step finishes and the run stops after it (at
`on_train_batch_end`), saving that step. A dropped step leaves the data position and the random streams as they were
at its start (restored from the snapshot taken in `on_train_batch_start`), so the checkpoint is exactly the one the
previous step would have written and a resumed run repeats the dropped step bitwise.

The held-out evaluation (before rollout step 1, every trainer.eval_every steps, after the last) runs in an
interruptible region too, its all-reduce outside it: a signal drops that pass's results, the completed step before it
is saved, and the resumed run evaluates again before it logs the step (`PPOModule.evaluation_missing`).

Outside `fit`'s rollout steps (start-up: config, pre-flight, model load, engine start; and the final writes after the
last step) `signals.outside_training` handles the same signals: `signals.Stopped`, a SystemExit with the same status, and a line
(`train.py` installs it for the whole process).
"""

from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager

import lightning as L
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_ppo import signals
from lit_ppo.checkpoints import RolloutCheckpoint, checkpoint_path, restore_rng_state, rng_state
from lit_ppo.console import show
from lit_ppo.distributed import EVERY_RANK, global_max
from lit_ppo.signals import PREEMPTION_SIGNALS, exit_status
from lit_ppo.topology import RankTopology

log = logging.getLogger("lit_ppo")

_AGREEING: list = []  # the groups stop points agree over, innermost last (`agreeing_among`); none: every rank


class Preempted(SIGTERMException):
    """The run stopped on a preemption signal; a SystemExit whose code is the process's exit status."""

    def __init__(self, signum: int):
        super().__init__(exit_status(signum))
        self.signum = int(signum)


class _Interrupt(BaseException):
    """Raised by the signal handler inside an interruptible region; a BaseException, so that code catching
    Exception (a reward's or an environment's error handling) does not take it for their failure."""


def _raised_while_interrupted(error: BaseException) -> bool:
    """Whether `error` was raised while an `_Interrupt` was being handled (it is in its chain of contexts)."""
    seen: set[int] = set()
    context = error.__context__
    while context is not None and id(context) not in seen:
        if isinstance(context, _Interrupt):
            return True
        seen.add(id(context))
        context = context.__context__
    return False


class Preemption(L.Callback):
    """Handles SIGTERM/SIGUSR1 during `fit` (see the module's docstring). Put it after `checkpoints` in the
    trainer's callbacks: at the end of a step the regular checkpoint is then written first."""

    _active: Preemption | None = None  # the one handling signals now (signals belong to the process)

    def __init__(self, checkpoints: RolloutCheckpoint):
        self.checkpoints = checkpoints
        self.requested: int | None = None  # the signal received, if any
        self._depth = 0  # > 0 inside an interruptible region
        self._handlers: dict[int, object] = {}
        self._trainer: L.Trainer | None = None
        self._topology = RankTopology()  # the module's, from on_train_start
        self._step_start: tuple[int, dict, dict] | None = None  # rollout_step, random states, data position

    # ------------------------------------------------------------ signals

    def on_train_start(self, trainer, module) -> None:
        # After Lightning registered its own handlers (just before the fit loop runs), so these replace them.
        self.requested, self._depth, self._trainer, self._topology = None, 0, trainer, module.topology
        signals.training_started()  # once this handler is gone again: the final writes
        if threading.current_thread() is not threading.main_thread():
            return  # signals are delivered to the main thread only
        for signum in PREEMPTION_SIGNALS:
            self._handlers[signum] = signal.signal(signum, self._on_signal)
        Preemption._active = self

    def teardown(self, trainer, module, stage: str) -> None:
        self._deactivate()

    def _deactivate(self) -> None:
        for signum, handler in self._handlers.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, handler)
        self._handlers = {}
        if Preemption._active is self:
            Preemption._active = None

    def _on_signal(self, signum: int, frame) -> None:
        first = self.requested is None
        if first:
            self.requested = signum
            log.info("preemption: received %s; stopping at the next safe point", signal.Signals(signum).name)
            # Lightning's own launcher started the other ranks as child processes: they get the signal too.
            launcher = getattr(self._trainer.strategy, "launcher", None) if self._trainer else None
            for child in list(getattr(launcher, "procs", None) or []):
                if child.poll() is None:
                    child.send_signal(signum)
        if self._depth > 0:
            self._depth = 0  # raised once: the region's cleanup must not be interrupted again
            raise _Interrupt()

    # ------------------------------------------------------------ safe points

    def interruptibly(self, fn):
        """fn() in a region whose work is dropped on preemption: its result, or None when a signal arrived (before
        or during it). The caller must pass a `stop_point` right after it, which then stops the run."""
        if self.requested is not None:
            return None
        self._depth += 1
        try:
            try:
                if self.requested is not None:  # arrived between the check above and the region's start
                    return None
                return fn()
            finally:
                self._depth = 0
        except _Interrupt:  # also one raised while leaving the region
            return None
        except Exception as error:
            if not _raised_while_interrupted(error):
                raise
            # A library's cleanup failed while the interrupt unwound it (vLLM's tokenizer pool's `finally` read a
            # variable the interrupt had kept from being set: an UnboundLocalError, the interrupt as its context):
            # the region's work is dropped all the same, and the stop point after it stops the run.
            log.info("preemption: %s raised while the signal interrupted it: dropped", type(error).__name__)
            return None

    def agreed(self, device: torch.device | None = None) -> int | None:
        """The signal any rank received (the largest number), or None; a collective under data parallelism."""
        if not self._topology.distributed:
            return self.requested  # no tensor: no device synchronisation for a flag this process holds
        flag = torch.tensor([self.requested or 0], dtype=torch.int64, device=device)
        group = _AGREEING[-1] if _AGREEING else EVERY_RANK  # context-parallel peers too, unless they wait elsewhere
        signum = int(global_max(flag, group=group).item())
        return signum or None

    def stop_point(self, device=None) -> None:
        """Stop here, every rank together, if a preemption signal arrived on any of them."""
        signum = self.agreed(device)
        if signum is not None:
            raise Preempted(signum)

    def step_start_on_disk(self, module) -> bool:
        """Whether the state at the start of the step in progress is already saved (then it may be dropped
        even after optimizer steps)."""
        return self.checkpoints.last_saved == module.rollout_step

    # ------------------------------------------------------------ the rollout step's edges

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        datamodule = trainer.datamodule
        # The data module's snapshot waits for nothing: a generation in flight is received where the step needs it.
        self._step_start = (module.rollout_step, rng_state(), datamodule.snapshot() if datamodule is not None else None)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self._step_start = None
        signum = self.agreed(module.device)
        if signum is not None:
            raise Preempted(signum)

    def on_exception(self, trainer, module, exception: BaseException) -> None:
        # Lightning calls no `teardown` hook after an exception: stop handling signals here (a later `fit` in this
        # process must not see this one's flag).
        try:
            if isinstance(exception, Preempted):
                self._stop(trainer, module, exception)
        finally:
            self._deactivate()

    def _stop(self, trainer, module, exception: Preempted) -> None:
        launcher = getattr(trainer.strategy, "launcher", None)
        children = list(getattr(launcher, "procs", None) or [])
        if children:
            # Lightning's observer thread SIGKILLs rank 0 once a child exits non-zero, as the other ranks will
            # (with this same status) after the save below: rank 0 waits for them itself instead.
            launcher.procs.clear()
        written = False
        # A step stopped before it completed is dropped (an evaluation after a step keeps that step).
        dropped = self._step_start is not None and self._step_start[0] == module.rollout_step
        if dropped and not self.step_start_on_disk(module):
            # Dropped before any optimizer step: put back what the step had moved, then save the previous step.
            _, rng, data = self._step_start
            restore_rng_state(rng)
            if trainer.datamodule is not None:
                trainer.datamodule.restore(data)
        if self.checkpoints.last_saved != module.rollout_step:
            self.checkpoints.save(trainer, module)
            written = True
        if module.topology.is_rank_zero:
            path = checkpoint_path(self.checkpoints.directory, module.rollout_step)
            name = signal.Signals(exception.signum).name
            cut = (
                " (its evaluation was cut short: the resumed run evaluates again)"
                if module.evaluation_missing()
                else ""
            )
            show(
                f"{'interrupted' if exception.signum == signal.SIGINT else 'preempted'} by {name}: stopped after "
                f"rollout step {module.rollout_step} of {module.plan.counts.total_rollout_steps}{cut}; checkpoint {path} "
                f"{'written' if written else 'already on disk'}; exiting with status {exception.code} (continue with "
                "resume=auto)"
            )
        for child in children:
            child.wait()


def active() -> Preemption | None:
    """The Preemption handling signals in this process's `fit`, if any."""
    return Preemption._active


@contextmanager
def agreeing_among(group):
    """Stop points inside agree over `group` only (None: the data-parallel group; a `lit_ppo.distributed` group), the
    ranks that run the region's stop points, while the other ranks wait for the region's outcome in a collective of
    their own and stop when it says so: a context-parallel group's rank 0 generates and scores the group's samples
    (lit_ppo/rollout/context_group.py). Outside, they agree over every rank."""
    _AGREEING.append(group)
    try:
        yield
    finally:
        _AGREEING.pop()


def interruptibly(fn):
    """`Preemption.interruptibly` of the active handler; fn() without one."""
    handler = active()
    return fn() if handler is None else handler.interruptibly(fn)


def stop_point(device=None, *, module=None) -> None:
    """`Preemption.stop_point` of the active handler; nothing without one. With `module` (during its optimizer
    steps), only where the step's start is on disk: elsewhere the step must finish first."""
    handler = active()
    if handler is None:
        return
    if module is not None and not handler.step_start_on_disk(module):
        return  # it could not stop here anyway: no collective (the same answer on every rank)
    handler.stop_point(device)
