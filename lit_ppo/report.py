"""The run's report files: summary.json and curves.png."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

TIMING_KEYS = {
    "generate_seconds": "timing/generate_s",
    "reward_seconds": "timing/reward_s",
    "experience_seconds": "timing/experience_s",
    "train_seconds": "timing/train_s",
    "weight_sync_seconds": "timing/weight_sync_s",
}


def write_metrics_csv(path: str | Path, history: list[dict]) -> None:
    """metrics.csv, one row per rollout step, rewritten whole (atomically) so a resumed run has no gaps or repeats."""
    columns = ["rollout_step", "optimizer_step", "data_epoch", "samples_seen"]
    for row in history:
        columns += [k for k in row if k not in columns]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(history)
    os.replace(tmp, path)


def write_summary(output_dir: Path, module, plan, extra: dict) -> dict:
    history, evals = module.history, module.eval_history
    summary = {
        "rollout_steps": module.rollout_step,
        "optimizer_steps_actor": module.actor_optimizer_steps,
        "optimizer_steps_critic": module.critic_optimizer_steps,
        "expected_optimizer_steps": plan.total_optimizer_steps,
        "expected_optimizer_steps_critic": plan.total_optimizer_steps if plan.critic_enabled else 0,
        "samples_generated": int(module.samples_seen),
        "tokens_generated": int(sum(row["rollout/generated_tokens"] for row in history)),
        "eval_reward_initial": evals[0]["eval/reward"] if evals else None,
        "eval_reward_final": evals[-1]["eval/reward"] if evals else None,
        "reward_final": history[-1]["rollout/reward_mean"] if history else None,
        "skipped_updates": module.skipped_updates,
    }
    if plan.dynamic_sampling:  # samples_generated counts the samples trained on; these count what was drawn
        for key in ("prompts_consumed", "generation_rounds", "dropped_groups", "filled_groups"):
            summary[key] = int(sum(row.get(f"rollout/{key}", 0) for row in history))
    for key, metric in TIMING_KEYS.items():
        summary[key] = float(sum(row[metric] for row in history))  # every row has them: a missing one is a bug
    if evals:
        summary.update({f"eval_final/{k[5:]}": v for k, v in evals[-1].items() if k.startswith("eval/")})
        summary["eval_samples_final"] = evals[-1]["samples"]
    summary.update(extra)
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def write_curves(output_dir: Path, history: list[dict], evals: list[dict]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [row["rollout_step"] for row in history]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = [
        (axes[0, 0], "rollout/reward_mean", "training reward (mean)"),
        (axes[0, 1], None, "held-out greedy accuracy"),
        (axes[1, 0], "rollout/kl_to_reference", "KL to reference (per token)"),
        (axes[1, 1], "rollout/response_length_mean", "response length (tokens)"),
    ]
    for ax, key, title in panels:
        if key is None:
            ax.plot([e["rollout_step"] for e in evals], [e["eval/reward"] for e in evals], marker="o")
        else:
            ax.plot(steps, [row.get(key, float("nan")) for row in history])
        ax.set_title(title)
        ax.set_xlabel("rollout step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = output_dir / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
