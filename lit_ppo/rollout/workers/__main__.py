"""`python -m lit_ppo.rollout.workers`: a rollout worker process (lit_ppo/rollout/workers/worker_main.py)."""

if __name__ == "__main__":  # not on import (tests import every module)
    import sys

    from lit_ppo.rollout.workers.worker_main import run_as_main

    run_as_main(sys.argv[1:])
