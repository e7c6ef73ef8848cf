"""The rank topology (lit_ppo/topology.py): who a trainer process is, read in one place, and held at run time against
the process group and the plan."""

from __future__ import annotations

import ast
import re
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from lit_ppo.errors import ConfigError
from lit_ppo.topology import RankTopology, check_launched_ranks, launched_worker_index, launcher_rank
from tests.helpers.ranks import start_ranks

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------ one place reads the ranks

ALLOWED = {"lit_ppo/topology.py", "lit_ppo/distributed.py"}  # the topology, and the collectives' own module
LAUNCHER_NAMES = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "GROUP_WORLD_SIZE",
    "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "JSM_NAMESPACE_RANK",
}  # fmt: skip
"""Environment variables in which a launcher (torchrun, Lightning, srun, jsrun) states a process's rank or size."""
ANYWHERE = {"global_rank", "is_global_zero", "get_rank", "get_world_size", "get_node_local_rank", "rank_zero_only"}
"""Lightning's and torch.distributed's rank reads, on whatever object."""
ON_THE_TRAINER = {"world_size", "local_rank", "node_rank"}
"""Read on a Lightning trainer, strategy or module (`self`) they are the process group's; on a topology, its."""


def rank_reads(source: str) -> list[str]:
    """Where `source` reads a rank or world size other than through a `RankTopology`: 'line: what'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        what = None
        if isinstance(node, ast.Attribute):
            base = node.value
            base_name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
            if node.attr in ANYWHERE or (
                node.attr in ON_THE_TRAINER and base_name in {"self", "trainer", "strategy", "lightning_module"}
            ):
                what = f"{base_name}.{node.attr}"
        elif isinstance(node, ast.Name) and node.id in ANYWHERE:
            what = node.id
        elif isinstance(node, ast.ImportFrom):
            names = {a.name for a in node.names}
            if node.module == "lit_ppo.distributed" and "world_size" in names or names & ANYWHERE:
                what = f"import of {sorted(names & (ANYWHERE | {'world_size'}))}"
        elif isinstance(node, ast.Constant) and node.value in LAUNCHER_NAMES:
            what = f"the variable {node.value}"
        elif isinstance(node, ast.keyword) and node.arg in LAUNCHER_NAMES:  # os.environ.update(RANK=...)
            what = f"the variable {node.arg}"
        if what:
            found.append(f"{getattr(node, 'lineno', '?')}: {what}")
    return found


def test_only_the_topology_and_the_collectives_read_the_ranks():
    readers = {}
    for path in sorted((ROOT / "lit_ppo").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        if name not in ALLOWED and (reads := rank_reads(path.read_text())):
            readers[name] = reads
    assert not readers, f"read the rank through lit_ppo.topology.RankTopology instead: {readers}"


@pytest.mark.parametrize(
    "source",
    [
        "rank = trainer.global_rank",
        "if self.trainer.is_global_zero: pass",
        "n = self.trainer.world_size",
        "r = self.local_rank",
        "import torch.distributed as dist\nr = dist.get_rank()",
        "from lightning.pytorch.utilities import rank_zero_only",
        "from lit_ppo.distributed import world_size",
        'import os\nr = os.environ.get("SLURM_PROCID")',
        "import os\nos.environ.update(LOCAL_RANK='0')",
    ],
)
def test_the_scan_finds_each_kind_of_read(source):
    assert rank_reads(source)


def test_the_scan_passes_reads_through_a_topology():
    assert not rank_reads("r, n = module.topology.rank, self.topology.world_size\nx = init_info.world_size")


# ------------------------------------------------------------------ one process


def test_one_process():
    one = RankTopology()
    assert (one.rank, one.world_size, one.data_parallel_rank, one.data_parallel_size) == (0, 1, 0, 1)
    assert (one.context_parallel_rank, one.context_parallel_size) == (0, 1)
    assert one.is_rank_zero and not one.distributed
    assert one.data_parallel_group is None and one.context_parallel_group is None
    one.check(1)  # no process group: nothing to disagree with


def test_the_data_parallel_size_is_the_world_over_the_context_parallel_groups():
    """Ranks 4..7 of 8 in groups of C = 2: data-parallel ranks 2, 2, 3, 3 of 4 (issue 51 sets C; the split is here)."""
    tops = [RankTopology(rank=r, world_size=8, context_parallel_size=2) for r in range(4, 8)]
    assert [(t.data_parallel_rank, t.context_parallel_rank) for t in tops] == [(2, 0), (2, 1), (3, 0), (3, 1)]
    assert {t.data_parallel_size for t in tops} == {4}
    assert not any(t.is_rank_zero for t in tops)
    with pytest.raises(ValueError, match="do not form groups of 3"):
        RankTopology(rank=0, world_size=8, context_parallel_size=3)
    with pytest.raises(ValueError, match="rank 2 is not among the 2 ranks"):
        RankTopology(rank=2, world_size=2)


def test_built_from_the_trainers_strategy():
    trainer = SimpleNamespace(global_rank=3, world_size=4, local_rank=1, node_rank=1)
    top = RankTopology.of(trainer)
    assert (top.rank, top.world_size, top.local_rank, top.node_rank, top.data_parallel_rank) == (3, 4, 1, 1, 3)
    assert not top.is_rank_zero and top.distributed


def test_a_lightning_trainer_numbers_its_ranks_from_the_launchers_environment(monkeypatch):
    """As Lightning's own launcher starts rank 1 of a 2-device run on node 1 of 2: LOCAL_RANK and NODE_RANK."""
    import lightning as L

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("NODE_RANK", "1")
    trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy="ddp", logger=False)
    top = RankTopology.of(trainer)
    assert (top.rank, top.world_size, top.local_rank, top.node_rank) == (3, 4, 1, 1)
    assert top.data_parallel_size == 4


@pytest.mark.parametrize(
    "environ, rank",
    [
        ({}, 0),
        ({"RANK": "3", "LOCAL_RANK": "1", "SLURM_PROCID": "7"}, 3),  # torchrun
        ({"LOCAL_RANK": "1", "SLURM_PROCID": "7"}, 1),  # Lightning's launcher, inside a SLURM allocation
        ({"SLURM_PROCID": "5"}, 5),  # srun
        ({"JSM_NAMESPACE_RANK": "2"}, 2),  # jsrun
        ({"RANK": "", "SLURM_PROCID": "4"}, 4),  # an empty variable is not a rank
    ],
)
def test_the_launchers_rank_before_the_trainer_exists(environ, rank):
    assert launcher_rank(environ) == rank


# ------------------------------------------------------------------ the launcher's ranks against the plan's

TORCHRUN_NODE_1 = {"TORCHELASTIC_RUN_ID": "none", "RANK": "1", "LOCAL_RANK": "0", "GROUP_RANK": "1",
                   "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}  # fmt: skip
"""torchrun --nnodes=2 --nproc-per-node=1 --node-rank=1: what its one rank on node 1 reads."""
SRUN_NODE_1 = {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_NNODES": "2", "SLURM_PROCID": "1",
               "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "ppo",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29512"}  # fmt: skip
"""srun --nodes=2 --ntasks-per-node=1: its task on node 1 (tests/end_to_end/test_nodes.py starts these two)."""


@pytest.mark.parametrize("environ", [TORCHRUN_NODE_1, SRUN_NODE_1], ids=["torchrun", "srun"])
def test_a_launchers_node_1_of_2_is_rank_1_to_lightning_and_passes_the_check(monkeypatch, environ):
    import lightning as L

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    check_launched_ranks(devices=1, num_nodes=2, environ=environ)
    trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy="ddp", logger=False)
    top = RankTopology.of(trainer)
    assert (top.rank, top.world_size, top.local_rank, top.node_rank) == (1, 2, 0, 1)


@pytest.mark.parametrize(
    "devices, num_nodes, changed, message",
    [
        (1, 2, {"WORLD_SIZE": "4"}, re.escape(
            "torchrun started 4 ranks, 1 on this node (WORLD_SIZE=4, LOCAL_WORLD_SIZE=1: --nnodes x --nproc-per-node), "
            "but strategy.devices=1 x strategy.num_nodes=2 plans 2, 1 per node; fix: strategy.devices=1 "
            "strategy.num_nodes=4, or torchrun --nnodes=2 --nproc-per-node=1")),
        # --nnodes=1 --nproc-per-node=2: the world matches (Lightning checks no more), the ranks per node do not
        (1, 2, {"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}, r"torchrun started 2 ranks, 2 on this node .* plans 2, 1 "
         r"per node; fix: strategy.devices=2 strategy.num_nodes=1, or torchrun --nnodes=2 --nproc-per-node=1"),
        (2, 1, {}, r"torchrun started 2 ranks, 1 on this node .*; fix: strategy.devices=1 strategy.num_nodes=2"),
    ],
)  # fmt: skip
def test_torchruns_ranks_other_than_the_plans_are_refused_in_one_line(devices, num_nodes, changed, message):
    with pytest.raises(ConfigError, match=message):
        check_launched_ranks(devices, num_nodes, {**TORCHRUN_NODE_1, **changed})


@pytest.mark.parametrize(
    "devices, num_nodes, changed, message",
    [
        (1, 2, {"SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODEID": "0"},
         "srun started 2 tasks on 1 nodes, 2 per node (SLURM_NTASKS, SLURM_NNODES, SLURM_NTASKS_PER_NODE), but "
         "strategy.devices=1 x strategy.num_nodes=2 plans 2 ranks, 1 per node; fix: strategy.devices=2 "
         "strategy.num_nodes=1 (in a batch script: $SLURM_NTASKS_PER_NODE and $SLURM_NNODES)"),
        (2, 2, {"SLURM_NTASKS": "3", "SLURM_NTASKS_PER_NODE": "2"}, "srun started 3 tasks on 2 nodes, 2 per node "
         "(SLURM_NTASKS, SLURM_NNODES, SLURM_NTASKS_PER_NODE), but strategy.devices=2 x strategy.num_nodes=2 plans 4 "
         "ranks, 2 per node; fix: srun --nodes=2 --ntasks-per-node=2, one task per device"),
        (1, 2, {"SLURM_NTASKS_PER_NODE": None}, "srun started 2 tasks (SLURM_NTASKS) without --ntasks-per-node, "
         "by which Lightning numbers them per node; fix: srun (or #SBATCH) --nodes=2 --ntasks-per-node=1"),
        (1, 2, {"SLURM_NTASKS_PER_NODE": "1(x2)"}, "srun gives the nodes different task counts"),
    ],
)  # fmt: skip
def test_sruns_tasks_other_than_the_plans_are_refused_in_one_line(devices, num_nodes, changed, message):
    environ = {k: v for k, v in {**SRUN_NODE_1, **changed}.items() if v is not None}
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_launched_ranks(devices, num_nodes, environ)


def test_several_nodes_without_a_launcher_are_refused_where_lightning_would_wait_for_them():
    with pytest.raises(ConfigError, match=re.escape(
        "strategy.num_nodes=2, but no launcher started this process (no torchrun or srun variables, no NODE_RANK and "
        "MASTER_ADDR): its ranks would wait for the other nodes' ranks without end; fix: start it on every node with "
        "torchrun --nnodes=2 --nproc-per-node=4 or srun"
    )):  # fmt: skip
        check_launched_ranks(4, 2, {"PATH": "/usr/bin"})
    check_launched_ranks(4, 2, {"NODE_RANK": "1", "MASTER_ADDR": "node0"})  # Lightning's own, started on each node
    check_launched_ranks(4, 1, {})  # one node: Lightning starts the ranks itself
    check_launched_ranks(2, 1, {"SLURM_NTASKS": "8", "SLURM_JOB_NAME": "interactive"})  # Lightning's opt-out of SLURM
    # torchrun inside a SLURM allocation: torchrun's ranks, as Lightning reads them first
    check_launched_ranks(1, 2, {**SRUN_NODE_1, "SLURM_NTASKS": "1", **TORCHRUN_NODE_1})


def test_a_rollout_workers_number_from_srun_or_torchrun():
    assert launched_worker_index({"SLURM_PROCID": "2", "RANK": "5"}) == "2"
    assert launched_worker_index({"SLURM_PROCID": "", "RANK": "5"}) == "5"
    assert launched_worker_index({}) is None


def test_the_plans_data_parallel_size_is_checked(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # no group (an in-process vLLM engine may leave one)
    with pytest.raises(ConfigError) as info:
        RankTopology(rank=1, world_size=2).check(4)
    assert str(info.value) == (
        "the trainer runs 2 data-parallel ranks but the step plan was made for 4; fix: plan with "
        "strategy.devices x strategy.num_nodes = 2"
    )
    with pytest.raises(ConfigError, match=r"runs 2 data-parallel ranks \(4 ranks in groups of 2\) but .* made for 4"):
        RankTopology(rank=1, world_size=4, context_parallel_size=2).check(4)


# ------------------------------------------------------------------ two ranks (gloo)


def on_two_ranks(rank: int, store_path: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        outcome = {}
        for name, topology, planned in [
            ("agrees", RankTopology(rank=rank, world_size=2), 2),
            ("one process", RankTopology(), 1),  # a module built without build_run's topology
            ("plan of 1", RankTopology(rank=rank, world_size=2), 1),
        ]:
            try:
                topology.check(planned)
                outcome[name] = None
            except ConfigError as error:
                outcome[name] = str(error)
        results[rank] = outcome
    except Exception:  # noqa: BLE001 - reported to the test
        results[rank] = traceback.format_exc().strip().splitlines()[-1]
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_check_their_topology_against_the_process_group(tmp_path: Path):
    results = mp.Manager().dict()
    start_ranks(on_two_ranks, 2, str(tmp_path / "store"), results)
    for rank in (0, 1):
        outcome = results[rank]
        assert isinstance(outcome, dict), outcome
        assert outcome["agrees"] is None
        assert outcome["one process"] == (
            f"the process group numbers this process rank {rank} of 2 but the trainer's strategy rank 0 of 1; fix: "
            "launch every rank with the same strategy.devices x strategy.num_nodes, and with torchrun's or srun's "
            "rank variables (RANK, or SLURM_PROCID) unaltered"
        )
        assert outcome["plan of 1"].startswith(
            "the trainer runs 2 data-parallel ranks but the step plan was made for 1"
        )


# ------------------------------------------------------------------ four ranks: context x data parallel groups


def on_four_ranks(rank: int, store_path: str, results: dict) -> None:
    """C = 2 on 4 ranks: the groups' members, and a sum over each group (the reductions they are for)."""
    import torch

    from lit_ppo.distributed import global_sum

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=4)
    try:
        topology = RankTopology(rank=rank, world_size=4, context_parallel_size=2).with_groups()
        one_hot = torch.zeros(4)
        one_hot[rank] = 1.0
        results[rank] = {
            "context": dist.get_process_group_ranks(topology.context_parallel_group),
            "data": dist.get_process_group_ranks(topology.data_parallel_group),
            "context_sum": global_sum(one_hot, topology.context_parallel_group).tolist(),
            "data_sum": global_sum(one_hot, topology.data_parallel_group).tolist(),
            "ranks": (topology.data_parallel_rank, topology.context_parallel_rank),
        }
    except Exception:  # noqa: BLE001 - reported to the test
        results[rank] = traceback.format_exc().strip().splitlines()[-1]
    finally:
        dist.destroy_process_group()


def test_four_ranks_form_two_context_parallel_groups_of_two_and_two_data_parallel_groups(tmp_path: Path):
    results = mp.Manager().dict()
    start_ranks(on_four_ranks, 4, str(tmp_path / "store"), results)
    for rank in range(4):
        outcome = results[rank]
        assert isinstance(outcome, dict), outcome
        context, data = [rank // 2 * 2, rank // 2 * 2 + 1], [rank % 2, rank % 2 + 2]
        assert outcome["context"] == context  # ranks 2r, 2r+1 share data-parallel rank r's samples
        assert outcome["data"] == data  # one context-parallel rank of each group
        assert outcome["context_sum"] == [1.0 if r in context else 0.0 for r in range(4)]
        assert outcome["data_sum"] == [1.0 if r in data else 0.0 for r in range(4)]
        assert outcome["ranks"] == (rank // 2, rank % 2)


def test_the_context_and_data_parallel_groups_take_the_runs_collective_timeout(monkeypatch):
    """The groups built for C > 1 wait as long as the default group (`trainer.collective_timeout_s`), not torch's
    backend default (10 minutes under NCCL): a group's other ranks wait in them for its rank 0's whole generation."""
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy

    from lit_ppo import distributed, waits

    built = []
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: built.append((ranks, kw)) or len(built))
    monkeypatch.setattr(waits, "_collective_timeout_s", None)
    waits.strategy_timeout(DDPStrategy, 3600.0)
    try:
        RankTopology(rank=1, world_size=4, context_parallel_size=2).with_groups()
    finally:
        distributed.use_data_parallel_group(None)
    assert [ranks for ranks, _ in built] == [[0, 1], [2, 3], [0, 2], [1, 3]]
    assert all(kw["timeout"] == timedelta(seconds=3600.0) for _, kw in built), built


def test_one_context_parallel_rank_needs_no_groups():
    topology = RankTopology(rank=1, world_size=2)
    assert topology.with_groups() is topology  # torch's default group: no new_group call, no process group needed


def test_one_context_parallel_rank_puts_back_the_default_group_an_earlier_run_left():
    """A C > 1 run makes its data-parallel group the one the reductions of samples run over; a later C = 1 run in the
    same process (a test session, a notebook, an in-process sweep) must reduce over torch's default group again."""
    from lit_ppo import distributed

    distributed.use_data_parallel_group(object())  # an earlier context-parallel run's group
    try:
        RankTopology(rank=0, world_size=1).with_groups()
        assert distributed._group(None) is None
    finally:
        distributed.use_data_parallel_group(None)
