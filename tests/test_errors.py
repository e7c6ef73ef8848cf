"""Every error a user can act on is a `UserError` (train.py prints those as one line), keeping its built-in base."""

from __future__ import annotations

import inspect

import lit_ppo.errors as errors
from lit_ppo.errors import ConfigError
from lit_ppo.rewards import RewardError
from lit_ppo.rollout.prompts import DataError


def test_every_user_error_has_the_one_base_and_keeps_its_builtin_one():
    classes = {name: cls for name, cls in inspect.getmembers(errors, inspect.isclass) if cls is not errors.UserError}
    assert {"ConfigError", "DataError", "RewardError", "StepAccountingError", "NonFiniteUpdatesError"} <= set(classes)
    for name, cls in classes.items():
        assert issubclass(cls, errors.UserError), name
        assert issubclass(cls, (ValueError, RuntimeError)), name  # what code catching the built-ins relies on
    assert issubclass(errors.ConfigError, ValueError) and issubclass(errors.RewardError, RuntimeError)
    # The old import places name the same classes.
    assert (ConfigError, DataError, RewardError) == (errors.ConfigError, errors.DataError, errors.RewardError)


def test_train_py_catches_the_one_base():
    source = errors.__file__.rsplit("lit_ppo", 1)[0] + "train.py"
    text = open(source).read()
    assert "except UserError" in text


def test_first_line_is_what_a_one_line_error_quotes_of_a_library_s():
    """`first_line`, the one reading of an exception's message that the one-line errors quote (the pre-flight's, the
    teacher's tokenizer, the workers' store): its first line stripped, or the default where it says nothing."""
    assert errors.first_line(OSError("\n  Repository not found\nRequest ID: 12\n")) == "Repository not found"
    assert errors.first_line(OSError("  \n"), "OSError") == "OSError"
    assert errors.first_line(RuntimeError(), "RuntimeError") == "RuntimeError" and errors.first_line(ValueError()) == ""
