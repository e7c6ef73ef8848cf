"""The console's pieces on their own: the log routing, and the weight sync that vLLM's rotary message is about.
(The whole console of a `python train.py` run is checked in tests/end_to_end/test_train.py.)"""

from __future__ import annotations

import logging

import torch


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
    greedy = engine.generate(ids, n=1, temperature=0.0, top_p=1.0, max_tokens=3, seeds=None)[0].token_ids
    with torch.no_grad():
        expected = actor.generate(torch.tensor(ids), max_new_tokens=3, do_sample=False)[0, 3:].tolist()
    assert greedy == expected[: len(greedy)]
