"""The in-process vLLM engine's life cycle: several engines in one process (a LoRA-enabled engine beside the rollout
engine, a sweep's jobs, the test session's shared engine) must not break one another when one of them goes."""

from __future__ import annotations

import gc

from lit_ppo.contract import GenerateRequest


def greedy_tokens(engine) -> list[int]:
    prompt = [5, 9, 12, 7, 3, 14, 6, 11]
    return engine.generate(GenerateRequest([prompt], n=1, temperature=0.0, top_p=1.0, max_tokens=6, seeds=None))[
        0
    ].token_ids


def test_an_engine_that_is_closed_or_collected_leaves_the_other_engines_of_the_process_generating(
    engine, tiny_model_dir
):
    """vLLM's own in-process shutdown destroys the process-wide parallel groups; before lit-ppo's shutdown kept them
    while another engine lived, the shared engine failed here with "pipeline model parallel group is not
    initialized"."""
    from lit_ppo.rollout.engine import VLLMEngine

    # The shared engine holds whatever weights the tests before pushed into it: each engine is compared with itself.
    expected = greedy_tokens(engine)
    second = VLLMEngine(tiny_model_dir, max_model_len=128, seed=0, max_lora_rank=8)
    base = greedy_tokens(second)  # LoRA enabled, no adapter loaded: the base weights (as `fourth` below)
    second.close()
    assert greedy_tokens(engine) == expected
    third = VLLMEngine(tiny_model_dir, max_model_len=128, seed=0)
    finalizer = third._release
    del third  # dropped without close(): its finalizer runs when it is collected
    gc.unfreeze()  # vLLM gc.freeze()s the heap at start; the next engine's close unfreezes it so (the CI failure)
    gc.collect()
    assert not finalizer.alive  # collected and shut down
    assert greedy_tokens(engine) == expected
    fourth = VLLMEngine(tiny_model_dir, max_model_len=128, seed=0)  # engines still start after the others went
    assert greedy_tokens(fourth) == base
    fourth.close()
