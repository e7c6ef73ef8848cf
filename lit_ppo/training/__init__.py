"""The training side: the LightningModule (`module.py`), the experience of a rollout step, micro-batches, log-probs,
the models, optimizers and the logged statistics. It never imports `lit_ppo.rollout.engine`; the two sides meet at
`lit_ppo.batch.RolloutBatch`."""
