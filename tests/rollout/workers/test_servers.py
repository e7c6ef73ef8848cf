"""vLLM servers as rollout workers (rollout.workers.launch=server, lit_ppo/rollout/workers/servers.py, docs/async.md):
what the route refuses, what the plan says, and real runs against real `vllm serve` processes, spawned by the trainer
or started by the test (a URL given), whose samples are the spawned rollout workers' and of the planned versions."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from lit_ppo.config import DynamicSamplingConfig
from lit_ppo.contract import GenerateRequest, WeightUpdate
from lit_ppo.errors import ConfigError, RolloutWorkerError
from lit_ppo.plan import compute_plan
from lit_ppo.rollout.workers.client_settings import ClientSettings
from lit_ppo.rollout.workers.server_http import HTTPFailure, Server
from lit_ppo.rollout.workers.server_push import ServerPush
from lit_ppo.rollout.workers.server_settings import server_arguments
from lit_ppo.rollout.workers.server_spawn import plugin_path, server_environment
from lit_ppo.rollout.workers.servers import ServerWorkers
from tests.helpers import ROOT, compose_run_config, free_port
from tests.helpers.asynchronous import (
    TIS,
    SignalWorker,
    disaggregated,
    even_answers_are_uniform,
    fit_then_close,
    patch_child_processes,
    workers_run,
)
from tests.helpers.servers import BY_HAND, model_folder

SERVER = ("rollout.mode=disaggregated", "rollout.workers.launch=server")


# ---------------------------------------------------------------- settings and the plan


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["model.lora.rank=8"],
            r"^rollout.workers.launch=server \(vLLM servers as rollout workers\) with model.lora: a server loads a LoRA "
            r"adapter only from a folder .*; fix: rollout.workers.launch=spawn, or model.lora.rank=0$",
        ),
        (["rollout.engine=hf"], r"with rollout.engine=hf: the servers are vLLM's; fix: rollout.workers.launch=spawn"),
        (
            ["+rollout.episodes.environment._target_=lit_ppo.environments.CalculatorEnvironment"],
            r"with multi-turn episodes \(rollout.episodes.environment\): .*fix: rollout.workers.launch=spawn",
        ),
        (
            ["rollout.tensor_parallel_size=2"],
            r"with rollout.tensor_parallel_size=2: .*fix: rollout.workers.launch=spawn, or rollout.tensor_parallel_size=1",
        ),
        (["strategy.devices=2"], r"with 2 trainer ranks: .*fix: rollout.workers.launch=spawn, or one trainer device$"),
        (
            ["rollout.workers.server_urls=[node1:8000]"],
            r"^rollout.workers.server_urls: 'node1:8000' is not a server's URL; fix: e.g. http://node1:8000$",
        ),
        (
            ["rollout.workers.server_urls=[http://a:8000,http://b:8000]"],
            r"^rollout.workers.count=1 with 2 rollout.workers.server_urls: .*fix: rollout.workers.count=2$",
        ),
        (
            ["rollout.workers.server_urls=[http://127.0.0.1:8000,http://127.0.0.1:8000]", "rollout.workers.count=2"],
            r"^rollout.workers.server_urls lists http://127.0.0.1:8000 twice: .*fix: list each server once$",
        ),
        (
            ["rollout.workers.server_urls=[http://node1:8000]"],
            r"^rollout.workers.server_urls has http://node1:8000, on another node, but the trainer's address it would "
            r"be told is 127.0.0.1; fix: rollout.workers.trainer_host=<this node's name or address>$",
        ),
    ],
)
def test_what_servers_cannot_do_is_refused_in_one_line_before_any_model_loads(overrides, match):
    with pytest.raises(ConfigError, match=match) as info:
        compute_plan(compose_run_config(*SERVER, *overrides), 1000)
    assert "\n" not in str(info.value)


def test_remote_servers_are_planned_when_the_trainer_has_an_address_they_reach_and_urls_need_the_mode():
    plan = compute_plan(
        compose_run_config(
            *SERVER, "rollout.workers.server_urls=[http://node1:8000]", "rollout.workers.trainer_host=node0"
        ),
        1000,
    )
    assert plan.workers is not None
    with pytest.raises(ConfigError, match=r"with rollout.mode=colocated: .* no rollout worker would use them; fix: "):
        compute_plan(
            compose_run_config("rollout.workers.launch=server", "rollout.workers.server_urls=[http://127.0.0.1:8000]"),
            1000,
        )


def test_server_urls_without_launch_server_are_refused():
    with pytest.raises(ConfigError, match=r"only vLLM servers are given by URL; fix: rollout.workers.launch=server"):
        compute_plan(
            compose_run_config("rollout.mode=disaggregated", "rollout.workers.server_urls=[http://a:8000]"), 1000
        )


def test_the_plan_names_the_servers_and_the_push_that_waits_for_the_steps_in_flight():
    spawned = compute_plan(compose_run_config(*SERVER, "rollout.workers.count=2"), 2000)
    assert (spawned.workers.launch, spawned.workers.count, spawned.workers.server_urls) == ("server", 2, ())
    table = spawned.table()
    assert "vLLM servers (vllm serve), driven over HTTP" in table
    assert "the trainer spawns them on free ports of its node" in table
    assert "each push waits until every request sent before it (the steps in flight) has finished" in table
    given = compute_plan(
        compose_run_config(
            *SERVER,
            "rollout.workers.count=2",
            "rollout.workers.server_urls=[http://node1:8000,http://node2:8000]",
            "rollout.workers.trainer_host=node0",  # the servers on other nodes reach the trainer there
        ),
        2000,
    )
    assert given.workers.server_urls == ("http://node1:8000", "http://node2:8000")
    assert "given: http://node1:8000, http://node2:8000" in given.table()
    assert json.loads(json.dumps(given.to_dict()))["workers"]["server_urls"] == [
        "http://node1:8000",
        "http://node2:8000",
    ]


def given_server_workers(url: str, log_dir: Path, **settings) -> ServerWorkers:
    """The trainer's client of one server given by `url` (started outside the run), with the tests' timeouts;
    `settings`: ServerWorkers' keywords over them."""
    return one_server_workers([url], log_dir, **settings)


def one_server_workers(server_urls: list[str], log_dir: Path, **settings) -> ServerWorkers:
    """The trainer's client of one server (spawned by it where `server_urls` is empty), with the tests' timeouts;
    `settings`: ServerWorkers' keywords over them."""
    engine_kwargs = settings.pop("engine_kwargs", {})
    timeouts = {"start_timeout_s": 60.0, "batch_timeout_s": 300.0, "push_timeout_s": 60.0, **settings}
    client = ClientSettings(
        workers=1, devices_per_worker=1, trainer_devices=1, log_dir=log_dir, bucket_mib=1, **timeouts
    )
    return ServerWorkers(engine_kwargs=engine_kwargs, server_urls=server_urls, settings=client)


def test_a_server_url_where_nothing_answers_fails_the_start_in_one_line_naming_it(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RolloutWorkerError) as info:
        given_server_workers(url, tmp_path, start_timeout_s=2.0, batch_timeout_s=10.0, push_timeout_s=10.0)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"trainer: vLLM server 0 at {url} (given by rollout.workers.server_urls")
    assert "did not answer /health within rollout.workers.start_timeout_s=2 s" in message


# ---------------------------------------------------------------- real servers


def run(
    tiny_model_dir, files, out: Path, rollout, steps: int, callbacks=(), resume_from: Path | None = None, **overrides
):
    """A run with rollout workers of `rollout`'s launch (resumed from the checkpoint `resume_from`, if any); returns the
    batches it trained, the workers' client, the plan and the module. `overrides`: build_run's keywords (the PPO
    settings, the reward) over the tests' own."""
    trainer, module, datamodule, plan = workers_run(
        tiny_model_dir, files, out, rollout, steps, callbacks=callbacks, **{**TIS, **overrides}
    )
    fit_then_close(trainer, module, datamodule, resume_from=resume_from)
    return type(datamodule).batches, datamodule.engine, plan, module


SERVER_LOGPROB_ATOL = 1e-5
"""How far a server's sampled log-probs may be from another engine's for the same tokens: a server gets one HTTP request
per prompt, so which requests share a decode step depends on when each arrived, and vLLM's CPU kernels are not
batch-invariant in the last bit (1 ulp, 4.8e-7 at |log p| ~ 5, seen on one token of 96 at k = 1 in
make test-slow of 2026-11-29). The tokens, versions and rewards are compared exactly."""


def assert_same_samples(ours, theirs) -> None:
    assert [b.rollout_step for b in ours] == [b.rollout_step for b in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert a.prompt_ids == b.prompt_ids and a.response_ids == b.response_ids
        assert a.policy_versions == b.policy_versions
        assert [len(x) for x in a.rollout_logprobs] == [len(x) for x in b.rollout_logprobs]
        ours_logprobs = torch.tensor([x for row in a.rollout_logprobs for x in row], dtype=torch.float64)
        theirs_logprobs = torch.tensor([x for row in b.rollout_logprobs for x in row], dtype=torch.float64)
        torch.testing.assert_close(ours_logprobs, theirs_logprobs, rtol=0.0, atol=SERVER_LOGPROB_ATOL)
        assert torch.equal(a.rewards, b.rewards)


@pytest.fixture(scope="module")
def spawned_workers(tiny_model_dir, long_prompt_files, tmp_path_factory):  # noqa: F811
    """The reference: runs with spawned rollout workers (launch=spawn) at k = 0 (2 steps) and k = 1 (3 steps)."""
    out = tmp_path_factory.mktemp("spawned_workers")
    return {
        0: run(tiny_model_dir, long_prompt_files, out / "k0", disaggregated(0), steps=2)[0],
        1: run(tiny_model_dir, long_prompt_files, out / "k1", disaggregated(1), steps=3)[0],
    }


@pytest.mark.slow
def test_a_spawned_server_at_k0_generates_the_spawned_workers_samples(
    spawned_workers,
    tiny_model_dir,
    long_prompt_files,  # noqa: F811
    tmp_path,
):
    """launch=server with no URL: the trainer spawns a vLLM server (plugin from a dist-info on its PYTHONPATH where the
    installed lit-ppo lacks the entry point), and at k = 0 the run's samples (token ids, log-probs, versions, rewards)
    are exactly those of the run with spawned rollout workers: per-request seeds over HTTP sample as the in-process
    engine does, and the push of version 1 arrives intact. close stops the server."""
    batches, servers, _, _ = run(
        tiny_model_dir, long_prompt_files, tmp_path, disaggregated(0, launch="server"), steps=2
    )
    assert [sorted(set(b.policy_versions)) for b in batches] == [[0], [1]]
    assert_same_samples(batches, spawned_workers[0])
    log = (tmp_path / "logs" / "rollout_server0.log").read_text()
    # vLLM's own INFO lines are off (the trainer sets VLLM_LOGGING_LEVEL=WARNING, which the server inherits): the
    # server was started with lit_ppo_gloo and built it (vLLM answers an unknown backend with an error, not 200)
    assert """--weight-transfer-config '{"backend": "lit_ppo_gloo"}'""" in log.splitlines()[0]
    assert '"POST /init_weight_transfer_engine HTTP/1.1" 200 OK' in log
    assert servers.exit_codes == [0], log[-3000:]
    assert all(server.process.poll() is not None for server in servers.servers)


def dynamic_sampling_run(tiny_model_dir, files, out: Path, rollout, steps: int = 3):
    """`steps` rollout steps of dynamic sampling: every group expected to differ, so 1 round is requested ahead and
    the rounds the dropped groups (those of even answers) call for are refill rounds, requested after the step's
    rewards from the step's own version."""
    return run(
        tiny_model_dir,
        files,
        out,
        rollout,
        steps,
        reward_fn=even_answers_are_uniform,
        advantage_estimator="grpo",
        kl_coef=0.0,
        kl_mode="loss",
        dynamic_sampling=DynamicSamplingConfig(
            enabled=True, max_generation_rounds=3, expected_informative_fraction=1.0
        ),
    )


@pytest.mark.slow  # a spawned worker's run and a spawned server's, 3 steps each
def test_dynamic_sampling_with_a_spawned_server_at_k0_generates_the_spawned_workers_samples(
    tiny_model_dir, arithmetic_files, tmp_path
):
    """Dynamic sampling's refill rounds go to a server as to spawned workers: a round is sent once the step's rewards
    call for it, after the push of the step's version, and a push waits for it. At k = 0 every round (requested ahead
    or refilled) has the spawned workers' prompts, token ids, log-probs, versions and rewards, and the steps the same
    rounds and dropped and filled groups."""
    workers, _, plan, _ = dynamic_sampling_run(tiny_model_dir, arithmetic_files, tmp_path / "spawn", disaggregated(0))
    servers, _, _, _ = dynamic_sampling_run(
        tiny_model_dir, arithmetic_files, tmp_path / "server", disaggregated(0, launch="server")
    )
    assert plan.dynamic_sampling.rounds_requested_ahead == 1
    assert_same_samples(servers, workers)
    rounds = lambda batches: [  # noqa: E731
        (b.generation_rounds, b.rounds_in_step, b.dropped_groups, b.filled_groups, b.dataset_indices) for b in batches
    ]
    assert rounds(servers) == rounds(workers)
    assert max(b.generation_rounds for b in servers) > 1  # refill rounds were sent to the server
    assert [set(b.policy_versions) for b in servers] == [{s} for s in range(3)]


def checkpointed_k1_run(tiny_model_dir, files, out: Path, steps: int, resume_from: Path | None = None):
    """Dynamic sampling at k = 1 on a spawned server, checkpointed after every step: rounds of 16 prompts for 8,
    0.3 of the groups expected to differ, so 2 rounds are requested ahead of each step and its second is given back
    to the prompt stream where the first sufficed; `resume_from`: a checkpoint. Returns the module and the batches."""
    from lit_ppo.checkpoints import RolloutCheckpoint

    batches, _, plan, module = run(
        tiny_model_dir,
        files,
        out,
        disaggregated(1, launch="server"),
        steps,
        callbacks=[RolloutCheckpoint(out / "checkpoints", every=1, keep=10)],
        resume_from=resume_from,
        train_batch_size=8,  # build_run's own (4 optimizer steps per rollout step), not run's
        micro_train_batch_size=4,
        reward_fn=even_answers_are_uniform,
        advantage_estimator="grpo",
        kl_coef=0.0,
        kl_mode="loss",
        dynamic_sampling=DynamicSamplingConfig(
            enabled=True, max_generation_rounds=3, expected_informative_fraction=0.3, prompts_per_round=16
        ),
    )
    return module, batches, plan


@pytest.mark.slow  # two runs on a spawned server
def test_dynamic_sampling_on_a_server_at_k1_resumes_from_a_checkpoint_exactly(
    tiny_model_dir, arithmetic_files, tmp_path
):
    """A checkpoint of a k = 1 run on a server keeps the step generated ahead (both its rounds, of version s - 1) and
    the prompt stream (rounds given back included): resumed on a new server from the checkpoint after step 2, the run
    trains steps 2 and 3 on the same samples, versions and rounds, and ends with bitwise the same weights."""
    from lit_ppo.checkpoints import checkpoint_path
    from tests.helpers.resume import assert_same_weights

    full, batches, plan = checkpointed_k1_run(tiny_model_dir, arithmetic_files, tmp_path / "full", steps=4)
    ahead = plan.dynamic_sampling.rounds_requested_ahead
    assert ahead == 2 and min(b.generation_rounds for b in batches) < ahead  # a round was given back
    for step, batch in enumerate(batches):
        assert batch.policy_versions == [plan.generating_version(step, r) for r in batch.rounds_in_step]
    kept = checkpoint_path(tmp_path / "full" / "checkpoints", 2)
    resumed, again, _ = checkpointed_k1_run(
        tiny_model_dir, arithmetic_files, tmp_path / "resumed", steps=4, resume_from=kept
    )
    assert [b.rollout_step for b in again] == [2, 3]
    assert_same_samples(again, batches[2:])
    rounds = lambda bs: [(b.generation_rounds, b.rounds_in_step, b.prompts_consumed, b.data_epoch) for b in bs]  # noqa: E731
    assert rounds(again) == rounds(batches[2:])
    assert_same_weights(resumed.actor.state_dict(), full.actor.state_dict())


@pytest.mark.slow
def test_a_killed_server_stops_the_run_in_one_line_naming_it_and_its_log(tiny_model_dir, long_prompt_files, tmp_path):  # noqa: F811
    kill = SignalWorker(signal.SIGKILL, group=True)  # a spawned server's process group
    with pytest.raises(RolloutWorkerError) as info:
        run(tiny_model_dir, long_prompt_files, tmp_path, disaggregated(1, launch="server"), steps=3, callbacks=[kill])
    message = str(info.value)
    assert "\n" not in message
    log_file = tmp_path / "logs" / "rollout_server0.log"
    assert message.startswith("trainer: vLLM server 0 at http://127.0.0.1:"), message
    assert f"(pid {kill.pid}; see {log_file}) exited with code -9 while the trainer waited for" in message


def start_server(model_dir: str, log_file: Path, dtype: str | None = "float32") -> tuple[subprocess.Popen, str]:
    """A vLLM server started outside the trainer, as docs/async.md tells a user to (lit-ppo's plugin from a dist-info on
    its PYTHONPATH, as an environment with lit-ppo installed gets it from its entry point); `dtype` None: started
    without --dtype (vLLM's auto)."""
    port = free_port()
    settings = {**BY_HAND, "model_dir": model_dir, "dtype": dtype}
    env = server_environment(kv_cache_gib=1)
    env["PYTHONPATH"] = os.pathsep.join([str(plugin_path(log_file.parent / "plugin")), str(ROOT)])
    arguments = server_arguments(settings, port)
    if dtype is None:
        at = arguments.index("--dtype")
        del arguments[at : at + 2]
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *arguments]
    with open(log_file, "wb") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    # As docs/async.md tells a user: the trainer is started once the server answers /health (a given URL that refuses
    # connections for servers.REFUSED_GRACE_S stops the start, and `vllm serve` opens its port once its model is loaded).
    deadline = time.monotonic() + 300
    while not Server(0, url).healthy():
        assert process.poll() is None and time.monotonic() < deadline, log_file.read_text()[-3000:]
        time.sleep(1.0)
    return process, url


@pytest.fixture(scope="module")
def given_server(tiny_model_dir, tmp_path_factory):
    """A vLLM server started by the test, outside any trainer (its URL is given to the runs); stopped at the end."""
    process, url = start_server(tiny_model_dir, tmp_path_factory.mktemp("given_server") / "server.log")
    yield process, url
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(60)


@pytest.mark.slow
def test_a_server_given_by_url_at_k1_samples_with_the_planned_versions_and_is_left_running(
    spawned_workers,
    given_server,
    tiny_model_dir,
    long_prompt_files,  # noqa: F811
    tmp_path,
):
    """launch=server with rollout.workers.server_urls: a server the test started. At k = 1 every sample is of the
    planned version (max(0, s - 1): the run's check_policy_versions passes, and the versions are the server's own
    weight versions), and the samples equal the spawned workers' at k = 1. The trainer leaves the server running."""
    process, url = given_server
    rollout = disaggregated(1, launch="server", server_urls=[url])
    batches, servers, plan, _ = run(tiny_model_dir, long_prompt_files, tmp_path, rollout, steps=3)
    assert plan.workers.server_urls == (url,)
    assert [sorted(set(b.policy_versions)) for b in batches] == [[0], [0], [1]]
    assert all(len(b.policy_versions) == 32 for b in batches)
    assert_same_samples(batches, spawned_workers[1])
    assert servers.procs == [] and process.poll() is None
    with urllib.request.urlopen(url + "/health", timeout=10) as response:
        assert response.status == 200
    assert not (tmp_path / "logs" / "rollout_server0.log").exists()


def update_of(model, version: int, probe_ids: list[int], prompt_tokens: int) -> WeightUpdate:
    """`model`'s state_dict as policy `version`, with the trainer's probe: its log-probs of probe_ids' response."""
    state = model.state_dict()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([probe_ids])).logits[0].float(), dim=-1)
    expected = [logprobs[j - 1, probe_ids[j]].item() for j in range(prompt_tokens, len(probe_ids))]
    return WeightUpdate(
        version,
        tensors=list(state.items()),
        metadata=[(name, t.dtype, tuple(t.shape)) for name, t in state.items()],
        probe=lambda: (probe_ids[:prompt_tokens], probe_ids[prompt_tokens:], expected),
    )


@pytest.mark.slow
def test_a_push_waits_for_the_requests_sent_before_it_which_keep_their_version(given_server, tiny_model_dir, tmp_path):
    """A server applies a push as it receives it, so `update_weights` first waits for the requests in flight: a batch
    sent under version 0 and still generating when version 1 is pushed comes back all of version 0, and equal to the
    same request generated again under version 0's weights (pushed as version 2); under version 1 it differs. A second
    client of the same server (this test after the run above) joins a weight-transfer group of its own. A push whose
    weights are not the trainer's of that version (its probe's log-probs differ) stops in one line naming the server."""
    from transformers import AutoModelForCausalLM

    _, url = given_server
    policy_a = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    policy_b = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for param in policy_b.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    workers = given_server_workers(url, tmp_path, max_logprob_abs_diff=1e-4)
    prompts = [[5 + i] * 10 for i in range(8)]
    request = dict(n=4, temperature=1.0, top_p=1.0, max_tokens=100, seeds=[100 + 4 * i for i in range(8)])
    probe = prompts[0] + list(range(20, 30))
    try:
        workers.update_weights(update_of(policy_a, 0, probe, 10))
        to_b = update_of(policy_b, 1, probe, 10)  # built first: the push follows the submit at once
        in_flight = workers.submit(GenerateRequest(prompts, **request))
        workers.update_weights(to_b)
        waited_s = workers.last_push_wait_s
        before, versions_before, _ = workers.collect(in_flight)
        under_b, versions_b, _ = workers.collect(workers.submit(GenerateRequest(prompts, **request)))
        workers.update_weights(update_of(policy_a, 2, probe, 10))
        again, versions_again, _ = workers.collect(workers.submit(GenerateRequest(prompts, **request)))
        # weights that are not the trainer's of that version (A's, where the trainer's probe is B's): one line
        wrong = dataclasses.replace(update_of(policy_a, 3, probe, 10), probe=update_of(policy_b, 3, probe, 10).probe)
        with pytest.raises(RolloutWorkerError) as info:
            workers.update_weights(wrong)
    finally:
        workers.close()
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"trainer: vLLM server 0 at {url} (given by")
    assert "after the push of policy version 3 its log-probs of a probe sequence differ from the trainer's" in message
    assert (versions_before, versions_b, versions_again) == ([0] * 32, [1] * 32, [2] * 32)
    assert sum(len(g.token_ids) for g in before) > 1000  # up to 3,200 tokens: still generating when the push came
    assert waited_s > 0.05
    assert [g.token_ids for g in before] == [g.token_ids for g in again]
    assert [g.token_ids for g in before] != [g.token_ids for g in under_b]


def requests_on(url: str) -> float:
    """The requests a server is generating or holding (its /metrics: running + waiting, n samples counted n times)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    names = ("vllm:num_requests_running{", "vllm:num_requests_waiting{")
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(names))


def generate_as_another_client(url: str, n: int, max_tokens: int) -> list[dict]:
    """Another client's request to the same server (its own id): n samples of exactly max_tokens tokens."""
    sampling = dict(n=n, temperature=1.0, max_tokens=max_tokens, seed=7, ignore_eos=True)
    body = dict(model="policy", token_ids=[9] * 10, sampling_params=sampling, request_id="another-client-0")
    body.update(output_mode="text", return_token_ids=True)
    request = urllib.request.Request(
        url + "/inference/v1/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())["choices"]


@pytest.mark.slow
def test_close_aborts_the_runs_requests_on_a_given_server_and_not_another_clients(given_server, tmp_path):
    """A given server is left running at `close`, but not generating the run's requests for nobody (a failed run's,
    or the steps requested ahead at the end): `close` aborts them by their ids. 128 prompts x 32 samples of up to 110
    tokens (seconds of generation on CPU) are in flight when `close` is called, and another client's request is queued
    behind them on the same server. The run's requests are answered at once, aborted (vLLM's finish reason "abort")
    where they had not finished, and the server then holds only the other client's request, which completes: 64
    samples of its 110 tokens each."""
    from concurrent.futures import ThreadPoolExecutor

    _, url = given_server
    workers = given_server_workers(url, tmp_path)
    prompts = [[5 + i % 20] * 10 for i in range(128)]
    request = dict(n=32, temperature=1.0, top_p=1.0, max_tokens=110, seeds=list(range(128)))
    other_client = ThreadPoolExecutor(1)
    try:
        ticket = workers.submit(GenerateRequest(prompts, **request))
        deadline = time.monotonic() + 60.0
        while requests_on(url) < 1000 and time.monotonic() < deadline:  # the run's requests reached the engine
            time.sleep(0.05)
        other = other_client.submit(generate_as_another_client, url, 64, 110)
        time.sleep(0.5)  # the other client's request reaches the server, behind the run's
        assert not other.done() and not all(future.done() for _, future in ticket.prompts)
    finally:
        started = time.monotonic()
        workers.close()
        close_s = time.monotonic() - started
    answers = [future.result(timeout=30.0)[0] for _, future in ticket.prompts]
    answered_s = time.monotonic() - started
    left_on_server = requests_on(url)
    theirs = other.result(timeout=300.0)
    other_client.shutdown()
    reasons = [choice["finish_reason"] for choices in answers for choice in choices]
    aborted = sum(reason == "abort" for reason in reasons)
    assert aborted > 1000, (aborted, len(reasons))  # of 4,096 samples: most had not finished when close came
    assert set(reasons) <= {"abort", "stop", "length"}
    assert close_s < 10.0 and answered_s < 10.0, (close_s, answered_s)
    assert left_on_server <= 64, left_on_server  # the other client's samples at most
    assert [(c["finish_reason"], len(c["token_ids"])) for c in theirs] == [("length", 110)] * 64


def test_aborting_the_runs_requests_at_close_is_bounded_and_never_raises(caplog):
    """`close` runs after the run's own error: aborting on a given server where nothing answers (refused) or that
    never answers (a socket that accepts and is silent) returns within its timeout with one warning naming the server,
    and raises nothing; after a failure of the run (the refused one here) the warning goes to run.log only, the run's
    own line names the server after `close`. A spawned server's requests are not aborted (the server is stopped)."""
    import socket
    from concurrent.futures import Future

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    for url, failed in (
        (f"http://127.0.0.1:{free_port()}", True),
        (f"http://127.0.0.1:{silent.getsockname()[1]}", False),
    ):
        workers = object.__new__(ServerWorkers)  # the trainer's side alone: no server started
        workers.failed = failed
        spawned = Server(1, "http://127.0.0.1:1", process=subprocess.Popen([sys.executable, "-c", "pass"]))
        spawned.process.wait(timeout=30)
        workers.in_flight = set()
        for server, request_id in ((Server(0, url), "lit-ppo-run-submit0-prompt0"), (spawned, "not-aborted")):
            future = Future()  # never answered
            future.server, future.request_id = server, request_id
            workers.in_flight.add(future)
        caplog.clear()
        started = time.monotonic()
        workers.abort_in_flight(timeout_s=1.0)
        seconds = time.monotonic() - started
        assert seconds < 3.0, seconds
        records = [r for r in caplog.records if r.levelname == "WARNING"]
        warnings = [r.getMessage() for r in records]
        assert len(warnings) == 1, warnings
        assert warnings[0].startswith(
            f"trainer: vLLM server 0 at {url} (given by rollout.workers.server_urls; its log is its own): aborting the "
            "run's 1 requests failed: POST /inference/v1/abort_requests "
        ), warnings
        assert getattr(records[0], "console", True) is (not failed)
    silent.close()


def test_a_server_started_by_hand_without_a_rollout_workers_settings_is_refused_naming_the_flag():
    """Its log-probs would silently be of the raw logits, or the push would reach no engine: the trainer reads the
    given server's /server_info and names the flag it lacks."""
    right = {
        "vllm_config": {
            "model_config": {"logprobs_mode": "processed_logprobs", "max_model_len": 256, "generation_config": "vllm"},
            "weight_transfer_config": {"backend": "lit_ppo_gloo"},
            "parallel_config": {"tensor_parallel_size": 1},
        }
    }
    wrongs = [
        (("model_config", "logprobs_mode", "raw_logprobs"), "--logprobs-mode processed_logprobs"),
        (("weight_transfer_config", "backend", "nccl"), "--weight-transfer-config"),
        (("parallel_config", "tensor_parallel_size", 2), "--tensor-parallel-size 1"),
        (("model_config", "max_model_len", 64), "--max-model-len 128"),
    ]
    for (section, key, value), flag in [((None, None, None), None)] + wrongs:
        config = copy.deepcopy(right)
        if section is not None:
            config["vllm_config"][section][key] = value

        class Given(Server):
            def call(self, method, path, body=None, timeout_s=60.0):
                assert path == "/server_info?config_format=json"
                return config

        workers = object.__new__(ServerWorkers)
        workers.failed = False
        server = Given(0, "http://127.0.0.1:8000")
        if flag is None:
            workers._check_settings(server, {"max_model_len": 128})
            continue
        with pytest.raises(RolloutWorkerError) as info:
            workers._check_settings(server, {"max_model_len": 128})
        message = str(info.value)
        assert message.startswith("trainer: vLLM server 0 at http://127.0.0.1:8000 (given by") and flag in message
        assert "\n" not in message and workers.failed


def spawned_server_workers(tiny_model_dir: str, log_dir: Path, push_timeout_s: float) -> ServerWorkers:
    """One vLLM server spawned by `ServerWorkers` (the trainer's client, without a run), as a run with
    rollout.workers.launch=server starts it."""
    settings = {**BY_HAND, "model_dir": tiny_model_dir, "kv_cache_gib": 1}
    timeouts = dict(start_timeout_s=300.0, batch_timeout_s=120.0, push_timeout_s=push_timeout_s)
    return one_server_workers([], log_dir, engine_kwargs=settings, max_logprob_abs_diff=1e-4, **timeouts)


@pytest.mark.slow  # a spawned server's start
@pytest.mark.parametrize("failure", ["killed", "refused"])
def test_a_push_that_fails_part_way_stops_at_once_in_one_line_naming_the_server_and_the_cause(
    failure, tiny_model_dir, tmp_path
):
    """The push of version 1 fails after it started (/start_weight_update answered) on a real spawned server:
    killed: the server is SIGKILLed (its process group: the API server and its engine core) before the bucket is
    announced, so the bucket's broadcast and its /update_weights fail, and the push settles on the better message,
    the server's exit; refused: the bucket's /update_weights names another version than the trainer announced in its
    store, so the server's receiver refuses to load it and answers with the reason. Either way one line naming the
    server and the cause, long before rollout.workers.weight_push_timeout_s."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    probe = [5] * 10 + list(range(20, 30))
    workers = spawned_server_workers(tiny_model_dir, tmp_path, push_timeout_s=120.0)
    try:
        workers.update_weights(update_of(policy, 0, probe, 10))
        pid, client = workers.procs[0].pid, workers.push.sync_client
        announce, send = client.update_weights, client._send

        killed = []

        def kill_then_announce(update_info: dict) -> None:  # before the first bucket only
            if not killed:
                os.killpg(pid, signal.SIGKILL)
                killed.append(update_info["bucket"])
            announce(update_info)

        def another_version(server, sender, path, body, what) -> None:
            if path == "/update_weights":
                body = {"update_info": {**body["update_info"], "weight_version": "7"}}
            send(server, sender, path, body, what)

        if failure == "killed":
            client.update_weights = kill_then_announce
        else:
            client._send = another_version
        started = time.monotonic()
        with pytest.raises(RolloutWorkerError) as info:
            workers.update_weights(update_of(policy, 1, probe, 10))
        seconds = time.monotonic() - started
    finally:
        workers.close()
    message = str(info.value)
    server = f"trainer: vLLM server 0 at {workers.servers[0].url} (pid {pid}; see {tmp_path / 'rollout_server0.log'})"
    assert "\n" not in message and workers.failed
    if failure == "killed":
        # The exit is seen in the broadcast's settle or, where the first bucket fit the socket's buffer, at the
        # push's end: the same line either way.
        assert message.startswith(f"{server} exited with code -9 while the trainer waited for the weight push"), message
        assert workers.exit_codes == [-9] and killed == [0]
    else:
        assert message.startswith(
            f"{server} failed the weight push's bucket 0 (/update_weights): POST /update_weights answered HTTP 500: "
        ), message
        assert "weight push 1 bucket 0: the received bucket's weight_version differs" in message
    assert seconds < 30.0, (seconds, message)  # the settle (server_push.SETTLE_S), not the push's timeout


SERVER_COMMITS_ONLY_ITS_FIRST_VERSION = """
import sys

if "vllm.entrypoints.openai.api_server" in sys.orig_argv:  # the server only: it commits its first version only
    from vllm.v1.engine.async_llm import AsyncLLM

    real, versions = AsyncLLM.finish_weight_update, []

    async def first_version_only(self, weight_version=None):
        versions.append(weight_version)
        await real(self, weight_version if len(versions) == 1 else None)
        if len(versions) > 1:
            print(f"test: the commit of weight version {weight_version} skipped", flush=True)

    AsyncLLM.finish_weight_update = first_version_only
"""


@pytest.mark.slow  # a spawned server's start
def test_a_server_that_reports_another_version_than_pushed_stops_in_one_line(tiny_model_dir, tmp_path, monkeypatch):
    """The server loads every push but commits only the first one's version (its /finish_weight_update patched in
    the server's own process, by a sitecustomize on its PYTHONPATH): after the push of version 1 its /weight_info
    still says "0", so its samples would be recorded with a version that did not generate them. The push stops in one
    line naming the server, both versions and the fix."""
    from transformers import AutoModelForCausalLM

    patch_child_processes(tmp_path / "patch", monkeypatch, SERVER_COMMITS_ONLY_ITS_FIRST_VERSION)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    probe = [5] * 10 + list(range(20, 30))
    workers = spawned_server_workers(tiny_model_dir, tmp_path, push_timeout_s=120.0)
    try:
        workers.update_weights(update_of(policy, 0, probe, 10))
        with pytest.raises(RolloutWorkerError) as info:
            workers.update_weights(update_of(policy, 1, probe, 10))
    finally:
        workers.close()
    message, log = str(info.value), (tmp_path / "rollout_server0.log").read_text()
    assert "\n" not in message and workers.failed and workers.version == 0
    assert message == (
        f"trainer: {workers.servers[0].describe()} reports weight version '0' after the push of version 1 (it did "
        "not commit the version, or another client pushed to it); fix: give each run servers of its own"
    )
    assert "test: the commit of weight version 1 skipped" in log


# ---------------------------------------------------------------- given servers checked against the run (issue 55)


def test_a_given_server_without_dev_mode_is_named_with_the_variable_that_fixes_it():
    """A server started without VLLM_SERVER_DEV_MODE=1 answers /server_info with 404: the line says so and names the
    variable, as the lines of a missing flag do."""

    class WithoutDevMode(Server):
        def call(self, method, path, body=None, timeout_s=60.0):
            raise HTTPFailure(f'{method} {path} answered HTTP 404: {{"detail":"Not Found"}}', status=404)

    workers = object.__new__(ServerWorkers)
    workers.failed = False
    with pytest.raises(RolloutWorkerError) as info:
        workers._check_settings(WithoutDevMode(0, "http://127.0.0.1:8000"), {"max_model_len": 128})
    assert str(info.value) == (
        "trainer: vLLM server 0 at http://127.0.0.1:8000 (given by rollout.workers.server_urls; its log is its own) "
        "answers /server_info with HTTP 404: it was started without VLLM_SERVER_DEV_MODE=1 (its RL routes: the weight "
        "push, pause, /server_info); fix: start it with VLLM_SERVER_DEV_MODE=1 in its environment (docs/async.md "
        "gives the whole command)"
    )
    assert workers.failed


def test_a_given_url_where_nothing_listens_is_said_and_refused_after_the_grace_not_the_start_timeout(
    tmp_path, caplog, monkeypatch
):
    """A given server is one the user says runs, and `vllm serve` opens its port only once its model is loaded: a URL
    that refuses connections for servers.REFUSED_GRACE_S (here 2 s) stops the start in one line naming it, long before
    rollout.workers.start_timeout_s (600 s); after servers.WAIT_NOTE_S the console says what the trainer waits for."""
    from lit_ppo.rollout.workers import servers

    monkeypatch.setattr(servers, "REFUSED_GRACE_S", 2.0)
    monkeypatch.setattr(servers, "WAIT_NOTE_S", 0.5)
    url = f"http://127.0.0.1:{free_port()}"
    caplog.set_level("INFO", logger="lit_ppo")
    started = time.monotonic()
    with pytest.raises(RolloutWorkerError) as info:
        given_server_workers(url, tmp_path, start_timeout_s=600.0)
    assert time.monotonic() - started < 10.0
    server = f"vLLM server 0 at {url} (given by rollout.workers.server_urls; its log is its own)"
    assert str(info.value) == (
        f"trainer: {server}: nothing listens there (connection refused for 2 s); fix: start the server "
        "(docs/async.md gives the command) and check the URL; a server opens its port once its model is loaded, so "
        "start the trainer once its /health answers"
    )
    assert [r.getMessage() for r in caplog.records if r.name == "lit_ppo"] == [
        f"trainer: waiting for {server} to answer /health (up to rollout.workers.start_timeout_s=600 s; 2 s while it "
        "refuses connections)"
    ]


def process_group(pgid: int) -> list[int]:
    """The running (not zombie) processes of group `pgid`."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[2]) == pgid:
                members.append(int(entry.name))
    return members


def closed_with_its_leader_killed(process: subprocess.Popen) -> ServerWorkers:
    """`close` of a client whose one spawned server (`process`, its group's leader) was killed with SIGKILL first."""
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)  # the leader gone and reaped: only its group's other processes are left
    workers = object.__new__(ServerWorkers)  # the trainer's side alone
    workers.servers = [Server(0, "http://127.0.0.1:1", process=process, log_file=Path("server.log"))]
    workers.requests, workers.in_flight, workers.failed = {}, set(), False
    workers.push = ServerPush(workers, None)  # never started
    started = time.monotonic()
    workers.close(timeout_s=5.0)
    assert time.monotonic() - started < 15.0
    return workers


def test_close_ends_a_spawned_servers_process_group_even_where_its_leader_was_killed():
    """A spawned server's engine core and workers are its process group's other processes: a server killed with
    SIGKILL leaves them running, and `close` ends them all the same (the group's id is the server's pid, which stays
    the group's while any of its processes runs). Here a stand-in group: a shell (the leader) and a `sleep` it started."""
    leader = subprocess.Popen(["bash", "-c", "sleep 300 & wait"], start_new_session=True)
    deadline = time.monotonic() + 10
    while len(process_group(leader.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(process_group(leader.pid)) == 2
    workers = closed_with_its_leader_killed(leader)
    assert process_group(leader.pid) == [] and workers.exit_codes == [-9]


@pytest.mark.slow  # a spawned server's start and one given by URL (about a minute each on 2 shared cores)
def test_real_servers_a_killed_spawned_ones_engine_is_ended_and_a_given_ones_dtype_and_model_are_checked(
    tiny_model_dir, tmp_path
):
    """Real `vllm serve` processes. A spawned server killed with SIGKILL (its API server only, as an OOM killer or a
    user would) leaves its engine core and worker running; `close` ends every process of its group. A server given by
    URL and started without --dtype samples in vLLM's auto dtype (bfloat16 on CPU): the start stops in one line naming
    the dtype, both values and the flag; given as another model's server (the run's folder of other shapes), in one
    line naming both models."""
    workers = spawned_server_workers(tiny_model_dir, tmp_path / "spawned", push_timeout_s=60.0)
    process = workers.procs[0]
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    time.sleep(2.0)
    assert process_group(process.pid), "the server's engine core and worker outlive it"
    workers.close()
    assert process_group(process.pid) == []

    given, url = start_server(tiny_model_dir, tmp_path / "given.log", dtype=None)
    try:
        settings = dict(model_dir=tiny_model_dir, dtype="float32", max_model_len=128)
        with pytest.raises(RolloutWorkerError) as info:
            given_server_workers(url, tmp_path / "a", start_timeout_s=300.0, engine_kwargs=settings)
        assert str(info.value) == (
            f"trainer: vLLM server 0 at {url} (given by rollout.workers.server_urls; its log is its own) runs with "
            "dtype 'bfloat16' where this run's rollout workers need 'float32'; fix: start it with --dtype float32 "
            "(docs/async.md gives the whole command)"
        )
        other = model_folder(tmp_path / "other", hidden_size=128)
        with pytest.raises(RolloutWorkerError) as info:
            given_server_workers(url, tmp_path / "b", engine_kwargs={**settings, "model_dir": other})
        assert (
            f"serves another model than the run's: {tiny_model_dir} (hidden_size 64) where the run's {other} "
            in str(info.value)
        )
    finally:
        os.killpg(given.pid, signal.SIGTERM)
        given.wait(60)
