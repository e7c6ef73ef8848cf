"""Where `lit_ppo_gloo`'s vLLM plugin entry point was before the weight transfer moved to lit_ppo/rollout/weight_transfer/:
installs made before the move (`pip install -e .` writes the entry point into the environment) still name this module
in every vLLM process they start. Reinstalling points them at `lit_ppo.rollout.weight_transfer.backend:register`."""


def register() -> None:
    from lit_ppo.rollout.weight_transfer.backend import register as register_backend

    register_backend()
