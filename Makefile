# make run  : set up .venv, then `dvc repro` on the default preset (Multi30k, small model)
# make test : set up .venv, then the whole test suite (but tests/cluster: make test-slurm)
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export PATH := $(abspath $(BIN)):$(PATH)
export DVC_NO_ANALYTICS := 1
export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := 1

.PHONY: install run test test-slurm bench clean ui inspect multinode-smoke rehearse gpu-check gpu-day gpu-profile gpu-graphs check-layout

install: $(VENV)/.installed

# Reinstalls only when the pinned requirements change.
$(VENV)/.installed: requirements.lock pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.lock
	$(BIN)/pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

run: install
	dvc repro

# Three workers (pytest-xdist) on two cores: while one waits on a process, a server, a timeout or a file, the other
# two keep both cores busy. A test file stays on one worker (--dist loadfile), so a module's pipeline fixture runs
# once; the files holding a slow test go first, in the order tests/conftest.py gives them (--no-loadscope-reorder).
TEST_WORKERS ?= 3
test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --ignore=tests/cluster

# The pipeline through sbatch on a one-host SLURM cluster (tests/cluster): installs Debian's slurm-wlm and munge
# when missing (apt-get, as root); the tests skip, saying why, where they cannot be installed
test-slurm: install
	cluster/slurm/local_cluster.sh install
	$(BIN)/python -m pytest -q tests/cluster

bench: install
	$(BIN)/python -m bench.cpu.train_throughput
	$(BIN)/python -m bench.cpu.matmul
	$(BIN)/python -m bench.decoding.search

# the house as drawn: imports down the floors (tools, bench -> stages -> pipeline -> model), no cycles, no code file
# over 400 lines, no test module importing another (tests/project/test_layout.py, part of make test)
check-layout: install
	$(BIN)/python -m pytest -q tests/project/test_layout.py

inspect: install
	$(BIN)/python -m tools.inspect $(P)

# Two torchrun "nodes" over 127.0.0.1 against one process; last line: max |w_2node - w_1proc| = X
multinode-smoke: install
	$(BIN)/python -m tests.multinode_smoke

# The wmt14_en_de_base preset at the paper's model size through all eight stages, 8 processes (gloo), on a
# stand-in corpus served from 127.0.0.1: per stage time and peak memory; last line: max |w_8proc - w_1proc| = X
rehearse: install
	$(BIN)/python -m tests.rehearse

# base and big training steps and beam-4 decoding on the GPU (exits 0 saying so without CUDA)
gpu-check: install
	$(BIN)/python -m bench.gpu.check

# One call on a GPU machine whose python (first on PATH, a CUDA torch; no install) runs it: base, then big,
# eager and the whole compiled step, the share lines with communication modelled, decoding fp32 and bf16, within
# 9 minutes; lines print as they end, and reports/gpu_day.json holds the figures of each preset done
gpu-day:
	set -o pipefail; mkdir -p reports && timeout 540 python -m bench.gpu.check --modes eager step --steps 30 --compiled-steps 60 \
		--sentences 200 --summary reports/gpu_day.json | tee reports/gpu_day.txt

gpu-profile: install
	$(BIN)/python -m bench.gpu.profile

# train.compile and train.cuda_graphs (each layer, then the whole step) against eager over 600 steps of one corpus
gpu-graphs: install
	$(BIN)/python -m bench.gpu.graphs --modes compiled graphs step step-graphs

clean:
	rm -rf $(VENV)
ui: install
	$(BIN)/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db --host 127.0.0.1 --port 5000
