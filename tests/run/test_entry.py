"""lit_ppo/run/entry.py: what train.py says of an override whose key the composed config lacks (issue 55 item 17:
Hydra's "To append to your config use +key=value" for a misspelt key, which the `+` only moved to the typed config's
unknown-key error, and for `data.path` with data=arithmetic, which the `+` would have let through unused)."""

from __future__ import annotations

import pytest

from lit_ppo.errors import ConfigError
from lit_ppo.run.entry import check_override_keys
from tests.helpers.cli_runs import train_py


@pytest.mark.parametrize(
    "override, line",
    [
        (
            "rollout.tempreature=0.5",
            "rollout.tempreature is not a setting (did you mean rollout.temperature?); fix: rollout.temperature=0.5",
        ),
        (
            "rollout.workers.cuont=2",
            "rollout.workers.cuont is not a setting (did you mean rollout.workers.count?); fix: rollout.workers.count=2",
        ),
        ("ppo.kl_cof=0.1", "ppo.kl_cof is not a setting (did you mean ppo.kl_coef?); fix: ppo.kl_coef=0.1"),
        ("seeed=1", "seeed is not a setting (did you mean seed?); fix: seed=1"),
        (
            "data.path=train.jsonl",
            "data.path is a setting of data=file and data=gsm8k only, not of this run's data config; fix: data=file "
            "data.path=train.jsonl",
        ),
        ("reward.fn.max_chars=100", "reward.fn has no key max_chars here; fix: +reward.fn.max_chars=100 adds it"),
        (
            "model.warm_start.tool_call_rate=0.2",
            "model.warm_start.tool_call_rate is a setting this run's config does not list; fix: "
            "+model.warm_start.tool_call_rate=0.2 adds it",
        ),
    ],
)
def test_a_key_the_config_lacks_is_refused_saying_what_it_is(override, line):
    with pytest.raises(ConfigError) as refused:
        check_override_keys(["mode=plan", override, "hydra.run.dir=/tmp/x"])
    assert str(refused.value) == line


def test_a_key_under_an_old_rollout_key_set_as_a_value_in_a_yaml_names_that_yaml_key(tmp_path):
    """An experiment file of the last release with `rollout.workers: 2` and `rollout.workers.count=4` on the command
    line: Hydra's "use +" would fail too (rollout.workers is a number there)."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "old.yaml").write_text("# @package _global_\nrollout:\n  workers: 2\n")
    with pytest.raises(ConfigError) as refused:
        check_override_keys([f"hydra.searchpath=[file://{tmp_path}]", "+experiment=old", "rollout.workers.count=4"])
    assert str(refused.value) == (
        "rollout.workers.count=4: a YAML of this run sets rollout.workers: 2, the last release's key for "
        "rollout.workers.count; fix: write rollout.workers.count there (rollout.workers: {count: 2})"
    )


def test_overrides_the_config_has_and_hydras_other_errors_pass_to_hydra():
    check_override_keys(["rollout.temperature=0.5", "data=file", "data.path=train.jsonl", "+reward.fn.max_chars=1"])
    check_override_keys(["ppo=grop"])  # Hydra names the options of the group itself
    check_override_keys(["-m", "rollout.tempreature=0.5,0.6"])  # a sweep: Hydra's own run


def test_train_py_says_it_in_one_line_and_exits_2(tmp_path):
    proc = train_py(tmp_path, "mode=plan", "rollout.tempreature=0.5", f"output_dir={tmp_path}")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "error: rollout.tempreature is not a setting (did you mean rollout.temperature?); fix: rollout.temperature=0.5"
    ]
