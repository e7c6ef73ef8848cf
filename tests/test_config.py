"""The config dataclasses' defaults are the YAML defaults, so code that builds a config without Hydra
(tests, notebooks, bench/) trains what `python train.py` trains."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import yaml

from lit_ppo.config import PPOConfig, RolloutConfig
from lit_ppo.precision import resolve_precision, resolve_rollout_dtype
from lit_ppo.rollout.engine import VLLMEngine
from tests.helpers import CONF, dataclass_defaults


@pytest.mark.parametrize(
    "cls, yaml_file", [(PPOConfig, "ppo/ppo.yaml"), (RolloutConfig, "rollout/vllm.yaml")], ids=["ppo", "rollout"]
)
def test_dataclass_defaults_equal_the_default_yaml(cls, yaml_file):
    from_yaml = yaml.safe_load((CONF / yaml_file).read_text())
    assert dataclass_defaults(cls) == from_yaml  # same keys, same values (a new key needs both)


def test_engine_defaults_equal_the_rollout_config():
    """VLLMEngine built without Hydra (tests, bench/) gets the engine `rollout: vllm` gives."""
    rollout = dataclass_defaults(RolloutConfig)
    engine = {name: p.default for name, p in inspect.signature(VLLMEngine).parameters.items() if name in rollout}
    # rollout.dtype null means "resolved from strategy.precision"; the engine takes the resolved dtype.
    assert engine.pop("dtype") == resolve_rollout_dtype(resolve_precision("32-true", "cpu"), rollout["dtype"])
    assert engine and engine == {name: rollout[name] for name in engine}


def test_configs_and_plan_are_frozen():
    """Everything reads the plan and the configs; nothing may change them after the plan is stated."""
    from lit_ppo.plan import StepPlan

    for cls in (PPOConfig, RolloutConfig, StepPlan):
        assert cls.__dataclass_params__.frozen, cls
    with pytest.raises(dataclasses.FrozenInstanceError):
        PPOConfig().ppo_epochs = 2


# ---------------------------------------------------------------- values read by their field's type (issue 40)


def test_the_yaml_spellings_of_a_boolean_are_read_as_booleans():
    """Hydra passes only true/false as booleans: `off` and `no` arrived as strings, which tested true."""
    from tests.helpers import compose_run_config

    config = compose_run_config(
        "ppo.packing=off", "data.chat_template=no", "ppo.normalize_advantages=No", "model.warm_start.enabled=OFF"
    )
    assert config.ppo.packing is False and config.data.chat_template is False
    assert config.ppo.normalize_advantages is False and config.model.warm_start.enabled is False
    config = compose_run_config("ppo.packing=on", "data.chat_template=yes", "model.warm_start.enabled=true")
    assert config.ppo.packing is True and config.data.chat_template is True and config.model.warm_start.enabled
    assert compose_run_config("ppo.packing=null").ppo.packing is None


def test_numbers_from_strings_are_read_as_their_type():
    from tests.helpers import compose_run_config

    config = compose_run_config("rollout.max_response_tokens='8'", "ppo.actor_lr='1e-6'", "strategy.precision=32")
    assert config.rollout.max_response_tokens == 8 and isinstance(config.rollout.max_response_tokens, int)
    assert config.ppo.actor_lr == 1e-6 and config.strategy.precision == "32"


@pytest.mark.parametrize(
    "override, accepts",
    [
        ("ppo.packing=maybe", "is not true or false (also yes/no, on/off), or null"),
        ("ppo.packing=1", "is not true or false (also yes/no, on/off), or null"),
        ("data.chat_template=nope", "is not true or false (also yes/no, on/off)"),
        ("rollout.max_response_tokens=8.5", "is not an integer >= 1"),
        ("rollout.max_response_tokens=0", "is not an integer >= 1"),
        ("rollout.temperature=hot", "is not a number in [0.01, 2]"),
        ("rollout.temperature=0", "is not a number in [0.01, 2]"),
        ("rollout.temperature=2.5", "is not a number in [0.01, 2]"),
        ("rollout.top_p=0", "is not a number in (0, 1]"),
        ("reward.on_error=skip", "is not one of raise, zero"),
        ("reward.workers=-1", "is not an integer >= 0"),
        ("rollout.stop_token_ids=[1,x]", "is not a list of integers"),
        ("model.lora=5", "is not a mapping of its keys (rank, alpha"),
    ],
)
def test_a_value_its_field_does_not_accept_is_refused_in_one_line(override, accepts):
    from lit_ppo.errors import ConfigError
    from tests.helpers import compose_run_config

    with pytest.raises(ConfigError) as error:
        compose_run_config(override)
    message, key = str(error.value), override.split("=")[0]
    assert message.startswith(f"{key}=") and accepts in message and "fix: " in message and "\n" not in message


def test_coerce_reads_each_type_and_refuses_the_rest():
    from typing import Literal

    from lit_ppo.config_fields import NotAccepted, coerce

    assert [coerce(w, bool) for w in ("yes", "No", "ON", "off", "true", "False", True)] == [
        True, False, True, False, True, False, True,
    ]  # fmt: skip
    assert coerce("8", int) == 8 and coerce(1e3, int) == 1000 and coerce("2", float) == 2.0
    assert coerce(None, int | None) is None and coerce("q_proj", str | list[str]) == "q_proj"
    assert coerce(["q_proj"], str | list[str]) == ["q_proj"] and coerce("zero", Literal["raise", "zero"]) == "zero"
    for value, hint in [
        ("maybe", bool), (1, bool), (8.5, int), (True, int), ("hot", float), (float("nan"), float), (["a"], str),
        (True, str), ("skip", Literal["raise", "zero"]), ("x", list[str]), (None, int),
    ]:  # fmt: skip
        with pytest.raises(NotAccepted):
            coerce(value, hint)


def test_ranges_are_written_beside_their_fields():
    from lit_ppo.config_fields import Range

    ranges = {f.name: f.metadata.get("range") for f in dataclasses.fields(RolloutConfig)}
    assert ranges["temperature"] == Range(0.01, 2, why=ranges["temperature"].why) and 1.0 in ranges["temperature"]
    assert 0 not in ranges["max_response_tokens"] and 1 in ranges["max_response_tokens"]
    assert str(ranges["top_p"]) == "in (0, 1]" and str(ranges["max_response_tokens"]) == ">= 1"


# ---------------------------------------------------------------- rollout.episodes and rollout.workers (issue 35)


@pytest.fixture
def fresh_announcements(monkeypatch):
    """Each test sees the moved keys unannounced (a process announces each once)."""
    import lit_ppo.config.root as root  # where the announced keys are kept

    monkeypatch.setattr(root, "_announced", set())


def test_an_old_flat_rollout_key_on_the_command_line_works_and_is_announced_once(fresh_announcements, capsys):
    from lit_ppo.config import moved_override

    assert moved_override("rollout.worker_launch=external") == "rollout.workers.launch=external"
    assert moved_override("rollout.worker_launch=spawn") == "rollout.workers.launch=spawn"  # a sweep's second value
    assert moved_override("+rollout.environment._target_=x.Env") == "+rollout.episodes.environment._target_=x.Env"
    assert moved_override("rollout.workers=2") == "rollout.workers.count=2"
    assert moved_override("rollout.max_episode_tokens=40") == "rollout.episodes.max_tokens=40"
    # new keys and others pass as they are, unannounced
    for override in ("rollout.workers.count=2", "rollout.episodes.max_turns=3", "rollout.max_staleness=1", "seed=1"):
        assert moved_override(override) == override
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "warning: rollout.worker_launch moved to rollout.workers.launch; the old key works for this release only "
        "(fix: write rollout.workers.launch)",
        "warning: rollout.environment moved to rollout.episodes.environment; the old key works for this release only "
        "(fix: write rollout.episodes.environment)",
        "warning: rollout.workers moved to rollout.workers.count; the old key works for this release only "
        "(fix: write rollout.workers.count)",
        "warning: rollout.max_episode_tokens moved to rollout.episodes.max_tokens; the old key works for this release "
        "only (fix: write rollout.episodes.max_tokens)",
    ]


def test_one_setting_under_its_old_and_new_key_on_the_command_line_with_two_values_is_refused(fresh_announcements):
    """Hydra keeps the later of two overrides of one key without a word: an old key and its new key given two values
    on one command line are refused in one line; the same value twice is fine (issue 55 item 3)."""
    from lit_ppo.config import moved_overrides
    from lit_ppo.errors import ConfigError

    for overrides, line in (
        (
            ["rollout.worker_launch=server", "rollout.workers.launch=external"],
            "rollout.worker_launch=server and rollout.workers.launch=external give rollout.workers.launch two values "
            "(rollout.worker_launch is its old key); fix: give it once, as rollout.workers.launch=<value>",
        ),
        (
            ["rollout.workers.count=4", "seed=1", "rollout.workers=2"],
            "rollout.workers=2 and rollout.workers.count=4 give rollout.workers.count two values (rollout.workers is "
            "its old key); fix: give it once, as rollout.workers.count=<value>",
        ),
        (
            ["+rollout.environment._target_=a.Env", "+rollout.episodes.environment._target_=b.Env"],
            "+rollout.environment._target_=a.Env and +rollout.episodes.environment._target_=b.Env give "
            "rollout.episodes.environment._target_ two values (rollout.environment._target_ is its old key); fix: "
            "give it once, as rollout.episodes.environment._target_=<value>",
        ),
    ):
        with pytest.raises(ConfigError) as refused:
            moved_overrides(overrides)
        assert str(refused.value) == line
    assert moved_overrides(["rollout.worker_launch=external", "rollout.workers.launch=external", "seed=3"]) == [
        "rollout.workers.launch=external",
        "rollout.workers.launch=external",
        "seed=3",
    ]
    # the new key twice is Hydra's own override (the later wins), as for any key
    assert moved_overrides(["rollout.workers.count=2", "rollout.workers.count=3"]) == [
        "rollout.workers.count=2",
        "rollout.workers.count=3",
    ]


def test_the_command_line_wins_over_an_old_rollout_key_in_yaml(fresh_announcements, tmp_path):
    """An experiment file of the last release gives rollout.worker_launch; the command line's rollout.workers.launch
    (even at its default) or rollout.worker_launch wins over it, as any override wins over a YAML value; without a
    command line, the file's two keys with two values are still refused (issue 55 item 3)."""
    import shutil

    from hydra import compose, initialize_config_dir

    from lit_ppo.config import RunConfig, moved_overrides
    from lit_ppo.errors import ConfigError
    from tests.helpers import CONF

    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "experiment" / "old_launch.yaml").write_text("# @package _global_\nrollout:\n  worker_launch: server\n")
    for given, launch in (("rollout.workers.launch=spawn", "spawn"), ("rollout.worker_launch=external", "external")):
        overrides = ["+experiment=old_launch", "rollout.mode=disaggregated", *moved_overrides([given])]
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
        command_line = [override.lstrip("+").partition("=")[0] for override in overrides]
        assert RunConfig.from_hydra(cfg, command_line=command_line).rollout.workers.launch == launch
        if launch == "external":
            with pytest.raises(ConfigError, match="are both set"):
                RunConfig.from_hydra(cfg)  # both in the composed config, no command line: two values
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+experiment=old_launch", "rollout.mode=disaggregated"])
    assert RunConfig.from_hydra(cfg, command_line=["rollout.mode"]).rollout.workers.launch == "server"


def test_old_flat_rollout_keys_in_yaml_work_and_are_announced_once(fresh_announcements, capsys, tmp_path):
    """An experiment file of the last release, composed by Hydra over a copy of conf/: its flat keys land in
    rollout.episodes and rollout.workers, each announced in one line."""
    import shutil

    from hydra import compose, initialize_config_dir

    from lit_ppo.config import RunConfig
    from tests.helpers import CONF

    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "experiment" / "old_keys.yaml").write_text(
        "# @package _global_\n"
        "rollout:\n"
        "  environment: {_target_: lit_ppo.environments.CalculatorEnvironment, call_start: '[', call_end: ']'}\n"
        "  max_turns: 3\n  max_episode_tokens: 40\n  episode_reward: reward\n"
        "  workers: 2\n  worker_launch: external\n  worker_port: 29611\n"
    )
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+experiment=old_keys", "rollout.mode=disaggregated"])
    rollout = RunConfig.from_hydra(cfg).rollout
    assert rollout.episodes.environment["_target_"] == "lit_ppo.environments.CalculatorEnvironment"
    assert (rollout.episodes.max_turns, rollout.episodes.max_tokens, rollout.episodes.reward) == (3, 40, "reward")
    assert (rollout.workers.count, rollout.workers.launch, rollout.workers.port) == (2, "external", 29611)
    assert rollout.workers.batch_timeout_s == 600.0  # the section's other keys keep their defaults
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 7 and all(line.startswith("warning: rollout.") and " moved to " in line for line in err)
    RunConfig.from_hydra(cfg)  # parsed again in the same process (a rank, a worker): not announced again
    assert capsys.readouterr().err == ""


def test_each_engines_old_flat_keys_move_to_its_section_announced_once_and_refused_twice(
    fresh_announcements, capsys, tmp_path
):
    """rollout.kv_cache_gib and the other vLLM-only keys now live in rollout.vllm, rollout.hf_max_batch_sequences in
    rollout.hf: the old keys still work, on the command line and in YAML, each announced once with its new name; given
    both ways with two values, refused in one line."""
    import shutil

    from hydra import compose, initialize_config_dir

    from lit_ppo.config import RunConfig, moved_overrides
    from lit_ppo.errors import ConfigError
    from tests.helpers import CONF

    assert moved_overrides(["rollout.kv_cache_gib=2", "rollout.hf_max_batch_sequences=4", "seed=1"]) == [
        "rollout.vllm.kv_cache_gib=2",
        "rollout.hf.max_batch_sequences=4",
        "seed=1",
    ]
    with pytest.raises(ConfigError) as refused:
        moved_overrides(["rollout.enforce_eager=false", "rollout.vllm.enforce_eager=true"])
    assert str(refused.value) == (
        "rollout.enforce_eager=false and rollout.vllm.enforce_eager=true give rollout.vllm.enforce_eager two values "
        "(rollout.enforce_eager is its old key); fix: give it once, as rollout.vllm.enforce_eager=<value>"
    )
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "experiment" / "old_engine_keys.yaml").write_text(
        "# @package _global_\nrollout:\n  gpu_memory_utilization: 0.6\n  sleep_between_steps: false\n"
        "  hf_max_batch_sequences: 16\n"
    )
    (conf / "experiment" / "both_engine_keys.yaml").write_text(
        "# @package _global_\nrollout:\n  kv_cache_gib: 3\n  vllm:\n    kv_cache_gib: 2\n"
    )
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+experiment=old_engine_keys"])
        both = compose(config_name="config", overrides=["+experiment=both_engine_keys"])
    rollout = RunConfig.from_hydra(cfg).rollout
    assert (rollout.vllm.gpu_memory_utilization, rollout.vllm.sleep_between_steps) == (0.6, False)
    assert rollout.vllm.kv_cache_gib == 1 and rollout.hf.max_batch_sequences == 16
    RunConfig.from_hydra(cfg)  # parsed again: not announced again
    assert capsys.readouterr().err.splitlines() == [
        f"warning: rollout.{old} moved to rollout.{new}; the old key works for this release only (fix: write "
        f"rollout.{new})"
        for old, new in (
            ("kv_cache_gib", "vllm.kv_cache_gib"),
            ("hf_max_batch_sequences", "hf.max_batch_sequences"),
            ("enforce_eager", "vllm.enforce_eager"),
            ("gpu_memory_utilization", "vllm.gpu_memory_utilization"),
            ("sleep_between_steps", "vllm.sleep_between_steps"),
        )
    ]
    with pytest.raises(ConfigError) as refused:
        RunConfig.from_hydra(both)
    assert str(refused.value) == (
        "rollout.kv_cache_gib=3 and rollout.vllm.kv_cache_gib=2 are both set; fix: keep only rollout.vllm.kv_cache_gib"
    )


def test_the_new_nested_rollout_keys_work(fresh_announcements, capsys):
    from tests.helpers import compose_run_config

    config = compose_run_config(
        "rollout.mode=disaggregated",
        "rollout.workers.count=2",
        "rollout.workers.launch=external",
        "rollout.workers.trainer_host=node7",
        "+experiment=tool_arithmetic",
        "rollout.episodes.max_turns=2",
    )
    assert (config.rollout.workers.count, config.rollout.workers.launch) == (2, "external")
    assert config.rollout.workers.trainer_address_host() == "node7"
    assert config.rollout.episodes.max_turns == 2 and config.rollout.episode_tokens() == 40
    assert capsys.readouterr().err == ""  # nothing moved, nothing announced


@pytest.mark.parametrize(
    "overrides",
    [
        ["rollout.workers.count=4"],
        ["rollout.workers.launch=external", "rollout.workers.count=4"],
        ["rollout.workers.launch=server", "rollout.workers.server_urls=[http://127.0.0.1:8000]"],
        ["rollout.workers.devices=2"],
        ["rollout.workers.port=29700", "rollout.workers.trainer_host=node7"],
        ["rollout.workers.start_timeout_s=30", "rollout.workers.heartbeat_timeout_s=30"],
        ["rollout.workers.batch_timeout_s=30", "rollout.workers.weight_push_timeout_s=30"],
        ["rollout.workers.weight_push_bucket_mib=64"],
    ],
)
def test_rollout_worker_settings_without_the_disaggregated_mode_are_refused(overrides):
    """Every rollout.workers.* setting off its default with rollout.mode=colocated would be planned and then ignored:
    refused in one line naming them, as rollout.max_staleness is; the same settings with rollout.mode=disaggregated
    are taken (issue 55 item 4)."""
    import dataclasses

    from lit_ppo.config import WorkersConfig
    from lit_ppo.errors import ConfigError
    from tests.helpers import compose_run_config

    with pytest.raises(ConfigError) as refused:
        compose_run_config(*overrides)
    workers = compose_run_config("rollout.mode=disaggregated", *overrides).rollout.workers
    names = [
        f.name
        for f in dataclasses.fields(WorkersConfig)
        if getattr(workers, f.name) != getattr(WorkersConfig(), f.name)
    ]
    assert sorted(names) == sorted(override.split("=")[0].removeprefix("rollout.workers.") for override in overrides)
    given = ", ".join(f"rollout.workers.{name}={getattr(workers, name)}" for name in names)
    assert str(refused.value) == (
        f"{given} with rollout.mode=colocated: the engine in the trainer's process generates, and no rollout worker "
        "would use them; fix: rollout.mode=disaggregated, or remove them"
    )


def test_an_unknown_rollout_key_is_refused_with_the_close_match(fresh_announcements):
    from omegaconf import OmegaConf

    from lit_ppo.config import RunConfig
    from lit_ppo.errors import ConfigError
    from tests.helpers import compose_config

    for section, wrong, right in (("workers", "lanch", "launch"), ("episodes", "max_turn", "max_turns")):
        cfg = compose_config()
        OmegaConf.set_struct(cfg, False)  # as `+rollout.workers.lanch=...` adds it
        cfg.rollout[section][wrong] = 1
        with pytest.raises(
            ConfigError,
            match=rf"unknown key\(s\) rollout\.{section}\.{wrong}; fix: remove them or "
            rf"correct rollout\.{section}\.{wrong} \(did you mean rollout\.{section}\.{right}\?\)",
        ):
            RunConfig.from_hydra(cfg)


def test_a_rollout_key_set_under_its_old_and_new_name_is_refused(fresh_announcements):
    from omegaconf import OmegaConf

    from lit_ppo.config import RunConfig
    from lit_ppo.errors import ConfigError
    from tests.helpers import compose_config

    cfg = compose_config("rollout.workers.launch=external")
    OmegaConf.set_struct(cfg, False)
    cfg.rollout.worker_launch = "spawn"
    with pytest.raises(
        ConfigError, match="rollout.worker_launch='spawn' and rollout.workers.launch='external' are both"
    ):
        RunConfig.from_hydra(cfg)


# ---------------------------------------------------------------- the config package (issue 49)


def test_the_config_is_small_modules_each_section_checked_beside_its_dataclass():
    """lit_ppo/config/ (a 1,257-line config.py before): no module over 500 lines, and each `validate_<x>` in the module
    of the dataclass it checks (its first parameter's type), every name importers use taken from `lit_ppo.config`."""
    import typing

    import lit_ppo.config as config
    from tests.helpers import ROOT

    lengths = {p.name: len(p.read_text().splitlines()) for p in (ROOT / "lit_ppo" / "config").glob("*.py")}
    assert len(lengths) >= 10 and max(lengths.values()) <= 500, lengths
    checks = [getattr(config, name) for name in config.__all__ if name.startswith("validate_")]
    assert len(checks) >= 8
    for check in checks:
        checked = typing.get_type_hints(check)[next(iter(inspect.signature(check).parameters))]
        assert checked.__module__ == check.__module__, f"{check.__name__} checks {checked.__name__}, defined elsewhere"


def test_the_workers_launch_is_read_in_one_module_of_the_config():
    """rollout.workers.launch (six checks across 950 lines of config.py before) is checked in config/workers.py alone:
    no other module of the config reads a `.launch` or a `.spawned`."""
    import ast

    from tests.helpers import ROOT

    readers = {
        path.name
        for path in (ROOT / "lit_ppo" / "config").glob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in ("launch", "spawned")
    }
    assert readers == {"workers.py"}


def _context_parallel_run(section: str | None = None, **settings):
    """A RunConfig with strategy=ddp on 2 ranks, C = 2, and `settings` in `section` (the strategy when None)."""
    from lit_ppo.config import LoraConfig, ModelConfig, PPOConfig, RolloutConfig, RunConfig, StrategyConfig

    strategy = dict(name="ddp", devices=2, context_parallel_size=2)
    sections = {
        "model": lambda: ModelConfig(lora=LoraConfig(**settings.pop("lora", {})), **settings),
        "rollout": lambda: RolloutConfig(**settings),
        "ppo": lambda: PPOConfig(**settings),
    }
    other = {section: sections[section]()} if section else {}
    return RunConfig(strategy=StrategyConfig(**{**strategy, **(settings if section is None else {})}), **other)


@pytest.mark.parametrize(
    "section, settings, message",
    [
        (None, dict(devices=3), r"^strategy.context_parallel_size=2 does not divide the 3 ranks"),
        (None, dict(name="single"), r"^strategy.context_parallel_size=2 with strategy=single is not built; fix"),
        ("rollout", dict(mode="disaggregated"), r"^strategy.context_parallel_size=2 with rollout.mode=disaggregated"),
        (
            "rollout",
            dict(tensor_parallel_size=2),
            r"^strategy.context_parallel_size=2 with rollout.tensor_parallel_size=2 is not built: a context-parallel "
            r"group's rank 0 generates alone",
        ),
    ],
    ids=["ranks", "single", "disaggregated", "tensor-parallel"],
)
def test_context_parallel_size_is_refused_in_one_line_where_not_built(section, settings, message):
    from lit_ppo.errors import ConfigError

    with pytest.raises(ConfigError, match=message) as refused:
        _context_parallel_run(section, **settings)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_context_parallel_size_trains_under_ddp_and_fsdp_with_full_fine_tuning(name):
    config = _context_parallel_run(name=name)
    assert (config.strategy.context_parallel_size, config.strategy.data_parallel_size) == (2, 1)


@pytest.mark.parametrize(
    "section, settings",
    [
        ("model", dict(gradient_checkpointing=True)),
        ("model", dict(lora=dict(rank=8))),
        ("ppo", dict(shared_prefix=True)),
    ],
    ids=["checkpointing", "lora", "shared-prefix"],
)
def test_context_parallel_size_composes_with(section, settings):
    """Built with C > 1 (tests/training/test_context_parallel.py), so not refused."""
    assert _context_parallel_run(section, **settings).strategy.context_parallel_size == 2


def test_context_parallel_size_divides_the_data_parallel_size():
    from lit_ppo.config import StrategyConfig

    assert StrategyConfig(devices=4, num_nodes=2, context_parallel_size=4).data_parallel_size == 2
    assert StrategyConfig(devices=4, num_nodes=2).data_parallel_size == 8


def test_a_model_context_parallelism_cannot_split_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    """The pre-flight reads the model's heads (the tiny model's config here, a checkpoint's config.json otherwise):
    heads not divisible by C are refused in one line before vLLM or the model start, not at the first training
    forward."""
    import transformers

    from lit_ppo.errors import ConfigError
    from lit_ppo.run.prepare import preflight
    from tests.helpers import compose_run_config

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the heads were checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_model)
    cp = ("strategy=ddp", "strategy.devices=2", "strategy.context_parallel_size=2", "model.warm_start.enabled=false")
    with pytest.raises(ConfigError, match=r"^strategy.context_parallel_size=2: the model's 4 attention heads and 1 KV"):
        preflight(compose_run_config(*cp, "model.tiny.num_kv_heads=1"), tmp_path / "run")
    preflight(compose_run_config(*cp), tmp_path / "run")  # 4 heads and 2 KV heads divide by 2
