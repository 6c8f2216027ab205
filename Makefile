# Two commands do all the set-up: `make demo` and `make test`. Each creates .venv on first use
# and reinstalls only when pyproject.toml or the constraints change (the stamp file).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Without an NVIDIA driver, pin the CPU build of torch so pip never downloads a multi-GB CUDA
# build; with one, let pip keep (or pick) the CUDA build. Override with CONSTRAINTS=... .
CONSTRAINTS ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,-c constraints/cpu.txt)

.PHONY: test test-busy demo bench clean

$(STAMP): pyproject.toml constraints/cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(CONSTRAINTS) -e '.[test]'
	touch $(STAMP)

# Two pytest processes (pytest-xdist), each module whole in one of them (its Ray and its
# fixtures), the longest handed out first (tests/conftest.py): one process leaves a third of the
# 2 cores idle while Ray workers start. Measured back to back under 2 CPU hogs (make test-busy)
# the same day: 684 s against 1071 s for one process (TEST_WORKERS=0).
TEST_WORKERS ?= 2

test: $(STAMP)
	$(VENV)/bin/ruff check offload worker coordinator tests bench scripts examples
	$(VENV)/bin/ruff format --check offload worker coordinator tests bench scripts examples
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The same suite while CPU hogs keep every core busy (tests/busy.sh), as on CI's shared 2-core
# machines: no test may race a signal, a kill or a thread against work that may finish first.
test-busy: $(STAMP)
	PYTHON=$(PY) tests/busy.sh $(MAKE) --no-print-directory test

# The main job on the embedded Ray: a random-weight bfloat16 llama checkpoint (the dtype of
# published models), planned over 3 logical GPUs of 3 MiB each (so two stages offload layers),
# run, and checked against transformers loading the same files in bfloat16 in one process.
DEMO_CKPT := out/demo-ckpt-bf16
$(DEMO_CKPT)/config.json: $(STAMP)
	$(VENV)/bin/offloadctl make-checkpoint $(DEMO_CKPT) --force --layers 8 --dtype bfloat16

demo: $(DEMO_CKPT)/config.json
	$(VENV)/bin/offloadctl run --checkpoint $(DEMO_CKPT) --gpus 3 --gpu-memory 3MiB --check
	$(VENV)/bin/offloadctl generate --checkpoint $(DEMO_CKPT) --gpus 3 --gpu-memory 3MiB \
		--prompt "the workers keep their own layers" --max-new-tokens 24

bench: $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check $(CONSTRAINTS) -e '.[test,bench]'
	$(PY) bench/prefetch_overlap.py
	$(PY) bench/planner.py
	$(PY) bench/load.py
	$(PY) bench/recovery.py
	$(PY) bench/families.py
	$(PY) bench/generate.py
	$(PY) bench/batching.py
	$(PY) bench/serve.py
	$(PY) bench/policy.py
	$(PY) bench/engine.py
	$(PY) bench/shared_load.py
	$(PY) bench/sampling.py
	$(PY) bench/startup.py

clean:
	rm -rf $(VENV) out .pytest_cache .ruff_cache .hypothesis
