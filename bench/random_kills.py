"""Proof by random kills (issue 36 item 6): SIGKILL the trainer, or one rollout worker, at seeded random points of a
`train.py` run, resume each time with `resume=auto` in the same output_dir, finish the run uninterrupted, and check it
against an uninterrupted run of the same settings:

  (a) the final weights (every .safetensors the run wrote, and the last checkpoint's tensors) are bitwise equal;
  (b) every rollout step trained the same prompts as the uninterrupted run's, and every prompt of the plan was
      trained exactly once per data epoch (where the plan has no dynamic sampling, which drops groups by design).

Which prompts a rollout step trained is what the product already records per step with
`LIT_PPO_DUMP_ADVANTAGES=<dir>` (lit_ppo.training.experience.dump_experience: one file per rollout step and rank,
with the samples' dataset indices, rewritten when a resumed run trains that step again).

A kill point is seeded: a rollout step s drawn from those not yet checkpointed, an event of that step (its
checkpoint before it, `checkpoint s-1` — for s = 1 the start of the run —, or its experience, `experience s`, the
moment its updates begin) and a delay after the event drawn uniformly from [0, max_delay_s). The wall-clock
moments differ between machines, so the report names each kill by its point and the checkpoint it left.

    python bench/random_kills.py --case colocated --kills 3 --seed 0
    python bench/random_kills.py --case disaggregated_k1_worker --kills 2 --seed 1

The tests (tests/end_to_end/test_random_kills.py) import this file by its path and call `run_case`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from lit_ppo.checkpoints import checkpoint_path, list_checkpoints  # noqa: E402
from lit_ppo.training.experience import DUMP_ADVANTAGES_ENV  # noqa: E402

# A short run of the tiny model: 64 prompts, 16 per rollout step -> 4 rollout steps per data epoch; 6 steps cross a
# data-epoch boundary. float32, so that the comparison is exact on every machine.
COMMON = (
    "trainer.total_rollout_steps=6",
    "trainer.checkpoint_every=1",
    "trainer.eval_every=0",
    "model.warm_start.steps=20",
    "data.n_train=64",
    "data.n_eval=8",
    "ppo.rollout_batch_size=16",
    "ppo.train_batch_size=32",
    "ppo.micro_train_batch_size=32",
    "strategy.precision=32-true",
)
DISAGGREGATED = ("rollout.mode=disaggregated", "ppo.rollout_correction.mode=tis")


@dataclasses.dataclass(frozen=True)
class Case:
    overrides: tuple[str, ...]
    target: str = "trainer"  # what is killed: the trainer process, or rollout worker 0
    steps: int = 6


CASES = {
    "colocated": Case(()),
    "colocated_short": Case(("trainer.total_rollout_steps=3",), steps=3),  # the fast suite's case
    "disaggregated_k1": Case((*DISAGGREGATED, "rollout.max_staleness=1")),
    "disaggregated_k2": Case((*DISAGGREGATED, "rollout.max_staleness=2")),
    "disaggregated_k1_worker": Case((*DISAGGREGATED, "rollout.max_staleness=1"), target="worker"),
    "disaggregated_k2_worker": Case((*DISAGGREGATED, "rollout.max_staleness=2"), target="worker"),
    "lora": Case(("model.lora.rank=8", "model.lora.alpha=16")),
    "dynamic_sampling": Case(("ppo=dapo",)),
    # DAPO with rollout workers (issue 36 item 2): steps requested ahead with the plan's rounds, refilled from version s
    "dynamic_sampling_k1": Case((*DISAGGREGATED, "rollout.max_staleness=1", "ppo=dapo")),
    # ... every group expected to differ: 1 round requested ahead, refill rounds (version s) in most steps
    "dynamic_sampling_k1_refill": Case(
        (*DISAGGREGATED, "rollout.max_staleness=1", "ppo=dapo", "ppo.dynamic_sampling.expected_informative_fraction=1")
    ),
    # Tool episodes, shortened: the experiment at COMMON's counts, which the command line sets over it (colocated:
    # the workers refuse episodes until issue 36 item 1).
    "tool_episodes": Case(("+experiment=tool_arithmetic",)),
}


@dataclasses.dataclass
class Kill:
    rollout_step: int  # the rollout step (1-based) the kill falls in
    event: str  # "checkpoint s-1" or "experience s"
    delay_s: float
    done: bool = False  # False: the run ended (or failed) before the event
    checkpoint_left: str = ""  # the latest checkpoint in the directory after the kill
    exit_code: int | None = None


@dataclasses.dataclass
class Result:
    case: str
    seed: int
    kills: list[Kill]
    runs: int  # train.py runs in the killed directory, the final uninterrupted one included
    findings: list[str]  # empty: the proof holds

    def report(self) -> str:
        lines = [f"case {self.case} seed {self.seed}: {self.runs} runs in the killed directory"]
        for k in self.kills:
            state = f"exit {k.exit_code}, left {k.checkpoint_left or 'no checkpoint'}" if k.done else "not reached"
            lines.append(f"  kill at {k.event} + {k.delay_s:.2f} s: {state}")
        lines += [f"  FINDING: {f}" for f in self.findings] or ["  PASS: weights bitwise equal, prompts exactly once"]
        return "\n".join(lines)


def command(case: Case, out: Path, cache: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "train.py"),
        *COMMON,
        *case.overrides,
        f"cache_dir={cache}",
        f"output_dir={out}",
        f"hydra.run.dir={out / 'hydra'}",
        *extra,
    ]


def start(case: Case, out: Path, cache: Path, log: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, DUMP_ADVANTAGES_ENV: str(out / "trained_prompts"), "PYTHONPATH": str(ROOT)}
    with open(log, "a") as f:
        # A session of its own: what the run leaves behind (orphaned workers) can be found and ended by its group.
        return subprocess.Popen(
            command(case, out, cache, *extra),
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def end_group(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """Waits for the processes the run started to end with it (workers watch their parent), then ends the rest."""
    deadline = time.time() + grace_s
    while time.time() < deadline:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def worker_pids(trainer_pid: int) -> list[int]:
    """The rollout workers the trainer spawned (`python -m lit_ppo.rollout.workers ...`), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == trainer_pid and "lit_ppo.rollout.workers" in cmdline:
            found.append(int(entry.name))
    return found


def event_happened(out: Path, event: str) -> bool:
    kind, step = event.split()
    s = int(step)
    if kind == "checkpoint":
        return s == 0 or checkpoint_path(out / "checkpoints", s).exists()
    # dump_experience names the file by the 0-based rollout step of the batch
    return (out / "trained_prompts" / f"rollout_step={s - 1:06d}.rank0.pt").exists()


def draw_kill(rng: random.Random, out: Path, case: Case, max_delay_s: float) -> Kill:
    saved = list_checkpoints(out / "checkpoints")
    done = int(saved[-1].stem.split("_")[-1]) if saved else 0
    s = rng.randint(done + 1, case.steps)
    event = rng.choice([f"checkpoint {s - 1}", f"experience {s}"])
    return Kill(s, event, rng.uniform(0.0, max_delay_s))


def kill_run(case: Case, out: Path, cache: Path, log: Path, kill: Kill, timeout_s: float, resume: bool) -> None:
    """One run in `out` (resumed with resume=auto unless it is the first), killed at `kill`'s point."""
    process = start(case, out, cache, log, *(["resume=auto"] if resume else []))
    deadline = time.time() + timeout_s
    try:
        while not event_happened(out, kill.event):
            if process.poll() is not None or time.time() > deadline:
                break
            time.sleep(0.02)
        else:
            time.sleep(kill.delay_s)
            if process.poll() is None:
                if case.target == "trainer":
                    process.send_signal(signal.SIGKILL)
                    kill.done = True
                else:
                    workers = worker_pids(process.pid)
                    if workers:
                        os.kill(workers[0], signal.SIGKILL)
                        kill.done = True
        # A killed worker stops the trainer (RolloutWorkerError); a trainer not killed runs to its end.
        kill.exit_code = process.wait(timeout=max(1.0, deadline - time.time()))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        end_group(process)
    saved = list_checkpoints(out / "checkpoints")
    kill.checkpoint_left = saved[-1].name if saved else ""


def complete(case: Case, out: Path, cache: Path, log: Path, timeout_s: float, *extra: str) -> int:
    process = start(case, out, cache, log, *extra)
    try:
        return process.wait(timeout=timeout_s)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        end_group(process)


def trained_prompts(out: Path) -> dict[int, list[int]]:
    """rollout step (1-based) -> the dataset indices of the samples it trained, over every rank, as recorded."""
    steps: dict[int, list[int]] = {}
    for path in sorted((out / "trained_prompts").glob("rollout_step=*.pt")):
        record = torch.load(path, weights_only=False)
        steps.setdefault(record["rollout_step"] + 1, []).extend(record["dataset_indices"])
    return steps


def weights(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the run's final weights (actor/, merged/, ...) and of its last checkpoint."""
    tensors = {}
    for path in sorted(out.rglob("*.safetensors")):
        if "checkpoints" not in path.parts:
            tensors |= {f"{path.relative_to(out)}:{k}": v for k, v in load_file(path).items()}
    last = list_checkpoints(out / "checkpoints")[-1]
    state = torch.load(last, map_location="cpu", weights_only=False)
    tensors |= {f"{last.name}:{k}": v for k, v in state["state_dict"].items()}
    return tensors


def compare(reference: Path, killed: Path, case: Case) -> list[str]:
    findings = []
    a, b = weights(reference), weights(killed)
    if a.keys() != b.keys():
        findings.append(f"the killed run's tensors differ in names: {sorted(a.keys() ^ b.keys())[:4]}")
    differ = [k for k in a.keys() & b.keys() if not torch.equal(a[k], b[k])]
    if differ:
        worst = max(differ, key=lambda k: (a[k].double() - b[k].double()).abs().max().item())
        gap = (a[worst].double() - b[worst].double()).abs().max().item()
        findings.append(f"{len(differ)} of {len(a)} tensors differ bitwise (largest: {worst}, max |diff| {gap:.3g})")
    want, got = trained_prompts(reference), trained_prompts(killed)
    if sorted(got) != list(range(1, case.steps + 1)):
        findings.append(f"rollout steps recorded {sorted(got)}, planned 1..{case.steps}")
    for s in sorted(want.keys() | got.keys()):
        if sorted(want.get(s, [])) != sorted(got.get(s, [])):
            # prompts (each sample names its prompt; a prompt's samples come together)
            lost = sorted(set((Counter(want.get(s, [])) - Counter(got.get(s, []))).elements()))
            extra = sorted(set((Counter(got.get(s, [])) - Counter(want.get(s, []))).elements()))
            findings.append(f"rollout step {s} trained other prompts than uninterrupted: missing {lost}, extra {extra}")
    plan = json.loads((killed / "plan.json").read_text())
    counts_plan = plan["counts"]
    if not plan["dynamic_sampling"]:
        per_epoch = counts_plan["rollout_steps_per_data_epoch"]
        for epoch in range(0, case.steps, per_epoch):
            steps = range(epoch + 1, min(epoch + per_epoch, case.steps) + 1)
            counts = Counter(i for s in steps for i in set(got.get(s, [])))
            repeated = sorted(i for i, n in counts.items() if n > 1)
            if repeated:
                findings.append(f"data epoch {epoch // per_epoch}: prompts {repeated} trained in more than one step")
            if len(steps) == per_epoch and len(counts) != counts_plan["rollout_batch_size"] * per_epoch:
                findings.append(
                    f"data epoch {epoch // per_epoch}: {len(counts)} distinct prompts trained, planned "
                    f"{counts_plan['rollout_batch_size'] * per_epoch}"
                )
    return findings


def run_case(
    name: str,
    kills: int,
    seed: int,
    workdir: Path,
    *,
    max_delay_s: float = 2.0,
    timeout_s: float = 600.0,
    cache: Path | None = None,
) -> Result:
    """The uninterrupted run and the killed one of case `name` in `workdir`; the findings say what differs."""
    case = CASES[name]
    workdir.mkdir(parents=True, exist_ok=True)
    cache = cache or workdir / "cache"
    reference, killed = workdir / "uninterrupted", workdir / "killed"
    log = workdir / "runs.log"
    code = complete(case, reference, cache, log, timeout_s)
    if code != 0:
        return Result(name, seed, [], 0, [f"the uninterrupted run failed with exit code {code}; see {log}"])
    rng = random.Random(seed)
    done: list[Kill] = []
    for i in range(kills):
        kill = draw_kill(rng, killed, case, max_delay_s)
        kill_run(case, killed, cache, log, kill, timeout_s, resume=i > 0)
        done.append(kill)
        if kill.checkpoint_left == checkpoint_path(killed / "checkpoints", case.steps).name:
            break  # the run finished before the kill: nothing left to interrupt
    code = complete(case, killed, cache, log, timeout_s, "resume=auto")
    runs = len(done) + 1
    if code != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-3:]).strip()
        return Result(name, seed, done, runs, [f"the final resume=auto failed with exit code {code}: {tail}"])
    return Result(name, seed, done, runs, compare(reference, killed, case))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=sorted(CASES), required=True)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="default: a new directory under /tmp")
    parser.add_argument("--max-delay-s", type=float, default=2.0)
    args = parser.parse_args()
    import tempfile

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix=f"random_kills_{args.case}_"))
    started = time.time()
    result = run_case(args.case, args.kills, args.seed, workdir, max_delay_s=args.max_delay_s)
    print(result.report())
    print(f"{time.time() - started:.0f} s; runs and logs in {workdir}")
    sys.exit(1 if result.findings else 0)


if __name__ == "__main__":
    main()
