"""LoRA RL (model.lora, issue 25): PEFT adapters on a frozen base, the reference as the actor with its adapter
disabled, and adapter-only sync into the in-process vLLM engine, checked at every rollout step."""

from __future__ import annotations

import pytest
import torch

from lit_ppo.config import LoraConfig
from lit_ppo.errors import ConfigError
from lit_ppo.testing import NullEngine
from tests.helpers import compose_run_config, plan_of
from tests.helpers.ranks import start_ranks
from tests.helpers.resume import assert_same_adapter


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.lora.use_dora=true", "model.lora.use_dora"),
        ("model.lora.modules_to_save=[lm_head]", "model.lora.modules_to_save"),
        ("model.lora.bias=all", "model.lora.bias"),
        ("model.lora.rank=1024", "model.lora.rank"),
        ("model.lora.dropout=0.05", "model.lora.dropout"),
        ("model.lora.init=pissa", "model.lora.init"),
        ("model.lora.target_modules=q_proj", "model.lora.target_modules"),  # peft reads a string as a regex
    ],
)
def test_adapters_vllm_cannot_serve_are_refused_in_one_line_naming_the_key(override, key):
    with pytest.raises(ConfigError) as error:
        compose_run_config("model.lora.rank=16", override)
    message = str(error.value)
    assert key in message and "fix:" in message and "\n" not in message


@pytest.mark.parametrize("model", ["tiny", "qwen"])
def test_lora_defaults_equal_each_model_yaml(model):
    import yaml

    from tests.helpers import CONF, dataclass_defaults

    assert yaml.safe_load((CONF / "model" / f"{model}.yaml").read_text())["lora"] == dataclass_defaults(LoraConfig)
    assert compose_run_config(f"model={model}").model.lora == LoraConfig()  # off by default


def test_vllm_max_lora_rank_is_the_smallest_allowed_slot_that_holds_the_rank():
    assert [LoraConfig(rank=r).vllm_max_lora_rank for r in (1, 2, 8, 9, 16, 17, 64, 300, 512)] == [
        1, 8, 8, 16, 16, 32, 64, 320, 512,
    ]  # fmt: skip


def test_the_plan_states_the_adapter_and_the_reference_without_a_copy():
    config = compose_run_config("model.lora.rank=16", "model.lora.alpha=32")
    from lit_ppo.plan import compute_plan

    plan = compute_plan(config, 2000)
    table = plan.table()
    assert plan.lora.rank == 16 and plan.lora.vllm_max_lora_rank == 16 and plan.models.reference_enabled
    assert "rank 16" in table and "alpha 32, targets all-linear" in table
    assert "the actor with its adapter disabled (no copy of the weights)" in table
    assert "only the adapter synced after each rollout step" in table
    full = plan_of(2000).table()
    assert "LoRA" not in full and "adapter" not in full
    assert "adapter and value head trained in float32" in table


def test_a_lora_plan_without_a_critic_names_no_value_head():
    """GRPO's plan said "adapter (and value head) trained in float32", for a run that has no critic."""
    from lit_ppo.plan import compute_plan

    [row] = [
        line
        for line in compute_plan(compose_run_config("ppo=grpo", "model.lora.rank=16"), 2000).table().splitlines()
        if line.startswith("LoRA")
    ]
    assert row.endswith("base weights frozen in bf16, adapter trained in float32") or row.endswith(
        "base weights frozen, adapter trained in float32"
    ), row


@pytest.mark.parametrize(
    "targets, names, per_layer",
    [
        # the tiny model: hidden 128, q 4 x 32 = 128, k/v 2 x 32 = 64, intermediate 384; rank x (in + out) per module
        (
            "all-linear",
            "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj",
            256 + 192 + 192 + 256 + 3 * 512,
        ),
        ("[q_proj,v_proj]", "q_proj, v_proj", 256 + 192),
    ],
)
def test_the_plan_states_the_modules_adapted_and_the_adapter_counted_on_the_model(
    tmp_path, capsys, targets, names, per_layer
):
    """The pre-flight matches model.lora.target_modules on the model built on the meta device; the plan states what
    it matched and the memory estimate counts that adapter (it estimated 0.0 M for a name no module has)."""
    import json

    from lit_ppo.run import entry as run_module
    from tests.helpers import compose_config

    run_module.main(
        compose_config(
            "mode=plan", "model.lora.rank=8", f"model.lora.target_modules={targets}", f"output_dir={tmp_path}"
        )
    )
    printed = capsys.readouterr().out
    plan = json.loads((tmp_path / "plan.json").read_text())
    adapter = 8 * 4 * per_layer  # rank 8, 4 layers
    modules = 4 * len(names.split(", "))
    assert plan["lora"]["adapted_names"] == names.split(", ") and plan["lora"]["adapted_modules"] == modules
    assert plan["lora"]["adapter_parameters"] == adapter
    assert f"linear modules {names}, matched on the model's architecture" in printed and f"({adapter:,})" in printed
    rows = {row["what"]: row for row in plan["memory"]["rows"]}
    assert rows["trained weights (LoRA)"]["bytes"] == (2 * adapter + 128 + 1) * 4  # actor + critic, value head


def test_qwen7b_lora_fits_one_80gb_gpu_where_full_parameter_qwen7b_does_not(tmp_path, capsys):
    """`+experiment=qwen7b_lora mode=plan`: the frozen bf16 base once, no reference copy, float32 adapter states; the
    estimate fits the experiment's 79.6 GiB GPU. Full-parameter qwen7b planned on one such GPU does not."""
    import json

    from lit_ppo.run import entry as run_module
    from tests.helpers import compose_config

    def memory(name, *overrides):
        out = tmp_path / name
        run_module.main(compose_config(*overrides, "mode=plan", f"output_dir={out}"))
        return json.loads((out / "plan.json").read_text())["memory"], capsys.readouterr().out

    lora, printed = memory("lora", "+experiment=qwen7b_lora")
    rows = {row["what"]: row for row in lora["rows"]}
    assert lora["device_memory_gib"] == 79.6 and lora["peak_gib"] <= 79.6 and lora["warning"] is None
    assert rows["frozen base weights"]["bytes"] == 7_615_616_512 * 2  # Qwen2.5-7B's parameters in bf16, once
    assert "no copy" in rows["frozen base weights"]["how"] and "reference" not in [r["what"] for r in lora["rows"]]
    adapter = 28 * 32 * (2 * (3584 + 3584) + 2 * (3584 + 512) + 2 * (3584 + 18944) + (18944 + 3584))
    assert rows["trained weights (LoRA)"]["bytes"] == adapter * 4
    assert rows["optimizer states"]["bytes"] == adapter * 8 and "vLLM LoRA adapter" in rows
    assert "the actor with its adapter disabled (no copy of the weights)" in printed
    full, _ = memory(
        "full", "+experiment=qwen7b", "strategy=single", "strategy.devices=1", "strategy.accelerator=gpu",
        "strategy.device_memory_gib=79.6",
    )  # fmt: skip
    assert full["peak_gib"] > 79.6 and full["warning"] and full["peak_gib"] > 2 * lora["peak_gib"]


def test_fsdp_plans_a_lora_run_with_the_frozen_base_sharded(tmp_path, capsys):
    """`+experiment=qwen7b_lora strategy=fsdp strategy.devices=8 mode=plan`: LoRA under FSDP is planned (it was refused
    before), the frozen bf16 base, the adapter and its AdamW states are each sharded over the 8 ranks, and a gathered
    unit (the root + one decoder layer, in bf16) holds float32 gradients for its layer's adapter only."""
    import json

    from lit_ppo.run import entry as run_module
    from tests.helpers import compose_config

    overrides = ("+experiment=qwen7b_lora", "strategy=fsdp", "strategy.devices=8", "strategy.accelerator=gpu")
    run_module.main(
        compose_config(*overrides, "strategy.device_memory_gib=79.6", "mode=plan", f"output_dir={tmp_path}")
    )
    assert "the actor with its adapter disabled (no copy of the weights)" in capsys.readouterr().out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["lora"]["rank"] == 32 and plan["counts"]["data_parallel_size"] == 8
    rows = {row["what"]: row for row in plan["memory"]["rows"]}
    assert (
        rows["frozen base weights"]["bytes"] == 7_615_616_512 * 2 // 8
        and "/ 8 (FSDP)" in rows["frozen base weights"]["how"]
    )
    adapter = 28 * 32 * (2 * (3584 + 3584) + 2 * (3584 + 512) + 2 * (3584 + 18944) + (18944 + 3584))
    assert rows["trained weights (LoRA)"]["bytes"] == adapter * 4 // 8
    assert rows["optimizer states"]["bytes"] == adapter * 8 // 8
    # root (embeddings, untied LM head, final norm) 1,089,998,336 + one layer 233,057,792 + its adapter, in bf16;
    # float32 gradients for the layer's adapter (2,883,584 parameters) alone
    layer_adapter = adapter // 28
    assert rows["FSDP gathered units"]["bytes"] == (1_089_998_336 + 233_057_792 + layer_adapter) * 2 + layer_adapter * 4


# ---------------------------------------------------------------- a real LoRA run against the real vLLM engine

RANK = 8


@pytest.fixture(scope="module")
def lora_engine(tiny_model_dir):
    """A vLLM engine started once with the base weights and LoRA enabled (max_lora_rank fitted to RANK), beside the
    session's shared engine (closing it leaves that one working: tests/rollout/test_engine.py)."""
    from lit_ppo.rollout.engine import VLLMEngine

    lora = VLLMEngine(tiny_model_dir, max_model_len=128, seed=0, max_lora_rank=LoraConfig(rank=RANK).vllm_max_lora_rank)
    yield lora
    lora.close()


@pytest.fixture(scope="module")
def long_prompt_files(tmp_path_factory, tiny_model_dir):
    """Prompts of 100-115 tokens (one token per character), the arithmetic question at their end."""
    import json
    import random

    rng = random.Random(0)
    words = ["apples", "cost", "each", "Janet", "buys", "how", "many", "dollars", "per", "week", "total", "and"]
    root = tmp_path_factory.mktemp("long")
    paths = []
    for name, count in (("train", 64), ("eval", 8)):
        lines = []
        for _ in range(count):
            a, b = rng.randint(0, 20), rng.randint(0, 20)
            question = f"{a}+{b}="
            text = ""
            while len(text) < rng.randint(100, 115) - len(question):
                text += rng.choice(words) + " "
            lines.append(json.dumps({"prompt": text + question, "answer": str(a + b)}) + "\n")
        path = root / f"{name}.jsonl"
        path.write_text("".join(lines))
        paths.append(path)
    return paths


def digits_share(prompts, responses, references, extras, **_):
    """A reward that differs between samples from the start (the tiny model rarely answers right): the share of digit
    characters in the response; so the advantages, and the adapter's updates, are not zero."""
    return [sum(c.isdigit() for c in r) / max(len(r), 1) for r in responses]


def lora_run(model_dir, engine, files, tmp_path, *, steps=3, max_logprob_abs_diff=0.5, partial=None, **overrides):
    from lit_ppo.config import RolloutConfig
    from lit_ppo.config.partial import PartialConfig
    from lit_ppo.rollout.datamodule import RolloutDataModule
    from tests.helpers import build_run

    class Recording(RolloutDataModule):
        """Keeps each rollout batch's adapter versions (what the engine says sampled each sample)."""

        versions: list[list[int]] = []

        def produce_rollout(self, rollout_step):
            batch = super().produce_rollout(rollout_step)
            Recording.versions.append(list(batch.adapter_versions))
            return batch

    Recording.versions = []
    rollout = RolloutConfig(
        max_response_tokens=8,
        temperature=0.7,
        max_model_len=128,
        eval_samples_per_prompt=2,
        max_logprob_abs_diff=max_logprob_abs_diff,
        partial=partial or PartialConfig(),
    )
    trainer, module, datamodule, plan = build_run(
        model_dir,
        engine,
        files,
        tmp_path,
        total_rollout_steps=steps,
        rollout=rollout,
        reward_fn=digits_share,
        datamodule_class=Recording,
        lora=LoraConfig(rank=RANK, alpha=16.0),
        actor_lr=5e-3,
        **overrides,
    )
    return trainer, module, datamodule, Recording.versions


def test_lora_run_syncs_only_the_adapter_and_vllm_samples_from_the_trained_policy(
    tiny_model_dir, lora_engine, long_prompt_files, tmp_path
):
    """2 rollout steps (PPO with critic and KL: the reference is the actor with its adapter disabled), 4 optimizer
    steps each, prompts of 100+ tokens at temperature 0.7. vLLM's log-probs of the sampled tokens equal the trainer's
    at float32's level once the adapter is non-zero, each sample records the adapter version the trainer had, only
    adapter bytes are pushed, and the base weights never move."""
    from safetensors.torch import load_file

    from tests.helpers import rollout_step_rows

    trainer, module, datamodule, versions = lora_run(tiny_model_dir, lora_engine, long_prompt_files, tmp_path, steps=2)
    assert module.reference is None and module.critic is not None  # no copy of the weights for the reference
    trainer.fit(module, datamodule=datamodule)

    assert [set(v) for v in versions] == [{1}, {2}]  # adapter version k + 1 sampled rollout step k
    assert lora_engine.llm.llm_engine.list_loras() == {3} and lora_engine.adapter_version == 3
    rows = rollout_step_rows(tmp_path / "metrics.csv")
    adapter = {k: v for k, v in module.actor.named_parameters() if v.requires_grad}
    assert adapter and all("lora_" in k for k in adapter)
    adapter_bytes = sum(v.numel() * v.element_size() for v in adapter.values())
    full_bytes = sum(v.numel() * v.element_size() for v in module.actor.get_base_model().state_dict().values())
    assert [float(r["perf/weight_sync_bytes"]) for r in rows] == [adapter_bytes] * 2
    assert adapter_bytes < full_bytes / 4
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    assert all(float(b.detach().abs().max()) > 1e-4 for b in lora_b)  # B starts at zero: the adapter has trained
    diffs = [float(r["rollout/logprob_abs_diff"]) for r in rows]  # the second: an adapter after 4 optimizer steps
    assert all(d < 1e-4 for d in diffs), diffs  # float32 (full fine-tuning measures ~1e-7 here)
    assert float(rows[-1]["rollout/kl_to_reference"]) != 0  # the disabled adapter is another policy
    # The frozen base: bitwise the weights it was loaded with; the critic's value head trained in full.
    initial = load_file(f"{tiny_model_dir}/model.safetensors")
    base = module.actor.get_base_model().state_dict()
    for name, tensor in initial.items():
        key = (
            name.replace(".weight", ".base_layer.weight")
            if name.replace(".weight", ".base_layer.weight") in base
            else name
        )
        key = key.replace(".bias", ".base_layer.bias") if key.replace(".bias", ".base_layer.bias") in base else key
        assert torch.equal(base[key], tensor), name
    score = [v for k, v in module.critic.named_parameters() if "score" in k and v.requires_grad]
    assert score and any(float(v.detach().abs().max()) > 0 for v in score)


@pytest.mark.slow  # two LoRA runs: 1430 s at a load of 30+ on 2 cores; the unit test: test_partial.py
def test_partial_rollouts_continue_carried_samples_with_each_step_s_adapter(
    tiny_model_dir, lora_engine, long_prompt_files, tmp_path, monkeypatch
):
    """rollout.partial with model.lora (responses of 8 tokens cut every 4): the samples carried from rollout step 1 are
    continued in step 2 by adapter version 2, the step's, their spans [[0, 0], [4, 1]] and the adapter of the last
    chunk checked by the trainer; vLLM's log-probs of the step's own tokens equal the trainer's (the weight-sync guard
    bounds those). A sync skipped after step 1: the carried samples' second chunks come from adapter 1 and the run
    stops in one line at step 2."""
    from lit_ppo.config.partial import PartialConfig
    from lit_ppo.errors import WeightSyncError

    partial = PartialConfig(step_tokens=4, max_age_steps=1)
    spans = []
    trainer, module, datamodule, versions = lora_run(
        tiny_model_dir,
        lora_engine,
        long_prompt_files,
        tmp_path / "synced",
        steps=2,
        partial=partial,
        max_logprob_abs_diff=1e-3,
    )
    real_produce = type(datamodule).produce_rollout
    monkeypatch.setattr(
        type(datamodule), "produce_rollout", lambda self, s: spans.append((b := real_produce(self, s))) or b
    )
    trainer.fit(module, datamodule=datamodule)
    assert set(versions[0]) == {1}  # step 2's: finished in step 1 (adapter 1) or continued in step 2 (2)
    for batch, adapters in zip(spans, versions):  # each sample: the adapter of its last chunk's version
        assert adapters == [s[-1][1] + 1 for s in batch.version_spans]
    carried = [(v, sp) for v, sp in zip(versions[1], spans[1].version_spans) if len(sp) == 2]
    assert carried and all(sp == [[0, 0], [4, 1]] and v == 2 for v, sp in carried)
    assert max(r["rollout/token_age_max"] for r in module.history) == 1

    trainer, module, datamodule, versions = lora_run(
        tiny_model_dir, lora_engine, long_prompt_files, tmp_path / "skipped", steps=2, partial=partial
    )
    real_sync, calls = lora_engine.sync_adapter, []
    monkeypatch.setattr(
        lora_engine, "sync_adapter", lambda t, c, v: calls.append(v) or (real_sync(t, c, v) if len(calls) == 1 else 0)
    )
    with pytest.raises(WeightSyncError, match=r"^rollout step 2: a carried sample's tokens from 4 of policy version 1"):
        trainer.fit(module, datamodule=datamodule)


def test_a_skipped_adapter_sync_stops_the_run_within_one_rollout_step(
    tiny_model_dir, lora_engine, long_prompt_files, tmp_path, monkeypatch
):
    """The engine keeps serving adapter version 1 (every sync after the first skipped, as in verl #7495): rollout
    step 1's samples (the second rollout step) record version 1 where the trainer's adapter is version 2, and the
    run stops there."""
    from lit_ppo.errors import WeightSyncError

    trainer, module, datamodule, versions = lora_run(tiny_model_dir, lora_engine, long_prompt_files, tmp_path)
    real_sync, calls = lora_engine.sync_adapter, []

    def first_sync_only(tensors, config, version):
        calls.append(version)
        return real_sync(tensors, config, version) if len(calls) == 1 else 0

    monkeypatch.setattr(lora_engine, "sync_adapter", first_sync_only)
    with pytest.raises(WeightSyncError, match=r"rollout step 2: vLLM sampled with LoRA adapter version\(s\) \[1\]"):
        trainer.fit(module, datamodule=datamodule)
    assert calls == [1, 2] and [set(v) for v in versions] == [{1}, {1}]


@pytest.mark.slow
def test_the_stale_weight_gate_stops_a_lora_run_whose_engine_serves_a_stale_adapter(
    tiny_model_dir, lora_engine, long_prompt_files, tmp_path, monkeypatch
):
    """The engine is handed the initial adapter (B = 0) under each new version: versions agree, the weights do not.
    The existing gate on |trainer - vLLM| log-probs (rollout.max_logprob_abs_diff) stops the run at the second rollout
    step, the first sampled by the stale adapter."""
    import lit_ppo.training.weight_sync as weight_sync_code
    from lit_ppo.errors import RolloutMismatchError

    trainer, module, datamodule, versions = lora_run(
        tiny_model_dir, lora_engine, long_prompt_files, tmp_path, max_logprob_abs_diff=0.01
    )
    real, first = weight_sync_code.adapter_tensors, {}

    def stale(model):
        if not first:
            first.update({k: v.detach().clone() for k, v in real(model).items()})
        return first

    monkeypatch.setattr(weight_sync_code, "adapter_tensors", stale)
    with pytest.raises(RolloutMismatchError, match="rollout step 2: the trainer's log-probs"):
        trainer.fit(module, datamodule=datamodule)
    assert [set(v) for v in versions] == [{1}, {2}]


LORA_TRAIN = [
    "model.lora.rank=8",
    "trainer.eval_every=0",
    "model.warm_start.steps=20",
    "data.n_train=64",
    "data.n_eval=8",
    "ppo.actor_lr=5e-3",
    "reward.fn._target_=tests.training.test_lora.digits_share",  # rewards that differ: the adapter trains from step 1
    "strategy.precision=32-true",
]


def train_command(out, *extra: str) -> list[str]:
    import sys

    return [sys.executable, "train.py", *LORA_TRAIN, f"output_dir={out}", f"hydra.run.dir={out / 'hydra'}", *extra]


@pytest.mark.slow
def test_a_lora_run_checkpoints_the_adapter_not_the_base_and_saves_a_peft_adapter(tmp_path):
    """`python train.py model.lora.rank=8 model.lora.save_merged=true`: checkpoints hold the adapters and the value
    head but no frozen base tensor; actor/ is a PEFT adapter directory that peft loads onto the base and that gives
    the merged model's (actor_merged/) outputs."""
    import subprocess

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.helpers import ROOT

    out = tmp_path / "run"
    command = train_command(
        out, "model.lora.save_merged=true", "trainer.total_rollout_steps=2", "trainer.checkpoint_every=1"
    )
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    checkpoint = torch.load(out / "checkpoints" / "rollout_step_000002.ckpt", weights_only=False)
    keys = set(checkpoint["state_dict"])
    assert keys and all("lora_" in k or ".score." in k for k in keys), sorted(keys)[:5]
    assert any(k.startswith("critic.") and ".score." in k for k in keys)
    assert (out / "actor" / "adapter_config.json").exists() and (out / "actor" / "adapter_model.safetensors").exists()
    import json

    base_path = json.loads((out / "actor" / "adapter_config.json").read_text())["base_model_name_or_path"]
    policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), out / "actor").eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "actor_merged").eval()
    ids = torch.tensor([[3, 5, 7, 9, 11, 4]])
    with torch.no_grad():
        assert torch.allclose(policy(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-5)
        with policy.disable_adapter():
            assert not torch.allclose(policy(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-5)


@pytest.mark.slow
def test_lora_sigkill_then_resume_auto_gives_the_bitwise_same_adapter(tmp_path):
    """test_resume.py's SIGKILL pattern on a LoRA run: killed after a checkpoint, resumed with resume=auto (the frozen
    base from model_dir, the adapter, its AdamW states, counters and RNG from the checkpoint), the final adapter is
    bitwise the uninterrupted run's."""
    import signal
    import subprocess
    import time

    from safetensors.torch import load_file

    from lit_ppo.checkpoints import checkpoint_path, list_checkpoints
    from tests.helpers import ROOT

    common = ("trainer.total_rollout_steps=4", "trainer.checkpoint_every=1", "ppo.ppo_epochs=2")
    full = subprocess.run(train_command(tmp_path / "full", *common), cwd=ROOT, capture_output=True, text=True)
    assert full.returncode == 0, full.stderr[-3000:]
    crashed = tmp_path / "crashed"
    process = subprocess.Popen(
        train_command(crashed, *common), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 300
    while not checkpoint_path(crashed / "checkpoints", 2).exists():
        assert process.poll() is None and time.time() < deadline, "the run ended before it could be killed"
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert list_checkpoints(crashed / "checkpoints")[-1].name != "rollout_step_000004.ckpt", "killed too late"
    resumed = subprocess.run(train_command(crashed, *common, "resume=auto"), cwd=ROOT, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = load_file(tmp_path / "full" / "actor" / "adapter_model.safetensors")
    b = load_file(crashed / "actor" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and any("lora_B" in k and float(v.abs().max()) > 0 for k, v in a.items())
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_under_bf16_mixed_the_frozen_base_is_bf16_and_only_the_float32_adapter_has_adamw_states(tiny_model_dir):
    from lit_ppo.training.models import load_models
    from lit_ppo.training.optim import actor_critic_optimizers
    from tests.helpers import run_config

    config = run_config(precision="bf16-mixed")
    plan = plan_of(64, precision="bf16-mixed")
    assert plan.models.critic_enabled and plan.models.reference_enabled
    actor, critic, reference = load_models(tiny_model_dir, plan, lora=LoraConfig(rank=8))
    assert reference is None
    for model in (actor, critic):
        trained = {k: p for k, p in model.named_parameters() if p.requires_grad}
        frozen = {k: p for k, p in model.named_parameters() if not p.requires_grad}
        assert trained and frozen and all(p.dtype == torch.float32 for p in trained.values())
        # (peft keeps the critic's untrained value head, 65 numbers, as it was: float32)
        assert all(p.dtype == torch.bfloat16 for k, p in frozen.items() if ".score.original_module." not in k)
    assert any(".score." in k for k, p in critic.named_parameters() if p.requires_grad)  # the value head, whole
    (actor_opt, critic_opt), _ = actor_critic_optimizers(actor, critic, config.ppo, plan)
    for model, optimizer in ((actor, actor_opt), (critic, critic_opt)):
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        assert in_optimizer == {id(p) for p in model.parameters() if p.requires_grad}


@pytest.mark.slow
def test_the_hf_engine_generates_with_the_lora_actor_itself(tiny_model_dir, long_prompt_files, tmp_path):
    """rollout.engine=hf with model.lora: the peft actor generates (no vLLM, nothing pushed), its log-probs agree
    with the trainer's, and the adapter trains."""
    from lit_ppo.config import RolloutConfig
    from tests.helpers import build_run, rollout_step_rows

    rollout = RolloutConfig(engine="hf", max_response_tokens=8, temperature=0.7, max_model_len=128)
    trainer, module, datamodule, plan = build_run(
        tiny_model_dir,
        None,
        long_prompt_files,
        tmp_path,
        total_rollout_steps=2,
        rollout=rollout,
        reward_fn=digits_share,
        lora=LoraConfig(rank=RANK),
        actor_lr=5e-3,
    )
    assert datamodule.engine.model is module.actor
    trainer.fit(module, datamodule=datamodule)
    rows = rollout_step_rows(tmp_path / "metrics.csv")
    assert [float(r["perf/weight_sync_bytes"]) for r in rows] == [0.0, 0.0]
    assert all(float(r["rollout/logprob_abs_diff"]) < 1e-4 for r in rows)
    assert any(float(p.detach().abs().max()) > 0 for k, p in module.actor.named_parameters() if "lora_B" in k)


LORA_PARALLEL = ("model.lora.rank=8", "ppo.actor_lr=5e-3")


@pytest.fixture(scope="module")
def lora_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("lora_cache")


@pytest.fixture(scope="module")
def lora_single_run(tmp_path_factory, lora_cache):
    """test_ddp.py's 1-process run (2 rollout steps, two mini-batches per PPO epoch, 2 PPO epochs, float32)
    with a LoRA adapter: what the 2-process runs are compared with."""
    from tests.helpers.cli_runs import train_cli

    return train_cli(tmp_path_factory.mktemp("lora_single"), lora_cache, *LORA_PARALLEL)


@pytest.fixture(scope="module")
def lora_fsdp_run(tmp_path_factory, lora_cache, lora_single_run):
    """The same on 2 CPU processes under FSDP2, also writing actor_merged/."""
    from tests.helpers.cli_runs import STRATEGIES, train_cli

    out = tmp_path_factory.mktemp("lora_fsdp")
    return train_cli(out, lora_cache, *LORA_PARALLEL, *STRATEGIES["fsdp"], "model.lora.save_merged=true")


@pytest.mark.slow
def test_two_ddp_processes_train_the_same_adapter_as_one(tmp_path, lora_cache, lora_single_run):
    """test_ddp.py's comparison on a LoRA run: each rank keeps its frozen base and its own engine, and syncs its own
    adapter; 2 CPU processes under DDP end with the adapter 1 process ends with."""
    from tests.helpers import rollout_step_rows
    from tests.helpers.cli_runs import DDP, train_cli

    two = train_cli(tmp_path / "ddp", lora_cache, *LORA_PARALLEL, *DDP)
    assert_same_adapter(lora_single_run, two)
    for run in (lora_single_run, two):
        rows = rollout_step_rows(run / "metrics.csv")
        assert all(float(r["perf/weight_sync_bytes"]) < 1e6 for r in rows)  # the adapter alone


@pytest.mark.slow
def test_two_fsdp_processes_train_the_same_adapter_as_one(lora_single_run, lora_fsdp_run):
    """`strategy=fsdp strategy.devices=2` with model.lora: the frozen base sharded, the adapter gathered alone for each
    sync (the bytes pushed are the adapter's, as on one process), 2 CPU processes end with the adapter 1 process ends
    with. The checkpoint holds the trained tensors (adapters, value head) and their AdamW states whole, not the base;
    actor_merged/ (merged on the base loaded again) gives the outputs of actor/ loaded with peft."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.helpers import rollout_step_rows

    adapter = assert_same_adapter(lora_single_run, lora_fsdp_run)
    adapter_bytes = sum(v.numel() * v.element_size() for v in adapter.values())
    for run in (lora_single_run, lora_fsdp_run):
        rows = rollout_step_rows(run / "metrics.csv")
        assert [float(r["perf/weight_sync_bytes"]) for r in rows] == [adapter_bytes] * 2, run
    checkpoint = torch.load(lora_fsdp_run / "checkpoints" / "rollout_step_000002.ckpt", weights_only=False)
    state = checkpoint["state_dict"]
    assert state and all("lora_" in k or ".score." in k for k in state), sorted(state)[:5]
    assert any(k.startswith("critic.") and ".score." in k for k in state)
    actor_adapter = [v for k, v in state.items() if k.startswith("actor.")]
    actor_adam = checkpoint["optimizer_states"][0]["state"].values()  # whole: gathered on rank 0, as the weights
    assert len(actor_adam) == len(actor_adapter)
    assert sum(s["exp_avg"].numel() for s in actor_adam) == sum(v.numel() for v in actor_adapter)
    base_path = json.loads((lora_fsdp_run / "actor" / "adapter_config.json").read_text())["base_model_name_or_path"]
    policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), lora_fsdp_run / "actor").eval()
    merged = AutoModelForCausalLM.from_pretrained(lora_fsdp_run / "actor_merged").eval()
    ids = torch.tensor([[3, 5, 7, 9, 11, 4]])
    with torch.no_grad():
        torch.testing.assert_close(policy(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_a_fsdp_lora_checkpoint_resumes_on_two_ranks_to_the_same_adapter(tmp_path, lora_cache, lora_fsdp_run):
    """The 2-process FSDP run's checkpoint after rollout step 1 (adapters, value head, AdamW states, no base), resumed
    on 2 processes: the base from model_dir, the rest scattered to the ranks' shards; it ends with the adapter of the
    uninterrupted run."""
    import shutil

    from tests.helpers import rollout_step_rows
    from tests.helpers.cli_runs import STRATEGIES, train_cli

    out = tmp_path / "resumed"
    out.mkdir()
    start = shutil.copy(lora_fsdp_run / "checkpoints" / "rollout_step_000001.ckpt", out / "start.ckpt")
    resumed = train_cli(out, lora_cache, *LORA_PARALLEL, *STRATEGIES["fsdp"], f"resume={start}")
    assert [r["rollout_step"] for r in rollout_step_rows(resumed / "metrics.csv")] == ["1", "2"]
    assert not (resumed / "dump" / "rollout_step=000000.rank0.pt").exists()  # step 0 was not redone
    assert_same_adapter(lora_fsdp_run, resumed)


def test_an_adapter_the_engine_does_not_serve_after_the_sync_stops_the_run(lora_engine, monkeypatch):
    """vLLM's worker drops the adapter (here: never adds it): `list_loras()` after the sync does not show the new
    version, and the sync fails in one line instead of sampling from the base."""
    import lit_ppo.rollout.engine as engine_code
    from lit_ppo.errors import WeightSyncError

    monkeypatch.setattr(engine_code, "_load_adapter_from_tensors", lambda worker, version, tensors, config: None)
    config = {"r": RANK, "lora_alpha": 16, "target_modules": ["q_proj"], "bias": "none"}
    with pytest.raises(WeightSyncError, match=r"vLLM serves adapter versions \[\] after loading version 7"):
        lora_engine.sync_adapter({}, config, 7)


def test_resuming_a_lora_run_from_a_checkpoint_without_its_adapter_is_refused(tiny_model_dir):
    from lit_ppo.config import PPOConfig
    from lit_ppo.training.module import PPOModule

    plan = plan_of(64)
    module = PPOModule(model_dir=tiny_model_dir, ppo=PPOConfig(), plan=plan, pad_token_id=0, lora=LoraConfig(rank=8))
    trained = {k: v for k, v in module.state_dict().items() if k not in module.frozen_parameter_names()}
    assert trained and all("lora_" in k or ".score." in k for k in trained)
    checkpoint = {"lit_ppo": {"plan": plan.to_dict()}, "state_dict": {}}  # e.g. written by a full-parameter run
    with pytest.raises(ConfigError, match=r"the checkpoint lacks \d+ trained tensors of this run"):
        module.on_load_checkpoint(checkpoint)


def test_under_fsdp_a_checkpoint_of_other_adapters_is_refused_by_its_plan(tiny_model_dir):
    """Under FSDP Lightning's ModelParallelStrategy loads the tensors before on_load_checkpoint (not strictly: a LoRA
    checkpoint has no base) and takes them out of the checkpoint; the checkpoint's plan must then state this run's
    adapters, or a full-parameter checkpoint would leave the adapters at their initial values without a word."""
    from lit_ppo.config import ModelConfig, PPOConfig
    from lit_ppo.training.module import PPOModule

    lora = LoraConfig(rank=8)
    plan = plan_of(64, model=ModelConfig(lora=lora))
    module = PPOModule(model_dir=tiny_model_dir, ppo=PPOConfig(), plan=plan, pad_token_id=0, lora=lora)
    assert not module.strict_loading  # set before the strategy loads: the frozen base is not in the checkpoint
    for saved in (plan_of(64), plan_of(64, model=ModelConfig(lora=LoraConfig(rank=16)))):
        with pytest.raises(ConfigError, match=r"^the checkpoint was written with the adapters \{'rank': (0|16)"):
            module.on_load_checkpoint({"lit_ppo": {"plan": saved.to_dict()}})  # no "state_dict": loaded already


# ---------------------------------------------------------------- FSDP2: two real gloo processes, no Lightning


class AdapterRecorder(NullEngine):
    """Stands in for the vLLM engine at the weight sync: keeps the adapter it is handed and answers its bytes, as
    `VLLMEngine.update_weights` does."""

    def update_weights(self, update) -> int:
        tensors = update.adapter.tensors
        self.tensors = {k: v.clone() for k, v in tensors.items()}
        return sum(v.numel() * v.element_size() for v in tensors.values())


def _sharded_lora_rank(rank: int, world: int, model_dir: str, out: str) -> None:
    """One rank: PPOModule's LoRA actor and critic under FSDP2 in bf16-mixed (bf16 frozen base, float32 adapter), as
    configure_model shards them; the reference forward first (peft's disable_adapter), one AdamW step of the actor and
    the critic, the weight sync and the final actor/ save. Writes what it saw to rank<N>.pt."""
    import traceback
    from pathlib import Path

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=world)
    report: dict = {}
    try:
        from transformers import AutoTokenizer

        from lit_ppo.config import PPOConfig
        from lit_ppo.distributed import shard_models
        from lit_ppo.run.train import save_lora_policy
        from lit_ppo.training.batching import pack
        from lit_ppo.training.models import adapter_tensors, critic_values
        from lit_ppo.training.module import PPOModule

        torch.manual_seed(0)  # the same adapter initialisation on every rank, as the run's seed_everything gives
        plan = plan_of(64, precision="bf16-mixed", dp=world)
        module = PPOModule(model_dir=model_dir, ppo=PPOConfig(), plan=plan, pad_token_id=0, lora=LoraConfig(rank=RANK))
        report["whole_adapter"] = adapter_tensors(module.actor)  # before sharding: plain tensors
        shard_models((module.actor, module.critic, None), init_device_mesh("cpu", (world,)), bf16_mixed=True)
        module.sharded = True
        base = {k: v.to_local().clone() for k, v in module.actor.state_dict().items() if "lora_" not in k}

        mb = pack([[3, 5, 7, 9, 11], [4, 6, 8]], [[12, 13, 14], [15, 16, 17]], 0, torch.device("cpu"))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            reference_before = module.reference_logprobs(mb)  # the models' first forward: the adapter disabled
        trained = [p for m in (module.actor, module.critic) for p in m.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=1e-2, weight_decay=0.0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = -module.response_logprobs(module.actor, mb).sum() + critic_values(module.critic, mb).square().sum()
        loss.backward()
        report["grad_dtypes"] = sorted({str(p.grad.dtype) for p in trained if p.grad is not None})
        report["grads"] = sum(p.grad is not None for p in trained), len(trained)
        optimizer.step()

        gathered_bytes: list[int] = []
        full_tensor = DTensor.full_tensor

        def counting(self, *args, **kwargs):
            whole = full_tensor(self, *args, **kwargs)
            gathered_bytes.append(whole.numel() * whole.element_size())
            return whole

        DTensor.full_tensor = counting
        engine = AdapterRecorder()
        module.sync_weights(engine, version=1)
        DTensor.full_tensor = full_tensor
        report["synced"] = engine.tensors
        report["sync_bytes"] = module.last_sync_bytes
        report["gathered_bytes"] = sum(gathered_bytes)

        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            report["reference_unchanged"] = torch.equal(module.reference_logprobs(mb), reference_before)
            report["policy_moved"] = not torch.equal(module.response_logprobs(module.actor, mb), reference_before)
        after = {k: v.to_local() for k, v in module.actor.state_dict().items() if "lora_" not in k}
        report["base_unchanged"] = all(torch.equal(after[k], v) for k, v in base.items())
        report["base_dtypes"] = sorted({str(v.dtype) for v in base.values()})
        # What Lightning's ModelParallelStrategy gathers for a checkpoint (its options): the trained tensors only.
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        report["checkpointed"] = {k: tuple(v.shape) for k, v in get_model_state_dict(module, options=options).items()}
        report["trained_shapes"] = {
            f"{m}.{k}": tuple(p.shape)
            for m in ("actor", "critic")
            for k, p in getattr(module, m).named_parameters()
            if p.requires_grad
        }
        state = module.saved_actor_state()
        if rank == 0:
            save_lora_policy(module.actor, AutoTokenizer.from_pretrained(model_dir), Path(out), False, adapter=state)
        report["error"] = None
    except Exception:  # reported to the test, which runs in the parent
        report["error"] = traceback.format_exc()
    torch.save(report, f"{out}/rank{rank}.pt")
    # Both ranks end together: a rank tearing its gloo group down while the other still writes the final actor raced
    # at exit (`terminate called without an active exception`, SIGABRT, once in a suite run with AVX2 kernels).
    dist.barrier()
    dist.destroy_process_group()


def test_fsdp_shards_the_lora_actor_and_syncs_only_the_gathered_adapter(tiny_model_dir, tmp_path):
    """Two CPU processes (gloo) shard the LoRA actor and critic with FSDP2 under bf16-mixed, the frozen base in bf16
    and the adapter and value head in float32 in the same units. The reference (adapter disabled) is the first
    forward; a backward and an AdamW step give float32 gradients for every trained tensor and leave the base bitwise
    as loaded. A checkpoint gathers the trained tensors and no base tensor. The weight sync gathers the adapter's
    tensors and nothing else (the bytes `DTensor.full_tensor` gathers are the adapter's, `perf/weight_sync_bytes`),
    whole and the same on both ranks; the final actor/ is written from them and loads with peft."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    start_ranks(_sharded_lora_rank, 2, 2, tiny_model_dir, str(tmp_path))
    reports = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for report in reports:
        assert report["error"] is None, report["error"]
        assert report["grad_dtypes"] == ["torch.float32"] and report["grads"][0] == report["grads"][1] > 0
        assert report["reference_unchanged"] and report["policy_moved"] and report["base_unchanged"]
        assert report["base_dtypes"] == ["torch.bfloat16"]
        synced = report["synced"]
        assert synced.keys() == report["whole_adapter"].keys() and all("lora_" in k for k in synced)
        adapter_bytes = sum(v.numel() * v.element_size() for v in synced.values())
        assert report["sync_bytes"] == report["gathered_bytes"] == adapter_bytes
        for name, whole in report["whole_adapter"].items():
            assert synced[name].shape == whole.shape and not hasattr(synced[name], "to_local")
            if "lora_A" in name:  # B starts at zero, so A has no gradient at the first step: the gathered A is A
                assert torch.equal(synced[name], whole), name
        assert any(float(v.abs().max()) > 0 for k, v in synced.items() if "lora_B" in k)  # B trained
    for name, tensor in reports[0]["synced"].items():
        assert torch.equal(tensor, reports[1]["synced"][name]), name
    # A checkpoint gathers onto rank 0 the adapters and the value head, whole, and no base tensor.
    assert reports[0]["checkpointed"] == reports[0]["trained_shapes"] and reports[1]["checkpointed"] == {}
    assert any(".score." in k for k in reports[0]["checkpointed"])
    saved = load_file(tmp_path / "actor" / "adapter_model.safetensors")
    assert saved.keys() == reports[0]["synced"].keys()
    assert all(torch.equal(saved[k], v) for k, v in reports[0]["synced"].items())
    policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "actor")
    loaded = {k.replace(".default", ""): v for k, v in policy.state_dict().items() if "lora_" in k}
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], v) for k, v in saved.items())
