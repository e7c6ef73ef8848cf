"""What a vLLM server as a rollout worker runs with (lit_ppo/rollout/workers/server_settings.py): the command that
starts one by hand, and a given server's /server_info compared with what the run's workers need."""

from __future__ import annotations

import json

from lit_ppo.rollout.workers.server_settings import server_arguments, server_command_line, server_mismatch
from tests.helpers import ROOT
from tests.helpers.servers import BY_HAND, model_folder

RECORDED_SERVER_INFO = ROOT / "tests" / "fixtures" / "server_info" / "cpu_auto_dtype.json"


def recorded_server_info(model_dir: str, **changes) -> dict:
    """The recorded /server_info of a CPU server started without --dtype (vLLM's auto: bfloat16), serving `model_dir`;
    `changes`: "section.key" -> value over it."""
    info = json.loads(RECORDED_SERVER_INFO.read_text())
    info["vllm_config"]["model_config"]["model"] = model_dir
    for where, value in changes.items():
        section, key = where.split(".")
        info["vllm_config"][section][key] = value
    return info


def test_a_given_server_of_another_dtype_or_setting_is_named_with_both_values_and_the_flag(tmp_path, caplog):
    """What a given server runs with (its /server_info, recorded from a real CPU server started without --dtype) is
    compared with what the run's workers need: the plan's vLLM dtype (vLLM's auto picked bfloat16 where the run
    samples in float32), the model (architecture, shapes, vocabulary, from both config.json), chunked prefill on CPU,
    the generation config. One line naming the setting, both values and the `vllm serve` flag; nothing where all agree
    (the same server is right for a bfloat16 run)."""
    ours = model_folder(tmp_path / "ours")
    settings = {"model_dir": ours, "dtype": "float32", "max_model_len": 128}
    assert server_mismatch(recorded_server_info(ours), settings) == (
        "runs with dtype 'bfloat16' where this run's rollout workers need 'float32'; fix: start it with --dtype "
        "float32 (docs/async.md gives the whole command)"
    )
    assert server_mismatch(recorded_server_info(ours), {**settings, "dtype": "bfloat16"}) is None
    chunked = recorded_server_info(ours, **{"scheduler_config.enable_chunked_prefill": True})
    assert server_mismatch(chunked, {**settings, "dtype": "bfloat16"}).startswith(
        "runs with enable_chunked_prefill True where this run's rollout workers need False; fix: start it with "
        "--no-enable-chunked-prefill"
    )
    generation = recorded_server_info(ours, **{"model_config.generation_config": "auto"})
    assert "fix: start it with --generation-config vllm" in server_mismatch(generation, {**settings, "dtype": "bf16"})
    # Another model: named before any setting, by the keys that differ.
    other = model_folder(tmp_path / "other", hidden_size=128, vocab_size=151936)
    assert server_mismatch(recorded_server_info(other), settings) == (
        f"serves another model than the run's: {other} (vocab_size 151936, hidden_size 128) where the run's {ours} "
        f"has vocab_size 128, hidden_size 64; fix: start it with --model {ours} (docs/async.md gives the whole command)"
    )
    same_shape = model_folder(tmp_path / "copy")  # another folder of the same model: its settings are compared
    assert server_mismatch(recorded_server_info(same_shape), {**settings, "dtype": "bfloat16"}) is None
    # A path this machine cannot read: one warning naming the server, then the settings are still compared.
    caplog.clear()
    unreadable = recorded_server_info(str(tmp_path / "on-another-node"))
    assert server_mismatch(unreadable, {**settings, "dtype": "bfloat16"}, "vLLM server 0 at http://n1:8000") is None
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        f"trainer: vLLM server 0 at http://n1:8000 serves {tmp_path / 'on-another-node'}, which this machine cannot "
        f"read: its model is not compared with the run's ({ours}); a server of another model fails at the first "
        "weight push"
    ]


def test_the_command_to_start_a_server_by_hand_carries_its_environment_and_quotes_its_json():
    """docs/async.md's command and a spawned server's log line: the variables a server needs (the CPU's KV cache size
    too: without it a CPU server fails with vLLM's memory error), and arguments a shell gives back unchanged."""
    import shlex

    settings = {**BY_HAND, "kv_cache_gib": 2}
    line = server_command_line(settings, 8000, "0.0.0.0")
    assert line.startswith(
        "VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=2 TOKENIZERS_PARALLELISM=false python -m "
        "vllm.entrypoints.openai.api_server --model /models/tiny "
    ), line
    assert shlex.split(line)[6:] == server_arguments(settings, 8000, "0.0.0.0")
