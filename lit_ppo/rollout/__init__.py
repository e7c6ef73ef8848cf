"""The rollout side: engines that generate (vLLM, or the actor through Hugging Face `generate`), the data module
that turns prompts into rollout batches (`datamodule.py`), multi-turn episodes and prompt files. It never imports
`lit_ppo.run.train`; the two sides meet at `lit_ppo.batch.RolloutBatch`."""
