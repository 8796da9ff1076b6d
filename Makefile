# Every target works on a fresh clone: it creates .venv if missing, installs, then runs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

.PHONY: install test demo bench gpu-check lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[dev,plot]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(PY) -m megatron_domino.demo

# make bench QUICK=1: one shape, two settings, under 5 minutes.
bench: $(STAMP)
	$(PY) -m megatron_domino.bench $(if $(QUICK),--quick) $(BENCH_ARGS)

# One GPU, no Transformer Engine, under 10 minutes (see docs/gpu_check.md).
gpu-check: $(STAMP)
	scripts/gpu_check.sh $(if $(QUICK),--quick)

lint: $(STAMP)
	$(PY) -m ruff check megatron_domino tests pretrain_gpt_domino.py examples
	$(PY) -m ruff format --check megatron_domino tests pretrain_gpt_domino.py examples

clean:
	rm -rf $(VENV) data_cache runs bench_results loss_parity ab_results gpu_check_results
