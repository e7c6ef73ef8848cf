"""The console's pieces on their own: the log routing, and the weight sync that vLLM's rotary message is about.
(The whole console of a `python train.py` run is checked in tests/end_to_end/test_train.py.)"""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace

import pytest
import torch
from tqdm.auto import tqdm

from lit_ppo import console
from lit_ppo.console import capture_prints, printed_by, setup_logging, show, show_error
from lit_ppo.contract import GenerateRequest
from lit_ppo.rewards import RewardScorer
from lit_ppo.topology import RankTopology


def _record_loads(worker):
    """Inside vLLM's worker: wrap the model's load_weights to record what a reload consumed and loaded."""
    model = worker.model_runner.get_model()
    original = model.load_weights

    def recording(weights):
        consumed = []

        def counted():
            for name, tensor in weights:
                consumed.append(name)
                yield name, tensor

        loaded = original(counted())
        model.lit_ppo_record = (
            consumed,
            sorted(loaded),
            sorted(name for name, _ in model.named_parameters()),
            sorted({type(m).__name__ for m in model.modules() if "Rotary" in type(m).__name__}),
            sorted(name for name, _ in model.named_buffers()),
        )
        return loaded

    model.load_weights = recording


def _read_record(worker):
    model = worker.model_runner.get_model()
    del model.load_weights  # the class's method again
    return model.lit_ppo_record


def test_weight_sync_loads_every_actor_tensor_and_the_rotary_message_is_debug(engine, tiny_model_dir, caplog):
    """Every tensor of the actor's state_dict reaches vLLM and every vLLM parameter is loaded; the layer
    vLLM reports as `RotaryEmbedding: Failed to load weights` holds only its computed cos/sin cache."""
    from transformers import AutoModelForCausalLM

    from lit_ppo.console import ROTARY_RELOAD_LOGGER, _install_library_filters

    actor = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    state = actor.state_dict()
    # Hugging Face keeps the rotary inv_freq out of state_dicts (a non-persistent buffer): nothing to skip.
    assert not [name for name in state if "rotary" in name or "inv_freq" in name]
    _install_library_filters()
    engine.llm.collective_rpc(_record_loads)
    with caplog.at_level(logging.DEBUG, logger=ROTARY_RELOAD_LOGGER):
        engine.sync_weights(state.items())
    consumed, loaded, parameters, rotary_classes, buffers = engine.llm.collective_rpc(_read_record)[0]
    assert consumed == list(state)  # the count: every state-dict tensor, in order
    assert set(parameters) <= set(loaded)  # every vLLM parameter (q/k/v and gate/up merged) was loaded
    assert rotary_classes and all(b.endswith("cos_sin_cache") for b in buffers if "rotary" in b)
    rotary = [r for r in caplog.records if r.getMessage().endswith("RotaryEmbedding: Failed to load weights")]
    assert rotary and all(r.levelno == logging.DEBUG for r in rotary)  # explained, kept out of the console and run.log
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
    # and the engine now generates with the actor's weights
    ids = [[3, 4, 5]]
    greedy = engine.generate(GenerateRequest(ids, n=1, temperature=0.0, top_p=1.0, max_tokens=3, seeds=None))[
        0
    ].token_ids
    with torch.no_grad():
        expected = actor.generate(torch.tensor(ids), max_new_tokens=3, do_sample=False)[0, 3:].tolist()
    assert greedy == expected[: len(greedy)]


@pytest.fixture
def run_log(tmp_path):
    """`setup_logging` as train.py calls it, into tmp_path; pytest's logging put back after."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    path = setup_logging(tmp_path)
    yield path
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(False)
    console._log_file = None


def test_an_error_line_starts_on_a_line_of_its_own_and_ends_the_progress_bar(capsys, run_log):
    """The one-line error was printed onto the progress bar's line ("rollout steps: 50%|...| 2/4 error: ...")."""
    bar = tqdm(total=4, desc="rollout steps", file=sys.stderr)
    bar.update(2)
    show_error("error: the reward failed")
    err = capsys.readouterr().err
    assert err.endswith("\nerror: the reward failed\n") and "2/4" in err, repr(err)
    assert bar.disable  # closed: nothing draws it again under the line
    assert "ERROR lit_ppo.console: error: the reward failed" in run_log.read_text()


def test_the_preemption_line_comes_after_the_ended_bar_which_is_not_drawn_again(capsys):
    """The preemption line (Preemption._stop, from on_exception) was followed by the bar drawn again under it: the
    progress bar's own on_exception, which runs first, ends it."""
    from lit_ppo.run.train import RolloutProgressBar

    progress = RolloutProgressBar(total=4)
    progress.on_train_start(None, SimpleNamespace(rollout_step=2, topology=RankTopology()))
    progress.on_exception(None, None, SystemExit(143))
    assert "2/4" in capsys.readouterr().err
    show("preempted by SIGTERM: stopped after rollout step 2 of 4; ...")
    out, err = capsys.readouterr()
    assert out == "preempted by SIGTERM: stopped after rollout step 2 of 4; ...\n" and err == ""


def chatty(prompts, responses, references, extras):
    for response in responses:
        print("scoring", response)
    print("done", end="")  # an unfinished line is kept too
    return [1.0] * len(responses)


def test_what_a_reward_function_prints_reaches_the_console_and_the_run_log(capsys, run_log):
    """print() in a reward function reached the console only: not run.log, where a run's record is kept."""
    assert RewardScorer(fn=chatty)(["p", "q"], ["a", "b"], [None] * 2, [{}] * 2, [False] * 2) == [1.0, 1.0]
    assert capsys.readouterr().out.splitlines()[-3:] == ["scoring a", "scoring b", "done"]
    logged = [line.split(" INFO lit_ppo.console: ", 1)[-1] for line in run_log.read_text().splitlines()]
    name = f"reward function {__name__}.chatty"
    assert [f"{name} printed: {text}" for text in ("scoring a", "scoring b", "done")] == logged[-3:]


def test_capture_prints_hands_on_whole_lines_and_puts_stdout_back(capsys):
    lines = []
    stdout = sys.stdout
    with capture_prints(lines.append):
        print("a", "b")
        sys.stdout.write("c")
        sys.stdout.write("d\ne\n")
        assert sys.stdout is not stdout
    assert sys.stdout is stdout and lines == ["a b", "cd", "e"] and capsys.readouterr().out == ""
    with capture_prints(printed_by("reward function f")):
        print("shown")
    assert capsys.readouterr().out == "shown\n"
