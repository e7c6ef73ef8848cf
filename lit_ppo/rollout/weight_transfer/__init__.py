"""The weight push from the trainer to engines in other processes, a floor below both the engines (rollout/engine.py,
rollout/hf_engine.py: a worker's end of it) and the rollout workers (rollout/workers/: the trainer's end): it imports
nothing else of lit_ppo.rollout (tests/test_imports.py).

- `transport.py`: the channel, a TCPStore for commands and answers and a gloo group for the weights (`host_store`,
  `PushAnnouncer`, `StagedReceiver`, `probe_mismatch`).
- `backend.py`: lit-ppo's `lit_ppo_gloo` backend of vLLM's weight-transfer interface (`GlooTrainerWeightTransferEngine`,
  `GlooWeightTransferEngine`, `TensorSource`), registered with vLLM's factories (`register`).
- `interface.py`: the interface's classes for a machine without vLLM (`rollout.engine=hf` workers).
- `plugin.py`: the vLLM general plugin that registers the backend in every vLLM process (pyproject.toml's entry
  point), and whether this environment's install declares it as this checkout does (`plugin_installed`).
"""
