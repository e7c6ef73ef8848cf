"""Put on PYTHONPATH by `SMOKE=1 bash bench/gpu_issue41.sh`: vLLM and flash-attention unimportable, as on the lent GPU
machine's image (it has neither), so that a CPU smoke fails where the GPU run would. `sys.modules[name] = None` makes
`import name` raise ModuleNotFoundError and `importlib.util.find_spec(name)` return None (what transformers' and
lit-ppo's availability checks read); child processes (train.py, rollout workers) inherit PYTHONPATH and load it too."""

import sys

for _name in ("vllm", "flash_attn", "flash_attn_interface"):
    sys.modules[_name] = None
