"""Rollout workers (rollout.mode=disaggregated): processes with engines of their own, by side.

- `client.py`: the trainer's side, `RolloutWorkers`, an engine of the contract (lit_ppo/contract.py).
- `ranks.py`: data-parallel trainers, `DataParallelWorkers`: rank 0 drives the workers through its `RolloutWorkers`,
  the other ranks receive each step and read each push with it (collectives).
- `launch.py`: how the workers start and how the trainer watches them (spawned by the trainer, or external: started
  by the user's launcher on any node).
- `servers.py`: rollout.workers.launch=server, vLLM servers as workers: `ServerWorkers`, the client; beside it
  `server_http.py` (the calls), `server_settings.py` (what a server runs with), `server_spawn.py` (the spawned
  servers' processes) and `server_push.py` (the weight push).
- `worker_main.py`: the worker process's loop (`python -m lit_ppo.rollout.workers`).
- `pools.py`: the worker and server clients the engine registry starts (`lit_ppo/engine_registry.py`); the engine a
  worker runs is the registry's row for rollout.engine (vLLM, or HF on a copy of the actor).
- `messages.py`: what goes through the store, as frozen dataclasses.

The channel (store and gloo group) and the weight push are a floor below, in lit_ppo/rollout/weight_transfer/,
which the engines use too. Which version generates which rollout step is not here but in lit_ppo/rollout/schedule.py; see docs/async.md.
"""
