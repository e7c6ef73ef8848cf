"""The weight push through vLLM's weight-transfer interface (rollout/weight_transfer/backend.py): lit-ppo's
`lit_ppo_gloo` backend as vLLM's factories build it, a push received while the worker still serves the previous
version and loaded later, and the checks that stop a push whose tensors differ from what it declared. The push into
real vLLM workers is tested with the rollout workers' runs (tests/rollout/test_async.py)."""

from __future__ import annotations

import datetime
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from lit_ppo.errors import WeightSyncError
from lit_ppo.rollout.weight_transfer.backend import (
    BACKEND,
    GlooTrainerInitInfo,
    GlooTrainerWeightTransferEngine,
    GlooWeightTransferEngine,
    ParamMeta,
    TensorSource,
)
from lit_ppo.rollout.workers.client import WorkerSyncClient
from lit_ppo.rollout.workers.messages import InitWeightTransfer


def test_both_sides_of_lit_ppo_gloo_are_registered_with_vllms_factories():
    assert WeightTransferEngineFactory._registry[BACKEND]() is GlooWeightTransferEngine
    assert WeightTransferTrainerFactory._registry[BACKEND]() is GlooTrainerWeightTransferEngine


def test_a_trainer_rank_that_does_not_send_reads_the_whole_source_and_never_calls_the_workers():
    """Ranks other than 0 build the trainer engine too: they read every tensor (an FSDP actor's gathers are
    collectives that rank 0's read must meet) and touch neither the client nor a group."""
    calls = []
    client = SimpleNamespace(**{m: lambda *a, m=m, **k: calls.append(m) for m in ("init_weight_transfer_engine",)})
    info = GlooTrainerInitInfo(host="127.0.0.1", port=1, world_size=2, bucket_bytes=64, timeout_s=5.0, rank=1)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client)
    assert isinstance(engine, GlooTrainerWeightTransferEngine) and not engine.is_sender
    read = []
    tensors = {"a": torch.ones(3), "b": torch.zeros(2, 2)}
    source = TensorSource(
        ((n, read.append(n) or t) for n, t in tensors.items()), TensorSource.of_dict(tensors)._metadata
    )
    engine.send_weights(source)
    assert read == ["a", "b"] and calls == [] and engine.group is None


def models(tiny_model_dir, seeds):
    from transformers import AutoModelForCausalLM

    out = []
    for seed in seeds:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        out.append(model)
    return out


def test_pushes_are_received_while_the_worker_serves_the_last_version_and_loaded_when_applied(tiny_model_dir):
    """The exact schedule's need: versions 1 and 2 are broadcast before the worker applies either (it is still
    generating with version 0); applying 1 then loads version 1's tensors bitwise, and 2 then 2's. Trainer side
    built by vLLM's factory, driven through the workers' `VLLMWeightSyncClient`; the worker's end is the receiver
    that vLLM's engine and the HF engine share (an HF engine here: vLLM's is exercised by the worker runs)."""
    from lit_ppo.rollout.hf_engine import HFEngine

    worker = HFEngine.from_model_dir(tiny_model_dir)
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
    )
    joining = []

    def send(_, command):  # what RolloutWorkers._send queues; the worker process runs it (here: a thread)
        assert isinstance(command, InitWeightTransfer)
        info = {**command.init_info, "rank_offset": 1, "own_host": "127.0.0.1"}
        joining.append(threading.Thread(target=worker.open_weight_transfer, args=(info,)))
        joining[-1].start()

    workers = SimpleNamespace(workers=1, store=store, launch=SimpleNamespace(check_alive=lambda what: None), _send=send)
    client = WorkerSyncClient(workers)
    info = GlooTrainerInitInfo(
        host="127.0.0.1", port=store.port, world_size=2, bucket_bytes=20_000, timeout_s=60.0, rank=0
    )
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=client)
    joining[0].join()
    try:
        one, two = models(tiny_model_dir, seeds=(1, 2))
        pushes = []
        for version, model in ((1, one), (2, two)):
            state = model.state_dict()
            source = TensorSource(state.items(), [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in state.items()])
            trainer.send_weights(source, weight_version=str(version))
            assert source.bytes == sum(t.numel() * t.element_size() for t in state.values())
            pushes.append(list(client.updates))
        assert len(pushes[0]) > 1, "the buckets of 20,000 bytes split the push"
        assert [u["push"] for u in pushes[1]] == [1] * len(pushes[1])
        for version, model, updates in ((1, one, pushes[0]), (2, two, pushes[1])):
            worker.apply_weight_transfer(updates, version)
            assert worker.weight_version == version
            for name, tensor in model.state_dict().items():
                assert torch.equal(worker.model.state_dict()[name], tensor), (version, name)
    finally:
        worker.close_weight_transfer()
        trainer.shutdown()


def test_a_push_whose_tensors_differ_from_what_it_declared_stops_in_one_line():
    declared = [ParamMeta("a", torch.float32, (3,)), ParamMeta("b", torch.float32, (2,))]
    with pytest.raises(
        WeightSyncError, match=r"^trainer: the weight push read a \(float32 \[4\]\) where its metadata "
    ):
        list(TensorSource([("a", torch.ones(4))], declared))
    with pytest.raises(WeightSyncError, match=r"^trainer: the weight push ended before b \(float32 \[2\]\)"):
        list(TensorSource([("a", torch.ones(3))], declared))
    with pytest.raises(WeightSyncError, match=r"read c \(bfloat16 \[1\]\) where its metadata declared no more tensors"):
        list(
            TensorSource(
                [("a", torch.ones(3)), ("b", torch.ones(2)), ("c", torch.ones(1, dtype=torch.bfloat16))], declared
            )
        )
    with pytest.raises(
        WeightSyncError, match=r"read b \(float32 \[2\]\) where its metadata declared a \(float32 \[3\]\)"
    ):
        list(TensorSource([("b", torch.ones(2))], declared))


def test_the_declared_metadata_of_a_model_is_what_its_full_tensors_yield(tiny_model_dir):
    """`full_tensor_metadata` declares, without reading, exactly what `full_tensors` yields, the tied LM head included:
    vLLM's layerwise reload puts back the old tensors of a layer that receives none, so a push that left the tie to
    the engine would serve a stale head (seen: 0.018 nats per token off the trainer at version 1)."""
    from transformers import AutoModelForCausalLM

    from lit_ppo.distributed import full_tensor_metadata, full_tensors

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    source = TensorSource(full_tensors(model), [ParamMeta(*m) for m in full_tensor_metadata(model)])
    assert [n for n, _ in source] == list(model.state_dict()) and "lm_head.weight" in model.state_dict()


def test_a_received_bucket_other_than_the_apply_command_names_stops_the_worker_in_one_line():
    """The broadcast (announced in the store) and the worker's apply command come by different ways: a bucket of
    another version, or of other tensors, is not loaded."""
    from lit_ppo.rollout.weight_transfer.backend import GlooUpdateInfo, StagedReceiver

    receiver = StagedReceiver(store=None, group=None)
    entries = [("w", "float32", [2])]
    receiver.received[(0, 0)] = (GlooUpdateInfo(0, 0, entries, 8, "1"), [("w", torch.zeros(2))])
    with pytest.raises(RuntimeError, match=r"^weight push 0 bucket 0: the received bucket's weight_version differs "):
        receiver.take(GlooUpdateInfo(0, 0, entries, 8, "2"))
    receiver.received[(0, 0)] = (GlooUpdateInfo(0, 0, entries, 8, "1"), [("w", torch.zeros(2))])
    with pytest.raises(
        RuntimeError, match=r"bucket's entries differs .* 1 tensors, 8 bytes; named version 1, 1 tensors"
    ):
        receiver.take(GlooUpdateInfo(0, 0, [("w", "bfloat16", [4])], 8, "1"))
    # the same bucket as JSON gives it (lists, not tuples: a server's /update_weights) is the same bucket
    receiver.received[(0, 0)] = (GlooUpdateInfo(0, 0, [("w", "float32", (2,))], 8, "1"), [("w", torch.zeros(2))])
    assert torch.equal(receiver.take(GlooUpdateInfo(0, 0, [["w", "float32", [2]]], 8, "1"))[0][1], torch.zeros(2))


def test_a_stopped_receiver_raises_instead_of_waiting_forever():
    from lit_ppo.rollout.weight_transfer.backend import GlooUpdateInfo, StagedReceiver

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30)
    )
    receiver = StagedReceiver(store, group=None)
    receiver.start()
    receiver.stop()
    with pytest.raises(RuntimeError, match="failed: the receiver was stopped"):
        receiver.take(GlooUpdateInfo(0, 0, [], 0))


def test_after_a_push_failed_part_way_the_next_one_refuses_and_a_worker_dead_before_the_rendezvous_is_named():
    """A push that raised after announcing buckets leaves the workers' receivers waiting for the rest: the next push
    stops in one line instead of reusing its number. And the trainer's rendezvous watches the workers: one that died
    before joining is named at once, not after the group's timeout."""

    class Announcing:
        def start_weight_update(self):
            pass

        def update_weights(self, info):
            raise ConnectionError("the store is gone")

    engine = GlooTrainerWeightTransferEngine(client=Announcing(), bucket_bytes=64)
    with pytest.raises(ConnectionError):
        engine.send_weights(TensorSource.of_dict({"w": torch.zeros(2)}))
    with pytest.raises(RuntimeError, match="an earlier weight push failed part way"):
        engine.send_weights(TensorSource.of_dict({"w": torch.zeros(2)}))

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
    )

    class DeadWorker:
        def init_weight_transfer_engine(self, info):
            pass  # the worker never joins

        def check_alive(self):
            raise RuntimeError("rollout worker 0 (pid 4242) exited with code 1")

    info = GlooTrainerInitInfo(host="127.0.0.1", port=store.port, world_size=2, bucket_bytes=64, timeout_s=60.0, rank=0)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rollout worker 0 \(pid 4242\) exited with code 1"):
        WeightTransferTrainerFactory.trainer_init(info, client=DeadWorker())
    assert time.monotonic() - started < 10


def test_a_vllm_engine_as_loaded_reports_version_0():
    """vLLM's weight version before any push is "default": a worker that generates before the first push records
    policy version 0 (the model as loaded)."""
    from lit_ppo.rollout.engine import VLLMEngine

    engine = object.__new__(VLLMEngine)
    for committed, version in (("default", 0), ("3", 3)):
        engine.llm = SimpleNamespace(get_weight_version=lambda committed=committed: committed)
        assert engine.weight_version == version


def test_a_taken_store_port_stops_the_workers_client_in_one_line_naming_the_setting(tmp_path):
    """The trainer's store on a port another process holds (rollout.workers.port with launch=external): one line with
    the setting to change, from `host_store` (the servers' client takes any free port)."""
    from lit_ppo.errors import RolloutWorkerError
    from lit_ppo.rollout.weight_transfer.transport import host_store
    from lit_ppo.rollout.workers.client import RolloutWorkers
    from lit_ppo.rollout.workers.client_settings import ClientSettings

    taken = host_store("127.0.0.1", 0, 5.0)
    line = (
        rf"^trainer: cannot host the rollout workers' store on port {taken.port} \(.+\); fix: set rollout.workers.port "
    )
    timeouts = dict(start_timeout_s=5.0, batch_timeout_s=5.0, push_timeout_s=5.0)
    settings = ClientSettings(
        workers=1, devices_per_worker=1, trainer_devices=1, log_dir=tmp_path, bucket_mib=1, host="127.0.0.1", **timeouts
    )
    with pytest.raises(RolloutWorkerError, match=line + "to a free port on this node$") as info:
        RolloutWorkers(engine_kwargs={}, settings=settings, launch="external", port=taken.port)
    assert "\n" not in str(info.value)


def test_a_store_host_that_is_not_this_nodes_is_named_with_its_setting_not_as_a_taken_port():
    """TCPStore's master connects to itself at the host the workers are told: an address of no interface here (TEST-NET
    192.0.2.1) times out, and the line names the host setting, not a port."""
    from lit_ppo.errors import RolloutWorkerError
    from lit_ppo.rollout.weight_transfer.transport import host_store

    line = (
        r"^trainer: cannot host the rollout workers' store on 192\.0\.2\.1:\(any free port\) \(.+\); fix: set "
        r"rollout\.workers\.trainer_host \(or LIT_PPO_ROLLOUT_HOST\) to this node's name or address$"
    )
    with pytest.raises(RolloutWorkerError, match=line):
        host_store("192.0.2.1", 0, 1.0)


def test_the_probe_check_bounds_the_mean_absolute_difference_per_token_for_workers_and_servers():
    """`probe_mismatch` (a worker's check after applying a version, and a server's after a push): the engine's
    log-probs [-1.1, -2.3] against the trainer's [-1.0, -2.0] differ by (0.1 + 0.3) / 2 = 0.2 nats per token."""
    from lit_ppo.rollout.weight_transfer.transport import probe_mismatch

    probe = ([7, 8], [9, 10], [-1.0, -2.0])
    asked = []

    def engine(prompt, response):
        asked.append((prompt, response))
        return [-1.1, -2.3]

    where = "rollout worker 0: after applying policy version 3"
    assert probe_mismatch(probe, 0.21, engine, where) is None and asked == [([7, 8], [9, 10])]
    assert probe_mismatch(probe, 0.19, engine, where) == (
        "rollout worker 0: after applying policy version 3 its log-probs of a probe sequence differ from the "
        "trainer's by 0.200 nats per token (more than rollout.max_logprob_abs_diff=0.19): the pushed weights did "
        "not arrive intact"
    )
    assert "by nan nats" in probe_mismatch(probe, 0.5, lambda p, r: [float("nan"), -2.0], where)
    assert probe_mismatch(None, 0.5, engine, where) is None and probe_mismatch(probe, None, engine, where) is None
    assert len(asked) == 2  # no probe, or no bound: the engine is not asked
    short = probe_mismatch(probe, 0.5, lambda p, r: [-1.0], where)  # one log-prob for two tokens: zip would hide it
    assert short.endswith(
        "it returned 1 log-probs for a probe response of 2 tokens: the engine does not score the "
        "sequence the trainer sent"
    )


NO_VLLM = (
    "import sys\nfor name in ('vllm', 'flash_attn'):\n    sys.modules[name] = None  # import fails, find_spec: None\n"
)


def test_the_interface_written_for_machines_without_vllm_has_vllms_names_fields_and_calls():
    """weight_transfer/interface.py stands in for vLLM's interface where vLLM is not installed: the same dataclass
    fields, the trainer engine's keywords and the factories' calls that weight_transfer/backend.py uses."""
    import dataclasses
    import inspect

    from vllm.distributed.weight_transfer import base

    from lit_ppo.rollout.weight_transfer import interface as ours

    for name in ("ParamMeta", "TrainerInitInfo", "WeightTransferInitInfo", "WeightTransferUpdateInfo"):
        assert [f.name for f in dataclasses.fields(getattr(ours, name))] == [
            f.name for f in dataclasses.fields(getattr(base, name))
        ], name
    assert ours.TrainerInitInfo(rank=0).is_sender and not ours.TrainerInitInfo(rank=1).is_sender
    ours_init = inspect.signature(ours.TrainerWeightTransferEngine.__init__).parameters
    assert list(ours_init) == list(inspect.signature(base.TrainerWeightTransferEngine.__init__).parameters)
    for name in ("WeightTransferEngineFactory", "WeightTransferTrainerFactory"):
        assert hasattr(getattr(ours, name), "register_engine")
    assert list(inspect.signature(ours.WeightTransferTrainerFactory.trainer_init).parameters) == list(
        inspect.signature(WeightTransferTrainerFactory.trainer_init).parameters
    )


def test_hf_engine_rollout_workers_train_on_a_machine_without_vllm(tmp_path):
    """rollout.engine=hf workers need no vLLM (a GPU image without it): with vLLM unimportable the push's interface is
    weight_transfer/interface.py's, and a disaggregated run pushes its weights to its worker and trains (devices=0: on a
    CPU the worker is its own process, as with 1)."""
    import subprocess
    import sys

    from tests.helpers import ROOT, rollout_step_rows
    from tests.helpers.cli_runs import train_cli

    blocker = tmp_path / "no_vllm"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(NO_VLLM)
    which = subprocess.run(
        [sys.executable, "-c", "import lit_ppo.rollout.weight_transfer.backend as w; print(w.ParamMeta.__module__)"],
        env={"PYTHONPATH": f"{blocker}:{ROOT}", "PATH": ""},
        capture_output=True,
        text=True,
        check=True,
    )
    assert which.stdout.strip() == "lit_ppo.rollout.weight_transfer.interface"
    out = train_cli(
        tmp_path / "run",
        tmp_path / "cache",
        "rollout.engine=hf",
        "rollout.mode=disaggregated",
        "rollout.workers.devices=0",
        "strategy.accelerator=cpu",
        "ppo.ppo_epochs=1",
        pythonpath=(str(blocker),),
    )
    rows = rollout_step_rows(out / "metrics.csv")
    assert len(rows) == 2
    assert all(float(r["perf/weight_sync_bytes"]) > 0 for r in rows)
    assert "rollout worker 0: policy version 2 applied" in (out / "logs" / "rollout_worker0.log").read_text()


def test_the_push_announcer_refuses_a_push_out_of_order_or_of_no_tensors_and_numbers_pushes_in_order():
    """Workers' and servers' clients announce through one `PushAnnouncer`: the receivers wait for push 0, 1, ... in
    order, so a bucket of another push, or a push that ends with no bucket, is refused instead of waited on."""
    import pickle

    from lit_ppo.rollout.weight_transfer.transport import PushAnnouncer, push_done_key, update_info_key

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    announcer = PushAnnouncer(store)
    with pytest.raises(ValueError, match="^weight push 0 of no tensors$"):
        announcer.end()
    info = {"push": 0, "bucket": 0, "entries": [], "nbytes": 0, "weight_version": "1"}
    announcer.bucket(info)
    announcer.end()
    assert pickle.loads(store.get(update_info_key(0, 0))) == info and store.get(push_done_key(0)) == b"1"
    with pytest.raises(RuntimeError, match="^weight push 0 announced where push 1 was due$"):
        announcer.bucket(info)
    announcer.bucket({**info, "push": 1})
    announcer.end()
    assert store.check([push_done_key(1)])
