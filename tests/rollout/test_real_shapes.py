"""Shapes users run, not the toy: prompts of 100-300 tokens, more sequences in flight than one vLLM scheduler step
takes, temperature != 1, chat templates whose end-of-turn token is not EOS."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from lit_ppo.contract import GenerateRequest
from lit_ppo.rollout.engine import sampling_seeds
from tests.helpers import ROOT, datamodule_on, rollout_step_rows
from tests.helpers.prompts import long_prompts


def test_seeded_generation_survives_prefills_larger_than_one_scheduler_step(tiny_model_dir, engine):
    """48 prompts x ~110 tokens x 2 samples = ~10,500 prefill tokens, more than the CPU engine's 4,096-token
    step: before chunked prefill was turned off on CPU, vLLM split a seeded prefill and crashed rewinding its
    generator ("CPU Generator does not use offset"). Per-prompt seeds still make a prompt's samples the same
    whether it is generated alone or in the big batch (what keeps samples independent of the number of ranks)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = long_prompts(tokenizer, 48, 100, 115)
    assert sum(len(p) for p in prompts) * 2 > 2 * 4096
    seeds = sampling_seeds(0, "real_shapes", range(len(prompts)), 2)
    everything = engine.generate(GenerateRequest(prompts, n=2, temperature=0.7, top_p=1.0, max_tokens=8, seeds=seeds))
    assert len(everything) == 96
    alone = engine.generate(
        GenerateRequest(prompts[40:], n=2, temperature=0.7, top_p=1.0, max_tokens=8, seeds=seeds[40:])
    )
    assert [g.token_ids for g in alone] == [g.token_ids for g in everything[80:]]


def test_end_of_turn_token_is_read_from_the_chat_template(tiny_model_dir):
    """The tiny tokenizer's template is Qwen's shape: turns end with <|im_end|>, which is not its EOS."""
    from lit_ppo.rollout.prompts import end_of_turn_token_ids

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end != tokenizer.eos_token_id
    assert end_of_turn_token_ids(tokenizer) == [im_end]
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"  # writes no special token
    assert end_of_turn_token_ids(tokenizer) == []


def test_chat_prompts_stop_at_the_end_of_turn_token(tiny_model_dir, engine, tmp_path):
    """With data.chat_template=true, responses end at <|im_end|> (not EOS) by default; rollout.stop_token_ids and
    rollout.stop reach vLLM. The model here samples uniformly (zero final norm: all logits 0), so <|im_end|> comes
    up in about one response in six of 24 tokens; without the stop it is followed by invented text."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from lit_ppo.config import RolloutConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for name in ("train", "eval"):
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(
                json.dumps({"prompt": f"Question {i}: what is {i}+{i}?", "answer": str(2 * i)}) + "\n"
                for i in range(16)
            )
        )
    files = [tmp_path / "train.jsonl", tmp_path / "eval.jsonl"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    torch.nn.init.zeros_(model.model.norm.weight)
    engine.sync_weights(model.state_dict().items())
    try:

        def responses(rollout: RolloutConfig, chat_template: bool = True):
            return make_datamodule(tiny_model_dir, engine, files, rollout, chat_template=chat_template).produce_rollout(
                0
            )

        plain = responses(RolloutConfig(max_response_tokens=24, temperature=0.8), chat_template=False)
        assert any(im_end in r[:-1] for r in plain.response_ids)  # the control: runs past the end of turn
        stopped = responses(RolloutConfig(max_response_tokens=24, temperature=0.8))
        ended = [r for r in stopped.response_ids if im_end in r]
        assert len(ended) >= 3 and all(r.index(im_end) == len(r) - 1 for r in ended)
        assert all(not t for r, t in zip(stopped.response_ids, stopped.truncated.tolist()) if im_end in r)
        # Configured stops: a token id, and a string cut from the text.
        stop_a = tokenizer.convert_tokens_to_ids("a")
        configured = responses(
            RolloutConfig(
                max_response_tokens=24, temperature=0.8, stop_token_ids=[stop_a], stop=["b"], stop_at_end_of_turn=False
            )
        )
        assert all(stop_a not in r[:-1] for r in configured.response_ids)
        assert any(r[-1] == stop_a for r in configured.response_ids)
        assert all("b" not in text for text in configured.responses)
    finally:
        engine.sync_weights(original.items())


def make_datamodule(
    model_dir,
    engine,
    files,
    rollout,
    *,
    chat_template: bool,
    rollout_batch_size: int = 16,
    n_samples_per_prompt: int = 4,
):
    from lit_ppo.config import PPOConfig
    from lit_ppo.rollout.prompts import load_prompts

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train, evaluation = (load_prompts(f, tokenizer, chat_template=chat_template) for f in files)
    ppo = PPOConfig(
        rollout_batch_size=rollout_batch_size,
        n_samples_per_prompt=n_samples_per_prompt,
        train_batch_size=rollout_batch_size * n_samples_per_prompt,
        micro_train_batch_size=16,
    )
    return datamodule_on(
        train, rollout, tokenizer, model_dir, engine, ppo=ppo, eval_prompts=evaluation, chat_template=chat_template
    )


def write_gsm8k_file(path, count: int, seed: int) -> None:
    """GSM8K's format ({"question", "answer": "reasoning #### 42"}) with questions of 60-200 characters: 100-300
    tokens once the chat template and the system prompt are around them (one token per character)."""
    import json

    rng = random.Random(seed)
    names, items = ["Janet", "Tom", "Aisha", "Wei", "Maria"], ["apples", "pencils", "stamps", "eggs", "books"]
    lines = []
    for i in range(count):
        a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 9)
        name, item = rng.choice(names), rng.choice(items)
        question = (
            f"{name} has {a} {item}. She buys {b} more {item} and then gets {c} times as many again from a friend."
        )
        question += " How many does she have in the end?" + " Show your work." * rng.randint(0, 3)
        answer = f"{a}+{b}={a + b}. {a + b}*{c + 1}={(a + b) * (c + 1)}. #### {(a + b) * (c + 1)}"
        lines.append(json.dumps({"question": question, "answer": answer}) + "\n")
    path.write_text("".join(lines))


@pytest.mark.slow  # make test: the prefill and chat-stop tests above on the shared engine, test_workloads.py's gsm8k run
def test_gsm8k_format_run_completes(tmp_path):
    """`train.py data=gsm8k reward=math` as a new user runs it on a GSM8K-format file: 100-300-token chat prompts
    whose end-of-turn token is not EOS, 16 prompts x 4 samples = 64 sequences in flight (32 tokens each),
    temperature 0.7, evaluation with pass@4 over 16 prompts x 4 samples. Before the CPU engine ran each prefill
    whole, this stopped inside vLLM ("CPU Generator does not use offset")."""
    import json
    import subprocess
    import sys

    from lit_ppo.demo.tiny import build_char_tokenizer
    from lit_ppo.rollout.prompts import format_prompt

    root = ROOT
    write_gsm8k_file(tmp_path / "train.jsonl", 32, seed=0)
    write_gsm8k_file(tmp_path / "test.jsonl", 16, seed=1)
    system = "Solve the problem step by step. Write the final answer as a number after '####'."
    tokenizer = build_char_tokenizer()
    lengths = [
        len(
            tokenizer(
                format_prompt(json.loads(line)["question"], tokenizer, chat_template=True, system_prompt=system),
                add_special_tokens=False,
            ).input_ids
        )
        for line in (tmp_path / "train.jsonl").read_text().splitlines()
    ]
    assert 100 <= min(lengths) and max(lengths) <= 300, (min(lengths), max(lengths))
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "train.py",
        "data=gsm8k",
        "reward=math",
        f"data.path={tmp_path / 'train.jsonl'}",
        f"data.eval_path={tmp_path / 'test.jsonl'}",
        "model.warm_start.enabled=false",
        "model.tiny.hidden_size=64",
        "model.tiny.num_layers=2",
        "model.tiny.num_heads=2",
        "model.tiny.num_kv_heads=1",
        "model.tiny.intermediate_size=128",
        "model.tiny.max_position_embeddings=512",
        "rollout.max_model_len=512",
        "rollout.max_response_tokens=32",
        "rollout.temperature=0.7",
        "rollout.eval_temperature=0.7",
        "rollout.eval_samples_per_prompt=4",
        "ppo=grpo",
        "ppo.rollout_batch_size=16",
        "ppo.n_samples_per_prompt=4",
        "ppo.train_batch_size=32",
        "ppo.micro_train_batch_size=8",
        "trainer.total_rollout_steps=2",
        "trainer.eval_every=1",
        f"output_dir={out}",
        f"cache_dir={tmp_path / 'cache'}",
        f"hydra.run.dir={out / 'hydra'}",
    ]
    result = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = rollout_step_rows(out / "metrics.csv")
    assert len(rows) == 2 and "eval/pass@4" in rows[-1]
    assert all(0.0 <= float(r["eval/pass@4"]) <= 1.0 for r in rows if r.get("eval/pass@4"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["samples_generated"] == 2 * 64


def test_weight_sync_streams_tensors_instead_of_listing_them(tiny_model_dir, engine, monkeypatch):
    """vLLM pulls the actor's tensors from the iterator while it loads them, so under FSDP each gathered tensor
    can be freed once copied; collecting them into a list first held a full gathered copy of the model."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    state = model.state_dict()
    inside_reload, pulled_outside = [False], []
    rpc = engine.llm.collective_rpc

    def watched_rpc(*args, **kwargs):
        inside_reload[0] = True
        try:
            return rpc(*args, **kwargs)
        finally:
            inside_reload[0] = False

    def tensors():
        for name, tensor in state.items():
            if not inside_reload[0]:
                pulled_outside.append(name)
            yield name, tensor

    monkeypatch.setattr(engine.llm, "collective_rpc", watched_rpc)
    engine.sync_weights(tensors())
    assert pulled_outside == []
