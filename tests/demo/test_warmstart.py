"""The warm start's demonstrations (lit_ppo/demo/warmstart.py): the long-tail teacher of `+experiment=long_tail`
(issue 53 item 5's heavy-tailed workload), and the default demonstrations and cache key as they were without it."""

from __future__ import annotations

import dataclasses
import random

from lit_ppo.config.model import WarmStartConfig
from lit_ppo.demo.warmstart import demonstration_sampler, keyed_settings
from lit_ppo.rewards import integer_match

RECORDS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 40) for b in range(10, 40)]


def test_the_long_tail_teacher_writes_spaces_before_a_share_of_its_answers():
    sample = demonstration_sampler(RECORDS, teacher_accuracy=1.0, long_fraction=0.1, long_pad_tokens=24)
    rng = random.Random(0)
    drawn = [sample(rng) for _ in range(4000)]
    long = [response for _, response in drawn if response.startswith(" ")]
    assert 0.08 < len(long) / len(drawn) < 0.12  # about 10 % of the responses
    assert all(response == " " * 24 + response.strip() for response in long)  # 24 spaces, then the answer
    answers = {r["prompt"]: r["answer"] for r in RECORDS}
    prompts, responses = [p for p, _ in drawn], [r for _, r in drawn]
    assert integer_match(prompts, responses, [answers[p] for p in prompts], [{}] * len(drawn)) == [1.0] * len(drawn)


def test_without_the_long_tail_the_demonstrations_and_the_cache_key_are_as_before():
    sample = demonstration_sampler(RECORDS, teacher_accuracy=0.35)
    ours, theirs = random.Random(3), random.Random(3)
    for _ in range(500):  # the draws as they were: the record, then the teacher's noise, nothing more
        record = theirs.choice(RECORDS)
        answer = int(record["answer"])
        assert sample(ours) == (record["prompt"], str(answer if theirs.random() < 0.35 else answer + 1))
    settings = dataclasses.asdict(WarmStartConfig())
    assert "long_fraction" not in keyed_settings(settings) and "long_pad_tokens" not in keyed_settings(settings)
    on = dataclasses.asdict(WarmStartConfig(long_fraction=0.1))
    assert keyed_settings(on) == on
