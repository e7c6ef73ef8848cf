"""What a run prints, and where everything else goes.

The console shows lit-ppo's own output: the step plan, one progress bar, the eval samples, lit-ppo's
messages and the finish line. Every record of every library (Lightning, transformers, vLLM, torch,
Python warnings) goes to `<run>/logs/run.log` in one format, with lit-ppo's own lines; other libraries'
records reach the console only at ERROR, or all of them with `verbose=true`. vLLM's engine start also
writes straight to file descriptor 2 from C++ (NUMA binding, tcmalloc/libiomp hints) and draws loading
bars: `quiet_stderr` sends fd 2 to the log file while the engine starts.

`setup_logging` is called once per run by `train.py`; code that runs without it (tests, notebooks)
keeps Python's and pytest's logging untouched, and `show` still prints.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from tqdm.auto import tqdm

FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
CONSOLE_FORMAT = "%(levelname)s %(name)s: %(message)s"  # FILE_FORMAT without the time
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
OURS = "lit_ppo"
SHOWN = "lit_ppo.console"  # records of what `show` already printed: for run.log only
_log_file: Path | None = None
_verbose = False


def run_log_path(output_dir: Path, rank: int = 0) -> Path:
    return Path(output_dir) / "logs" / ("run.log" if rank == 0 else f"run.rank{rank}.log")


class _ConsoleFilter(logging.Filter):
    """lit-ppo's records (INFO and up; WARNING and up on ranks > 0, which repeat rank 0), other
    libraries' at ERROR and up; everything with verbose."""

    def __init__(self, verbose: bool, rank: int):
        super().__init__()
        self.verbose, self.rank = verbose, rank

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == SHOWN or getattr(record, "console", True) is False:  # shown already, or run.log only
            return False
        if self.verbose:
            return True
        if record.name == OURS or record.name.startswith(OURS + "."):
            return record.levelno >= (logging.INFO if self.rank == 0 else logging.WARNING)
        return record.levelno >= logging.ERROR


class _ConsoleFormatter(logging.Formatter):
    """lit-ppo's INFO lines as plain text; anything else with its level and logger (FILE_FORMAT without the time)."""

    def __init__(self):
        super().__init__(CONSOLE_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        if record.levelno == logging.INFO and (record.name == OURS or record.name.startswith(OURS + ".")):
            return record.getMessage()
        return super().format(record)


class _TqdmHandler(logging.StreamHandler):
    """Writes through tqdm, so a line printed under the progress bar does not break it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


class _RotaryReloadFilter(logging.Filter):
    """vLLM's in-place reload (`reload_weights`) counts every tensor of a layer as loadable, buffers too.
    Its RotaryEmbedding holds only `cos_sin_cache`, a non-persistent buffer computed from the config that no
    checkpoint contains (Hugging Face's counterpart, `inv_freq`, is left out of state_dicts too), so after
    every weight sync vLLM logs `RotaryEmbedding: Failed to load weights` and puts the computed cache back,
    unchanged. Every real tensor is loaded: tests/test_console.py counts them. The record is kept, as DEBUG
    (below the INFO level of run.log)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "%s: Failed to load weights" and str(record.args[0] if record.args else "").endswith(
            "RotaryEmbedding"
        ):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


ROTARY_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def _install_library_filters() -> None:
    logger = logging.getLogger(ROTARY_RELOAD_LOGGER)
    if not any(isinstance(f, _RotaryReloadFilter) for f in logger.filters):
        logger.addFilter(_RotaryReloadFilter())


def setup_logging(output_dir: Path, *, verbose: bool = False, rank: int = 0) -> Path:
    """Route every log record of this process to `<output_dir>/logs/run.log` and lit-ppo's to the console.

    Safe to call again (a sweep's next job): the previous run's handlers are replaced."""
    global _log_file, _verbose
    # vLLM otherwise installs its own handler and format on the `vllm` logger when it starts.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    path = run_log_path(output_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    for handler in list(root.handlers):  # Hydra's console and file handlers, or the previous job's
        root.removeHandler(handler)
        handler.close()
    root.setLevel(logging.INFO)  # DEBUG would be thousands of lines (matplotlib's font search alone)
    file_handler = logging.FileHandler(path, encoding="utf-8")
    file_handler.setFormatter(logging.Formatter(FILE_FORMAT, DATE_FORMAT))
    file_handler.setLevel(logging.INFO)
    console = _TqdmHandler(sys.stdout)
    console.setFormatter(_ConsoleFormatter())
    console.addFilter(_ConsoleFilter(verbose, rank))
    root.addHandler(file_handler)
    root.addHandler(console)
    logging.getLogger(OURS).setLevel(logging.INFO)
    logging.captureWarnings(True)  # warnings.warn(...) -> the `py.warnings` logger -> run.log
    _log_file, _verbose = path, verbose
    adopt_library_loggers()
    return path


def adopt_library_loggers() -> None:
    """Make libraries that print through handlers of their own hand their records to the root logger
    instead: one format, one place. Lightning adds its `INFO: ...` handler whenever `lightning` is
    imported, so the training code calls this again after its imports. A no-op without `setup_logging`."""
    if _log_file is None:
        return
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name == OURS or name.startswith(OURS + ".") or not isinstance(logger, logging.Logger):
            continue
        for handler in list(logger.handlers):
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                logger.removeHandler(handler)
        logger.propagate = True
    if "transformers" in sys.modules:  # not imported for mode=plan, which stays light
        import transformers.utils.logging as hf_logging

        hf_logging.disable_default_handler()  # added lazily on first use, hence through its own API
        hf_logging.enable_propagation()
        if not _verbose:
            hf_logging.disable_progress_bar()  # "Loading weights" bars for every from_pretrained
    _install_library_filters()


def _keep(level: int, text: str) -> None:
    """`text`, already printed, into run.log; nowhere before any handler is set up (a signal while Hydra composes the
    config), where Python's last-resort handler would print it a second time."""
    logger = logging.getLogger(SHOWN)
    if logger.hasHandlers():
        logger.log(level, text)


def show(text: str) -> None:
    """Print lit-ppo's own output (plan table, eval samples, finish line) and keep it in run.log."""
    tqdm.write(text, file=sys.stdout)  # through tqdm: the progress bar stays intact
    _keep(logging.INFO, text)


def end_progress_bars() -> None:
    """Close the progress bars still drawn where they stand (left on screen, their line ended): the line printed next
    starts on a line of its own, and no bar is drawn again under it. For the lines that end a run (an error, the
    preemption line)."""
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def show_error(text: str) -> None:
    """One line for an error the user can fix, on stderr (on a line of its own, the progress bar ended), and in
    run.log."""
    end_progress_bars()
    print(text, file=sys.stderr, flush=True)
    _keep(logging.ERROR, text)


def printed_by(source: str) -> Callable[[str], None]:
    """What becomes of a line that user code (`source`: "reward function mod.fn") printed (`capture_prints`): shown
    on the console as printed, under the progress bar, and kept in run.log naming `source`."""
    console = sys.stdout  # taken before capture_prints replaces it

    def printed(line: str) -> None:
        tqdm.write(line, file=console)
        _keep(logging.INFO, f"{source} printed: {line}")

    return printed


class _PrintedLines(io.TextIOBase):
    """sys.stdout while user code runs (`capture_prints`): hands on each whole line written to it."""

    def __init__(self, on_line: Callable[[str], None], replaced):
        self.on_line, self.replaced, self.pending = on_line, replaced, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            self.on_line(line)
        return len(text)

    def finish(self) -> None:
        if self.pending:  # print(..., end="") with no line after it
            self.on_line(self.pending)
            self.pending = ""

    def fileno(self) -> int:  # a child process given sys.stdout writes to the console itself, not through here
        return self.replaced.fileno()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:
        return getattr(self.replaced, "encoding", None) or "utf-8"


@contextlib.contextmanager
def capture_prints(on_line: Callable[[str], None]):
    """sys.stdout during the block (user code: a reward function's print() calls) goes to `on_line`, a line at a
    time: `printed_by(...)` in this process; a reward worker sends its lines to the trainer, which shows and keeps
    them so. Without it such prints reach the console but not run.log, and break the progress bar's line."""
    replaced = sys.stdout
    capture = _PrintedLines(on_line, replaced)
    sys.stdout = capture
    try:
        yield
    finally:
        sys.stdout = replaced
        capture.finish()


@contextlib.contextmanager
def quiet_stderr():
    """Send file descriptor 2 (C/C++ libraries' direct writes, other libraries' loading bars) to run.log
    for the duration; nothing changes without `setup_logging` or with verbose. Our one-line errors are
    printed after this block has restored fd 2."""
    if _log_file is None or _verbose:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    target = os.open(_log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(target, 2)
    os.close(target)
    try:
        yield
    finally:
        sys.stderr.flush()
        with contextlib.suppress(Exception):
            ctypes.CDLL(None).fflush(None)  # C stdio's buffered stderr writes, into the file
        os.dup2(saved, 2)
        os.close(saved)
