"""The embedded default experiment: the tiny Qwen2-architecture model, the arithmetic task and its warm start."""
