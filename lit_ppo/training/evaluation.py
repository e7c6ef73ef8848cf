"""When PPOModule evaluates on the held-out prompts (mixed into it): before rollout step 1, every
trainer.eval_every steps and after the last (`evaluation_due`), again after a resume where a signal cut one short
(`evaluation_missing`); `mode=eval`'s one evaluation (`validation_step`); and the rows they add to the loggers.
The evaluation itself is the data module's (`RolloutDataModule.evaluate`).
"""

from __future__ import annotations

from typing import Any

from lit_ppo import waits


class Evaluations:
    """PPOModule's evaluations and its rows into the loggers (a mixin: reads the module's trainer, loggers, plan,
    rollout step and histories)."""

    def evaluation_due(self) -> bool:
        """Whether the held-out evaluation runs after rollout step `rollout_step`: every trainer.eval_every steps and
        after the last (before rollout step 1 too: `on_train_start`)."""
        last = self.rollout_step == self.plan.counts.total_rollout_steps
        return last or bool(self.eval_every and self.rollout_step % self.eval_every == 0)

    def evaluation_missing(self) -> bool:
        """Whether the evaluation due after the last completed rollout step has not run: a signal cut it short
        (lit_ppo.preemption); the checkpoint then holds the step's row without its evaluation."""
        if self.rollout_step == 0 or not self.trainer.datamodule.eval_prompts or not self.evaluation_due():
            return False
        return all(e["rollout_step"] != self.rollout_step for e in self.eval_history)

    def initial_row(self) -> dict[str, Any] | None:
        """The evaluation before any update, as the rollout_step 0 row of metrics.csv and the loggers; None when the
        run has none (no held-out prompts). Built from `eval_history`, which checkpoints keep, so a resumed run
        writes it again."""
        if not self.eval_history or self.eval_history[0]["rollout_step"] != 0:
            return None
        evaluation = {k: v for k, v in self.eval_history[0].items() if k.startswith("eval/")}
        return {"rollout_step": 0, "optimizer_step": 0, "data_epoch": 0, "samples_seen": 0, **evaluation}

    def _log_initial_evaluation(self, result: dict[str, Any]) -> None:
        row = self.initial_row()
        if not result or row is None:
            return
        numeric = {k: float(v) for k, v in row.items() if isinstance(v, (int, float))}
        for logger in self.loggers:
            logger.log_metrics(numeric, step=0)

    def validation_step(self, batch, batch_idx) -> None:
        """`mode=eval` (lit_ppo/run/evaluate.py, through `Trainer.validate`): the evaluation `on_train_start` makes
        before rollout step 1, of the weights this module holds (a model's, or a checkpoint's), into `eval_history`.
        A training run has no validation loop (its data module has no val_dataloader): it evaluates in its steps."""
        engine = self.trainer.datamodule.start_engine()
        waits.entering("the weight sync before the evaluation")
        self.sync_weights(engine, self.rollout_step)
        waits.entering("the evaluation")
        self._evaluate()

    def _evaluate_after_step(self) -> None:
        """The evaluation after rollout step `rollout_step`, into that step's row (the last of `history`)."""
        waits.entering(f"the evaluation after rollout step {self.rollout_step}")
        self.history[-1].update(self._evaluate())

    def _evaluate(self) -> dict[str, Any]:
        result = self.trainer.datamodule.evaluate()
        if not result:
            return {}
        samples = result.pop("eval/samples")
        self.eval_history.append({"rollout_step": self.rollout_step, **result, "samples": samples})
        return result

    def _log_row(self, row: dict[str, Any]) -> None:
        """A rollout step's row (already in `history`; metrics.csv: lit_ppo.run.build.MetricsCSV) into the loggers."""
        numeric = {k: float(v) for k, v in row.items() if isinstance(v, (int, float))}
        for logger in self.loggers:
            logger.log_metrics(numeric, step=self.rollout_step)
