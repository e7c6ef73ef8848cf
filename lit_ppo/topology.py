"""Who this process is among the trainer's ranks: the one place that reads the launcher's rank variables and the
process group's rank and size (beside the collectives' own module, `lit_ppo.distributed`), in the manner of
prime-rl's `ParallelDims`.

`RankTopology.of(trainer)` is built once per run (`lit_ppo.run.build.build_run`), from the Lightning strategy's ranks,
and handed to the module, the data module and the callbacks; once the process group is up (the data module's setup)
`check` holds it against the group and against the plan's data-parallel size. Before the trainer exists (the run
directory's lock, the log file's name, rank 0's first writes), `launcher_rank` reads the launcher's environment, and
the pre-flight holds the ranks torchrun or srun started against strategy.devices x strategy.num_nodes
(`check_launched_ranks`).

Ranks r*C .. r*C+C-1 form one context-parallel group of C (`context_parallel_size`) that shares data-parallel rank
r's samples and splits their tokens (issue 51: lit_ppo/training/context_parallel.py); `with_groups` builds their process
groups once the default group is up. With C = 1, as today, the data-parallel rank is the global rank and the
data-parallel group is every rank (torch's default group, `None` to the collectives).

Import-light on purpose (no torch at import): `train.py` reads `launcher_rank` before torch loads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from lit_ppo.errors import ConfigError

LAUNCHER_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")
"""Where a launcher (torchrun, Lightning's own, SLURM's srun, LSF's jsrun) puts a process's global rank, in the order
Lightning reads them (LOCAL_RANK before SLURM_PROCID: srun may set the latter for a process it did not start)."""

WORKER_INDEX_VARIABLES = ("SLURM_PROCID", "RANK")
"""Where srun or torchrun puts a rollout worker's number (`python -m lit_ppo.rollout.workers --worker` unset)."""

LAUNCHER_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
"""The trainer's rendezvous variables, left out of a rollout worker's environment: its vLLM must not join the
trainer's process group."""

DRIVER_RANK = 0
"""The trainer rank that drives the rollout workers (their store, requests and weight push) and writes the run's
files."""


def launcher_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's global rank as the launcher (Lightning, torchrun, SLURM, jsrun) set it; 0 when alone. For the
    moments before the trainer exists; after, `RankTopology.rank`."""
    environ = os.environ if environ is None else environ
    for name in LAUNCHER_RANK_VARIABLES:
        if environ.get(name, "").isdigit():
            return int(environ[name])
    return 0


def launched_worker_index(environ: Mapping[str, str] | None = None) -> str | None:
    """A rollout worker's number as srun (SLURM_PROCID) or torchrun (RANK) gave it, unparsed; None without either."""
    environ = os.environ if environ is None else environ
    return next((environ[name] for name in WORKER_INDEX_VARIABLES if environ.get(name)), None)


# ------------------------------------------------------------------ the launcher's sizes against the plan's

NODE_VARIABLES = ("NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "LOCAL_RANK", "JSM_NAMESPACE_RANK", "OMPI_COMM_WORLD_RANK")
"""Variables by which some launcher (Lightning's own, on each node by hand, jsrun, mpirun) places this process among
several nodes; a run of several nodes with none of them, torchrun's or srun's has none to wait with."""


def launched_by(environ: Mapping[str, str]) -> str | None:
    """Which launcher Lightning will number this process's rank from, in Lightning's order (torchrun first: it may run
    inside a SLURM allocation): "torchrun", "srun", or None (Lightning's own launcher, or another)."""
    if environ.get("TORCHELASTIC_RUN_ID") is not None:  # torch.distributed.is_torchelastic_launched
        return "torchrun"
    if "SLURM_NTASKS" in environ and environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return "srun"  # Lightning's SLURMEnvironment.detect: an interactive job's name opts out
    return None


def check_launched_ranks(devices: int, num_nodes: int, environ: Mapping[str, str] | None = None) -> None:
    """Before any model loads, for a training run: the ranks the launcher started match strategy.devices x
    strategy.num_nodes, which the plan divides the work by; one line otherwise. Lightning itself would stop with a
    traceback at the trainer's construction (torchrun's WORLD_SIZE, srun's task and node counts), an IndexError
    (torchrun's ranks per node above strategy.devices), or wait for ranks that never come (several nodes and no
    launcher)."""
    environ = os.environ if environ is None else environ
    planned = f"strategy.devices={devices} x strategy.num_nodes={num_nodes}"
    launcher = launched_by(environ)
    if launcher == "torchrun":
        world, local = int(environ.get("WORLD_SIZE", 1)), int(environ.get("LOCAL_WORLD_SIZE", devices))
        if world != devices * num_nodes or local != devices:
            raise ConfigError(
                f"torchrun started {world} ranks, {local} on this node (WORLD_SIZE={world}, LOCAL_WORLD_SIZE={local}: "
                f"--nnodes x --nproc-per-node), but {planned} plans {devices * num_nodes}, {devices} per node; fix: "
                f"strategy.devices={local} strategy.num_nodes={max(1, world // local)}, or torchrun "
                f"--nnodes={num_nodes} --nproc-per-node={devices}"
            )
    elif launcher == "srun":
        check_srun_tasks(devices, num_nodes, environ, planned)
    elif num_nodes > 1 and not any(name in environ for name in NODE_VARIABLES):
        raise ConfigError(
            f"strategy.num_nodes={num_nodes}, but no launcher started this process (no torchrun or srun variables, no "
            "NODE_RANK and MASTER_ADDR): its ranks would wait for the other nodes' ranks without end; fix: start it on "
            f'every node with torchrun --nnodes={num_nodes} --nproc-per-node={devices} or srun (README, "Across '
            'nodes"), or strategy.num_nodes=1'
        )


def check_srun_tasks(devices: int, num_nodes: int, environ: Mapping[str, str], planned: str) -> None:
    """srun's tasks (SLURM_NTASKS), tasks per node (SLURM_NTASKS_PER_NODE, which Lightning requires with more than one
    task) and nodes (SLURM_NNODES) against the plan's ranks, devices per node and nodes."""
    tasks = int(environ["SLURM_NTASKS"])
    per_node = environ.get("SLURM_NTASKS_PER_NODE")
    nodes = int(environ.get("SLURM_NNODES", num_nodes))
    if tasks > 1 and per_node is None:
        raise ConfigError(
            f"srun started {tasks} tasks (SLURM_NTASKS) without --ntasks-per-node, by which Lightning numbers them "
            f"per node; fix: srun (or #SBATCH) --nodes={num_nodes} --ntasks-per-node={devices}, one task per device"
        )
    if per_node is not None and not per_node.isdigit():  # SLURM's "8(x2)" or "8,4": nodes with different counts
        raise ConfigError(
            f"srun gives the nodes different task counts (SLURM_NTASKS_PER_NODE={per_node}) but {planned} plans "
            f"{devices} per node; fix: srun --nodes={num_nodes} --ntasks-per-node={devices}"
        )
    per_node = int(per_node or tasks)
    if (tasks, per_node, nodes) != (devices * num_nodes, devices, num_nodes):
        fix = (
            f"strategy.devices={per_node} strategy.num_nodes={nodes} (in a batch script: $SLURM_NTASKS_PER_NODE and "
            "$SLURM_NNODES)"
            if tasks == per_node * nodes
            else f"srun --nodes={num_nodes} --ntasks-per-node={devices}, one task per device"
        )
        raise ConfigError(
            f"srun started {tasks} tasks on {nodes} nodes, {per_node} per node (SLURM_NTASKS, SLURM_NNODES, "
            f"SLURM_NTASKS_PER_NODE), but {planned} plans {devices * num_nodes} ranks, {devices} per node; fix: {fix}"
        )


@dataclass(frozen=True)
class RankTopology:
    """One trainer process's place among the ranks (module docstring). The default is a single process."""

    rank: int = 0
    """The global rank, 0 .. world_size - 1."""
    world_size: int = 1
    """Every trainer rank, data-parallel x context-parallel."""
    local_rank: int = 0
    """The rank on its node (its device's index there)."""
    node_rank: int = 0
    context_parallel_size: int = 1
    """C: the ranks that share one data-parallel rank's samples (1 until issue 51)."""
    data_parallel_group: Any = field(default=None, compare=False, repr=False)
    """The group the data-parallel reductions run over; None: torch's default group (every rank, as with C = 1)."""
    context_parallel_group: Any = field(default=None, compare=False, repr=False)
    """The group of this rank's C context-parallel ranks; None while C = 1."""

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"RankTopology: rank {self.rank} is not among the {self.world_size} ranks")
        if self.context_parallel_size < 1 or self.world_size % self.context_parallel_size:
            raise ValueError(
                f"RankTopology: {self.world_size} ranks do not form groups of {self.context_parallel_size} "
                "context-parallel ranks"
            )

    @classmethod
    def of(cls, trainer, context_parallel_size: int = 1) -> RankTopology:
        """The topology of a Lightning trainer's strategy, which numbered its ranks when the trainer was built (from
        the launcher's environment and strategy.devices x strategy.num_nodes), before its process group exists. (A
        strategy that starts its ranks as this process's children numbers them only after: refused before, by
        lit_ppo/run/preflight.py:check_launcher and build_run.)"""
        return cls(
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            local_rank=trainer.local_rank,
            node_rank=trainer.node_rank,
            context_parallel_size=context_parallel_size,
        )

    def with_groups(self) -> RankTopology:
        """This topology with its process groups, once the default group is up: the context-parallel groups (ranks
        r*C .. r*C+C-1) and the data-parallel groups (the ranks of one context-parallel rank, c, c+C, ...). A
        collective: `torch.distributed.new_group` is called by every rank for every group, in the same order. With
        C = 1 there is nothing to build (the data-parallel group is torch's default one). Makes the data-parallel group
        the one `lit_ppo.distributed`'s reductions of samples run over."""
        from lit_ppo.distributed import use_data_parallel_group

        C = self.context_parallel_size
        if C == 1:
            use_data_parallel_group(None)  # not an earlier run's group in this process (tests, notebooks, sweeps)
            return self
        import torch.distributed as dist

        from lit_ppo.waits import collective_timeout

        timeout = collective_timeout()  # trainer.collective_timeout_s, as the default group's
        context = data = None
        for first in range(0, self.world_size, C):
            group = dist.new_group(list(range(first, first + C)), timeout=timeout)
            context = group if first == self.data_parallel_rank * C else context
        for offset in range(C):
            group = dist.new_group(list(range(offset, self.world_size, C)), timeout=timeout)
            data = group if offset == self.context_parallel_rank else data
        use_data_parallel_group(data)  # the reductions of samples, from now on (lit_ppo.distributed)
        return replace(self, data_parallel_group=data, context_parallel_group=context)

    # ------------------------------------------------------------ ranks

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.context_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        """Which share of the samples this rank holds (its context-parallel group's)."""
        return self.rank // self.context_parallel_size

    @property
    def context_parallel_rank(self) -> int:
        """Which part of its samples' tokens this rank holds."""
        return self.rank % self.context_parallel_size

    @property
    def distributed(self) -> bool:
        """More than one trainer rank: the collectives have peers."""
        return self.world_size > 1

    @property
    def is_rank_zero(self) -> bool:
        """The rank that writes the run's files (metrics, checkpoints, summary) and speaks for the others."""
        return self.rank == DRIVER_RANK

    def export_launcher_environment(self) -> None:
        """RANK, LOCAL_RANK and WORLD_SIZE in this process's environment as torchrun would set them: what vLLM's
        external_launcher backend reads to join the process group the trainer set up."""
        os.environ.update(RANK=str(self.rank), LOCAL_RANK=str(self.local_rank), WORLD_SIZE=str(self.world_size))

    @staticmethod
    def launcher_environment_exported() -> bool:
        """Whether a rank variable is in the environment (`export_launcher_environment`, or a launcher's), so that a
        data-parallel vLLM engine can start."""
        return "RANK" in os.environ

    # ------------------------------------------------------------ the check at run time

    def check(self, planned_data_parallel_size: int) -> None:
        """Once the process group is up: the group numbers this process as this topology does, and the ranks are
        the plan's (`plan.counts.data_parallel_size`, strategy.devices x strategy.num_nodes). One line otherwise."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            group = (dist.get_rank(), dist.get_world_size())
            if group != (self.rank, self.world_size):
                raise ConfigError(
                    f"the process group numbers this process rank {group[0]} of {group[1]} but the trainer's strategy "
                    f"rank {self.rank} of {self.world_size}; fix: launch every rank with the same strategy.devices x "
                    "strategy.num_nodes, and with torchrun's or srun's rank variables (RANK, or SLURM_PROCID) unaltered"
                )
        if self.data_parallel_size != planned_data_parallel_size:
            ranks = f"{self.data_parallel_size} data-parallel ranks"
            if self.context_parallel_size > 1:
                ranks += f" ({self.world_size} ranks in groups of {self.context_parallel_size})"
            raise ConfigError(
                f"the trainer runs {ranks} but the step plan was made for {planned_data_parallel_size}; fix: plan with "
                f"strategy.devices x strategy.num_nodes = {self.world_size}"
            )
