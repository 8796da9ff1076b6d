# Every target works on a fresh clone: it creates .venv if missing, installs, then runs.
# .venv is Python 3.12 (megatron-core 0.19 needs it), found by scripts/find_python.sh;
# `make test PYTHON=/path/to/python3.12` picks one explicitly.
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

.PHONY: install test test-fast test-te test-slurm demo bench gpu-check lint clean

# The measurement lab (lab/: bench, GPU check, loss parity, activation memory, the tests' rank
# launchers) is not installed with the package: it runs from this checkout, put first on the
# path of every command here (and of the processes they start).
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))

# Transformer Engine's own Python, which the TE tests run on the CPU (tests/te_cpu): a folder of
# its own beside the venv, not in it (an importable TE without its compiled library makes
# Megatron-Core's import fail in every other process). `make test-te TE=2.20.2` runs the TE
# tests on another release. TE's PyPI wheel is pure Python; its compiled parts are the CPU
# backend's to stand in for, so it is installed without dependencies (those it imports are in
# the test extra).
TE ?= 2.18.0
TE_HOME := $(VENV)/transformer-engine-$(TE)
TE_STAMP := $(TE_HOME)/.installed

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || { python=$$(PYTHON='$(PYTHON)' scripts/find_python.sh) && echo "creating $(VENV) with $$python" \
		&& $$python -m venv $(VENV); }
	@$(PY) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' || { echo "$(VENV) is not \
		Python 3.12 (megatron-core 0.19 needs it): run make clean, then make again." >&2; exit 1; }
	$(PY) -m pip install -q --upgrade pip
	@echo "installing torch $(TORCH_VERSION): on Python 3.12 PyPI's CUDA build, ~5 GB, a few minutes (it runs on the CPU too)"
	$(PY) -m pip install --progress-bar off torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,plot]'
	touch $(STAMP)

$(TE_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps --target $(TE_HOME) transformer-engine==$(TE)
	touch $(TE_STAMP)

install: $(STAMP) $(TE_STAMP)

# Two workers, one test file each at a time (--dist loadfile keeps a file's module fixtures
# in one process): run serially, the suite left the two cores 30-50 % idle while a launch's
# ranks waited on each other (vmstat, 2026-12-02); times in tests/README.md.
test: $(STAMP) $(TE_STAMP)
	MEGATRON_DOMINO_TE_HOME=$(TE_HOME) $(PY) -m pytest -q -n 2 --dist loadfile --durations=30 \
		--ignore=tests/slurm tests

# The tests that run Transformer Engine's own code (marker `te`), on TE $(TE).
test-te: $(STAMP) $(TE_STAMP)
	MEGATRON_DOMINO_TE_HOME=$(TE_HOME) $(PY) -m pytest -q -n 2 --dist loadfile -m te tests

# The SLURM tier (tests/slurm/, after make test in .ci/run): a one-node Slurm started as root
# (scripts/slurm_cluster.sh, which installs slurm-wlm and munge with apt-get where missing),
# the recipes submitted to it with sbatch. -rP prints each job's id, status and wall time.
test-slurm: $(STAMP)
	$(PY) -m pytest -q -rP --durations=0 tests/slurm

# The developer's loop before a commit (tests/README.md): the unit tier and the core claims.
FAST_TESTS := tests/unit tests/ranks/test_domino_overlap.py \
	tests/ranks/test_domino_equivalence.py::test_every_setting_matches_stock_megatron_at_tp2
test-fast: $(STAMP) $(TE_STAMP)
	MEGATRON_DOMINO_TE_HOME=$(TE_HOME) $(PY) -m pytest -q $(FAST_TESTS)

demo: $(STAMP)
	$(VENV)/bin/megatron-domino-demo

# make bench QUICK=1: one shape, two settings, under 5 minutes.
# make bench LINK=emulated: TP collectives on the emulated interconnect (shared memory, modelled
# wire time, sleeping waits) instead of gloo over a rate-limited loopback.
# make bench DS=1: also DeepSpeed's own Domino as an arm (installs deepspeed into .venv).
DEEPSPEED_VERSION ?= 0.19.8
DS_STAMP := $(VENV)/.deepspeed-$(DEEPSPEED_VERSION)

$(DS_STAMP): $(STAMP)
	@echo "installing deepspeed $(DEEPSPEED_VERSION) without compiled ops (its Domino needs none)"
	DS_BUILD_OPS=0 $(PY) -m pip install -q deepspeed==$(DEEPSPEED_VERSION)
	touch $(DS_STAMP)

bench: $(STAMP) $(if $(DS),$(DS_STAMP))
	$(PY) -m lab.bench $(if $(QUICK),--quick) $(if $(DS),--deepspeed) \
		$(if $(LINK),--link $(LINK)) $(BENCH_ARGS)

# One GPU, no Transformer Engine, under 10 minutes (see docs/gpu_check.md).
gpu-check: $(STAMP)
	scripts/gpu_check.sh $(if $(QUICK),--quick)

lint: $(STAMP)
	$(PY) -m ruff check megatron_domino lab tests pretrain_gpt_domino.py examples patches
	$(PY) -m ruff format --check megatron_domino lab tests pretrain_gpt_domino.py examples patches

clean:
	rm -rf $(VENV) data_cache runs bench_results loss_parity ab_results gpu_check_results
