"""lit_ppo.signals on its own: the handler outside the rollout steps (while train.py imports its libraries too), and
how a KeyboardInterrupt raised by code is told from a Ctrl-C. (Real signals to `python train.py`: tests/test_preemption.py.)"""

from __future__ import annotations

import os
import signal
import time

import pytest

from lit_ppo import signals


@pytest.fixture
def handlers():
    """The process's handlers of the preemption signals, put back after the test; the process at its start-up (an
    in-process run of an earlier test leaves it at its final writes)."""
    previous = {signum: signal.getsignal(signum) for signum in signals.PREEMPTION_SIGNALS}
    signals.starting()
    yield
    for signum, handler in previous.items():
        signal.signal(signum, handler)
    signals._write_line_on = None


def stopped_by(signum: int) -> signals.Stopped:
    with pytest.raises(signals.Stopped) as info:
        os.kill(os.getpid(), signum)
        time.sleep(5)  # the handler raises here, at once
    return info.value


def test_during_the_imports_the_handler_prints_the_line_itself_on_rank_zero_only(handlers, capfd):
    """A `Stopped` raised out of an import statement of train.py reaches no code that prints its line."""
    signals.handle_signals_during_imports(rank_zero=True)
    stopped = stopped_by(signal.SIGTERM)
    assert stopped.code == 143 and stopped.shown
    assert (
        stopped.line.startswith("stopped by SIGTERM during start-up") and capfd.readouterr().err == stopped.line + "\n"
    )
    signals.handle_signals_during_imports(rank_zero=False)
    stopped = stopped_by(signal.SIGINT)
    assert stopped.code == 130 and stopped.shown and capfd.readouterr().err == ""
    signals.handle_signals_outside_training()  # after the imports: train.py prints the line (console.show_error)
    stopped = stopped_by(signal.SIGTERM)
    assert stopped.code == 143 and not stopped.shown and capfd.readouterr().err == ""


def test_a_keyboard_interrupt_is_code_s_while_sigint_has_another_handler_than_pythons(handlers):
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # (pytest leaves Python's)
    assert not signals.raised_by_code(KeyboardInterrupt())  # it may be a real Ctrl-C
    signals.handle_signals_outside_training()
    assert signals.raised_by_code(KeyboardInterrupt()) and not signals.raised_by_code(ValueError())
