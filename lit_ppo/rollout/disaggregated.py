"""`python -m lit_ppo.rollout.disaggregated`: the old name of `python -m lit_ppo.rollout.workers` (a rollout worker
process, lit_ppo/rollout/workers/), kept working for one release; it says so in one line."""

if __name__ == "__main__":
    import sys

    from lit_ppo.rollout.workers.worker_main import run_as_main

    print(
        "python -m lit_ppo.rollout.disaggregated is now python -m lit_ppo.rollout.workers; the old name goes in the "
        "next release",
        flush=True,
    )
    run_as_main(sys.argv[1:], prog="python -m lit_ppo.rollout.disaggregated")
