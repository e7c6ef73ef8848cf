"""lit-ppo: PPO-family RL for causal language models on PyTorch Lightning, vLLM and Hydra."""

from omegaconf import OmegaConf

# `${mul:a,b}` in configs, e.g. FSDP's data-parallel size = devices x nodes.
if not OmegaConf.has_resolver("mul"):
    OmegaConf.register_new_resolver("mul", lambda a, b: int(a) * int(b))
