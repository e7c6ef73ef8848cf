"""`rollout.engine=hf`: the actor generates through Hugging Face `generate`, with vLLM's interface and semantics.

Compared with the vLLM engine on the same weights (greedy outputs, stops, the log-probs each reports), with the
trainer's own log-probs of the sampled tokens, and run end to end: `train.py rollout.engine=hf` with vLLM made
unimportable, episodes with a tool environment, the config checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_ppo.config import EpisodesConfig, RolloutConfig
from lit_ppo.contract import GenerateRequest
from lit_ppo.errors import ConfigError
from lit_ppo.plan import compute_plan
from lit_ppo.rollout.engine import sampling_seeds
from lit_ppo.rollout.hf_engine import HFEngine
from lit_ppo.training.batching import pack
from tests.helpers import ROOT, build_run, compose_run_config, read_csv, rollout_step_rows
from tests.helpers.episodes import ENVIRONMENT
from tests.helpers.prompts import long_prompts


@pytest.fixture(scope="module")
def actor(tiny_model_dir):
    """The session's tiny model as the trainer holds it: float32, in training mode."""
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).train()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def vllm(engine, actor):
    """The shared vLLM engine holding the actor's weights (other tests may have left it elsewhere)."""
    engine.sync_weights(actor.state_dict().items())
    return engine


def processed_logprobs(model, prompts, responses, temperature: float, top_p: float = 1.0) -> list[list[float]]:
    """The sampled tokens' log-probs under temperature, then top-p renormalized over the kept tokens, from one
    teacher-forced float32 forward of each sequence (written here from the definition, not from either engine)."""
    out = []
    with torch.no_grad():
        for prompt, response in zip(prompts, responses):
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
            logits = logits / temperature
            if top_p < 1:
                probs, order = logits.softmax(-1).sort(-1)  # ascending: drop the tail whose mass stays <= 1 - p
                drop = probs.cumsum(-1) <= 1 - top_p
                drop[:, -1] = False
                logits = logits.scatter(-1, order, logits.gather(-1, order).masked_fill(drop, float("-inf")))
            logp = logits.log_softmax(-1)
            out.append(logp.gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1).tolist())
    return out


def test_greedy_outputs_equal_vllm(actor, tokenizer, vllm):
    """Greedy on 100-115-token prompts: the same tokens, texts, truncation and log-probs as vLLM on the same weights;
    with a stop token and a stop string that occur in the greedy responses, the same again."""
    hf = HFEngine(actor, tokenizer)
    prompts = long_prompts(tokenizer, 16, 100, 115, seed=1)
    kwargs = dict(n=1, temperature=0.0, top_p=1.0, max_tokens=12, seeds=None)
    # A model's own generation config (Qwen2.5-Instruct's has a repetition penalty) must not change what is sampled:
    # vLLM ignores it once sampling parameters are given.
    actor.generation_config.repetition_penalty = 5.0
    try:
        ours = hf.generate(GenerateRequest(prompts, **kwargs))
    finally:
        actor.generation_config.repetition_penalty = None
    theirs = vllm.generate(GenerateRequest(prompts, **kwargs))
    assert [g.token_ids for g in ours] == [g.token_ids for g in theirs]
    assert [g.text for g in ours] == [g.text for g in theirs] and [g.truncated for g in ours] == [
        g.truncated for g in theirs
    ]
    for a, b in zip(ours, theirs):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    # A stop token from the middle of one response and a stop string from another's text.
    stop_id = ours[0].token_ids[len(ours[0].token_ids) // 2]
    stop_text = next(g.text[4:6] for g in ours[1:] if stop_id not in g.token_ids and g.text[4:6].strip())
    stops = dict(stop_token_ids=[stop_id], stop=[stop_text])
    ours, theirs = (
        hf.generate(GenerateRequest(prompts, **kwargs, **stops)),
        vllm.generate(GenerateRequest(prompts, **kwargs, **stops)),
    )
    assert [g.token_ids for g in ours] == [g.token_ids for g in theirs]
    assert [g.text for g in ours] == [g.text for g in theirs]
    assert [g.truncated for g in ours] == [g.truncated for g in theirs]
    assert sum(not g.truncated for g in ours) >= 2  # the stops ended some responses early
    assert any(g.token_ids[-1] == stop_id for g in ours) and all(stop_text not in g.text for g in ours)


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sampled_logprobs_are_the_processed_distributions_like_vllms(actor, tokenizer, vllm, top_p):
    """At temperature 0.7 (and top-p 0.8) each engine reports, for the tokens it sampled, the log-prob under
    temperature then top-p renormalized (vLLM's processed_logprobs), within 1e-4 of a float32 forward."""
    prompts = long_prompts(tokenizer, 12, 100, 115, seed=2)
    seeds = sampling_seeds(0, "logprobs", range(len(prompts)), 2)
    kwargs = dict(n=2, temperature=0.7, top_p=top_p, max_tokens=10, seeds=seeds)
    for engine in (HFEngine(actor, tokenizer), vllm):
        generations = engine.generate(GenerateRequest(prompts, **kwargs))
        expected = processed_logprobs(
            actor, [prompts[g.prompt_index] for g in generations], [g.token_ids for g in generations], 0.7, top_p
        )
        for g, reference in zip(generations, expected):
            assert len(g.logprobs) == len(g.token_ids) > 0
            assert g.logprobs == pytest.approx(reference, abs=1e-4), type(engine).__name__
    if top_p < 1:  # the renormalization shows: the untruncated log-probs are lower
        raw = processed_logprobs(
            actor, [prompts[g.prompt_index] for g in generations], [g.token_ids for g in generations], 0.7
        )
        assert sum(sum(e) - sum(r) for e, r in zip(expected, raw)) > 0.5


def test_seeds_reproduce_samples_whatever_the_batch(actor, tokenizer):
    """Per-prompt seeds: a prompt's samples are the same generated alone, in another order or in small batches,
    a different seed changes them, and the global torch RNG does not move (training stays reproducible)."""
    hf = HFEngine(actor, tokenizer)
    prompts = long_prompts(tokenizer, 24, 100, 115, seed=3)
    seeds = sampling_seeds(0, "rollout_step=0", range(len(prompts)), 2)
    kwargs = dict(n=2, temperature=0.7, top_p=1.0, max_tokens=10)
    rng = torch.get_rng_state()
    everything = hf.generate(GenerateRequest(prompts, seeds=seeds, **kwargs))
    assert torch.equal(torch.get_rng_state(), rng)
    assert [g.prompt_index for g in everything] == [i for i in range(24) for _ in range(2)]
    alone = hf.generate(GenerateRequest(prompts[16:], seeds=seeds[16:], **kwargs))
    assert [g.token_ids for g in alone] == [g.token_ids for g in everything[32:]]
    small = HFEngine(actor, tokenizer, max_batch_sequences=5).generate(
        GenerateRequest(prompts[::-1], seeds=seeds[::-1], **kwargs)
    )
    assert [g.token_ids for g in small] == [
        g.token_ids for i in range(23, -1, -1) for g in everything[2 * i : 2 * i + 2]
    ]
    for a, b in zip(small[:2], everything[46:]):  # prompt 23 in a batch of 5 against one of 48 rows
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    other = hf.generate(GenerateRequest(prompts, seeds=sampling_seeds(1, "rollout_step=0", range(24), 2), **kwargs))
    assert sum(a.token_ids != b.token_ids for a, b in zip(other, everything)) > 12
    assert actor.training  # the trainer's mode is restored


def test_stops_on_a_uniform_policy(tiny_model_dir, actor, tokenizer, vllm):
    """A policy that samples uniformly (zero final norm: all logits 0) meets the stops often: a stop token ends a
    response as its last token, not in its text and not truncated; a stop string is cut from the text; vLLM on
    the same weights gives responses with the same properties."""
    uniform = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.nn.init.zeros_(uniform.model.norm.weight)
    stop_id, stop_text = tokenizer.convert_tokens_to_ids("a"), "b"
    prompts = long_prompts(tokenizer, 16, 100, 104, seed=4)  # + 24 tokens: within the 128 positions
    kwargs = dict(n=8, temperature=0.8, top_p=1.0, max_tokens=24, seeds=sampling_seeds(0, "stops", range(16), 8))
    vllm.sync_weights(uniform.state_dict().items())
    for engine in (HFEngine(uniform, tokenizer), vllm):
        out = engine.generate(GenerateRequest(prompts, **kwargs, stop_token_ids=[stop_id], stop=[stop_text]))
        ended = [g for g in out if g.token_ids[-1] == stop_id]
        assert len(ended) >= 5 and all(not g.truncated and "a" not in g.text for g in ended)
        assert all(stop_id not in g.token_ids[:-1] and stop_text not in g.text for g in out)
        decoded = [tokenizer.decode(g.token_ids, skip_special_tokens=True) for g in out]
        cut = [(g, text) for g, text in zip(out, decoded) if stop_text in text]
        assert len(cut) >= 5 and all(not g.truncated and text.startswith(g.text + stop_text) for g, text in cut)
        assert all(len(g.token_ids) == 24 for g in out if g.truncated)
    vllm.sync_weights(actor.state_dict().items())


def test_trainer_logprobs_equal_the_hf_engines(tiny_model_dir, long_prompt_files, tmp_path):  # noqa: F811
    """Through the product's wiring (build_run with rollout.engine=hf): the engine holds the module's actor itself,
    and make_experience's old log-probs of the sampled tokens equal the engine's at temperature 0.7 on
    100-115-token prompts (float32)."""
    rollout = RolloutConfig(engine="hf", max_response_tokens=12, temperature=0.7)
    _, module, datamodule, plan = build_run(
        tiny_model_dir,
        None,
        long_prompt_files,
        tmp_path,
        rollout=rollout,
        train_batch_size=16,
        micro_train_batch_size=8,
    )
    assert datamodule.engine.model is module.actor and plan.models.rollout_engine == "hf"
    batch = datamodule.produce_rollout(0)
    assert min(len(p) for p in batch.prompt_ids) >= 100
    exp = module.make_experience(batch)
    mask = exp.mask.bool()
    diff = (exp.old_logp - exp.rollout_logp)[mask].abs()
    assert int(mask.sum()) > 100 and float(diff.max()) < 1e-4, float(diff.max())


def test_an_episode_with_a_tool_environment_runs_on_the_hf_engine(tiny_model_dir, arithmetic_files, tmp_path):
    """Multi-turn episodes (tests/rollout/test_tool_training.py's calculator) with the HF engine: observations between turns,
    the trainer's log-probs of the policy tokens equal the engine's, two rollout steps train, evaluation runs."""
    rollout = RolloutConfig(
        engine="hf",
        max_response_tokens=6,
        temperature=0.7,
        eval_samples_per_prompt=2,
        episodes=EpisodesConfig(environment=ENVIRONMENT, max_turns=3, max_tokens=30),
    )
    trainer, module, datamodule, plan = build_run(
        tiny_model_dir, None, arithmetic_files, tmp_path, total_rollout_steps=2, rollout=rollout
    )
    batch = datamodule.produce_rollout(0)
    datamodule.next_rollout_step = datamodule.stream.next_generation_round = 0
    assert any(0 in m for m in batch.policy_masks), "no episode with an observation"
    assert all(e == p + r for e, p, r in zip(batch.episode_ids, batch.prompt_ids, batch.response_ids))
    mb = pack(batch.prompt_ids, batch.response_ids, module.pad_token_id, "cpu", policy_masks=batch.policy_masks)
    with torch.no_grad():
        logp = module.response_logprobs(module.actor, mb)
    engine_logp = torch.zeros_like(logp)
    for i, lp in enumerate(batch.rollout_logprobs):
        engine_logp[i, : len(lp)] = torch.tensor(lp)
    assert ((logp - engine_logp).abs() * mb.response_mask).max() < 1e-4
    trainer.fit(module, datamodule=datamodule)
    row = module.history[-1]
    assert row["rollout/turns_mean"] > 1 and row["rollout/tool_calls"] > 0 and row["rollout/logprob_abs_diff"] < 1e-4
    assert module.actor_optimizer_steps == 2 * plan.counts.optimizer_steps_per_rollout_step
    assert "eval/tool_call_rate" in module.eval_history[-1]
    assert datamodule.engine.weights_version == 3  # the start and each rollout step: nothing to load


@pytest.mark.slow  # make test: tests/end_to_end/test_gpu_scripts.py's train.py smokes with rollout.engine=hf and vLLM unimportable
def test_train_py_runs_with_the_hf_engine_and_no_vllm(tmp_path):
    """`python train.py rollout.engine=hf` on a machine without vLLM (made unimportable here): two rollout steps in the
    precision `auto` picks, temperature 0.7, the log-prob check active and passed, evaluation at every step."""
    site = tmp_path / "no_vllm"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['vllm'] = None  # as if not installed\n")
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "train.py",
        "rollout.engine=hf",
        "rollout.temperature=0.7",
        "trainer.total_rollout_steps=2",
        "trainer.eval_every=1",
        "model.warm_start.steps=20",
        "data.n_train=128",
        "data.n_eval=8",
        "ppo.rollout_batch_size=16",  # 64 samples per rollout step, 2 optimizer steps of 32 each
        "ppo.train_batch_size=32",
        f"output_dir={out}",
        f"cache_dir={tmp_path / 'cache'}",
        f"hydra.run.dir={out / 'hydra'}",
    ]
    env = {**os.environ, "PYTHONPATH": str(site)}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert [int(float(r["rollout_step"])) for r in read_csv(out / "metrics.csv")] == [0, 1, 2]  # 0: the first eval
    rows = rollout_step_rows(out / "metrics.csv")
    plan = json.loads((out / "plan.json").read_text())
    assert plan["models"]["rollout_engine"] == "hf"
    limit = (
        1e-4 if plan["models"]["precision"] == "32-true" else 2e-2
    )  # bf16-mixed: both sides compute in bf16 autocast
    assert all(0 <= float(r["rollout/logprob_abs_diff"]) < limit for r in rows), [
        r["rollout/logprob_abs_diff"] for r in rows
    ]
    assert "eval/pass@4" in rows[-1]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["samples_generated"] == 2 * 16 * 4 and summary["optimizer_steps_actor"] == 4


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["rollout.engine=sglang"], r"^rollout.engine='sglang' is unknown; fix: use one of vllm, hf$"),
        (
            ["rollout.engine=hf", "strategy=fsdp", "strategy.devices=2"],
            r"^rollout.engine=hf with strategy=fsdp: .*fix:",
        ),
        (["rollout.engine=hf", "strategy.precision=32-true", "rollout.dtype=bfloat16"], r"rollout.dtype=null$"),
        (["rollout.engine=hf", "rollout.tensor_parallel_size=2"], r"^rollout.tensor_parallel_size=2 with .*fix:"),
    ],
)
def test_engine_settings_that_cannot_run_are_refused_in_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as info:
        compute_plan(compose_run_config(*overrides), 1000)
    assert "\n" not in str(info.value)


def test_hf_rollout_workers_take_a_sharded_trainer():
    """The FSDP refusal is about the colocated HF engine (the sharded actor itself generating); rollout workers load a
    whole copy of their own and take the gathered push, so `strategy=fsdp` with HF-engine workers is planned
    (FSDP pushes are tested with vLLM workers in tests/end_to_end/test_ddp_workers.py)."""
    overrides = ["rollout.engine=hf", "strategy=fsdp", "strategy.devices=2", "rollout.mode=disaggregated"]
    plan = compute_plan(compose_run_config(*overrides), 1000)
    assert "Hugging Face generate in each rollout worker" in plan.table()
    with pytest.raises(
        ConfigError, match=r"or rollout.mode=disaggregated \(rollout workers load a copy of their own\)$"
    ):
        compute_plan(compose_run_config(*overrides[:-1]), 1000)


def test_the_plan_names_the_engine():
    hf = compute_plan(compose_run_config("rollout.engine=hf", "strategy=ddp", "strategy.devices=2"), 1000)
    assert "shares its weights, no sync" in hf.table() and "vLLM dtype" not in hf.table()
    assert "weights synced after each rollout step" in compute_plan(compose_run_config(), 1000).table()


def test_the_plan_names_vllm_settings_the_hf_engine_does_not_use():
    """An experiment written for vLLM run with rollout.engine=hf: its rollout.vllm settings are named, not dropped
    silently; and the other way round, a rollout.hf setting of a vLLM run."""
    plan = compute_plan(compose_run_config("+experiment=qwen1.5b", "rollout.engine=hf"), 1000)
    (note,) = [n for n in plan.notes if "does not use" in n]
    assert note == "rollout.engine=hf does not use the vLLM setting(s) rollout.vllm.gpu_memory_utilization=0.6"
    assert not any("does not use" in n for n in compute_plan(compose_run_config("rollout.engine=hf"), 1000).notes)
    plan = compute_plan(compose_run_config("rollout.hf.max_batch_sequences=4", "rollout.vllm.kv_cache_gib=2"), 1000)
    assert [n for n in plan.notes if "does not use" in n] == [
        "rollout.engine=vllm does not use the HF engine setting(s) rollout.hf.max_batch_sequences=4"
    ]


@pytest.mark.slow  # two full runs (one of two ranks); DDP is in make test with vLLM (tests/end_to_end/test_ddp.py)
def test_ddp_on_cpu_samples_and_trains_as_one_process(tmp_path):
    """`strategy=ddp strategy.devices=2 strategy.accelerator=cpu rollout.engine=hf`: each rank's actor generates its
    half of every rollout batch (no collective inside generate), and the samples of both rollout steps, their
    advantages and the final actor are those of one process (tests/end_to_end/test_ddp.py's settings, float32)."""
    from tests.helpers.cli_runs import DDP, experience, final_actor, train_cli

    single = train_cli(tmp_path / "single", tmp_path / "cache", "rollout.engine=hf", "rollout.temperature=0.7")
    ddp = train_cli(tmp_path / "ddp", tmp_path / "cache", "rollout.engine=hf", "rollout.temperature=0.7", *DDP)
    for step in range(2):
        one, two = experience(single, step, world=1), experience(ddp, step, world=2)
        assert two["shard_sizes"] == [64, 64]
        assert two["prompt_positions"] == one["prompt_positions"] and two["response_ids"] == one["response_ids"]
        assert torch.allclose(two["advantages"], one["advantages"], atol=1e-5)
    rows = rollout_step_rows(ddp / "metrics.csv")
    assert all(float(r["rollout/logprob_abs_diff"]) < 1e-4 for r in rows)
    ours, theirs = final_actor(ddp), final_actor(single)
    assert all(torch.allclose(ours[k], theirs[k], atol=1e-5) for k in theirs)
