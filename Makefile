# Two commands on a fresh machine:
#   make train   set up .venv, train the main job (protein SEDD, 2 processes), evaluate, export,
#                sample 64 sequences and plot
#   make test    set up .venv and run the test suite (the command CI runs)
#   make docs    build the documentation site (mkdocs, --strict: a broken link or reference fails) into site/
PYTHON     ?= python3
VENV       ?= .venv
PY         := $(VENV)/bin/python
# The CPU build of torch must be installed before the package, or pip pulls CUDA wheels.
# On a GPU node use e.g. `make train TORCH_SPEC=torch`.
TORCH_SPEC ?= torch==2.13.0
NPROC      ?= 2
CONFIG     ?= configs/protein_sedd/sedd_tiny.yaml
SAMPLES    ?= 64
# Each config trains in its own folder, runs/<the config's folder>/<its name> (configs/a/tiny.yaml and configs/b/tiny.yaml
# do not share one); a rerun resumes an interrupted run there (RESUME=none starts over), and a finished one says so in
# one line and trains nothing (export, samples and plots are made again from it).
RUN_DIR    ?= runs/$(notdir $(patsubst %/,%,$(dir $(abspath $(CONFIG)))))/$(basename $(notdir $(CONFIG)))
RESUME     ?= auto
PYTEST_ARGS ?=
# Every family's extra, so the main job and the whole test suite run from one environment.
EXTRAS     ?= test,search,parity,protein_sedd,crystals,molecules_edm,molecules_mlff,perturbation_gears

.PHONY: setup train test test-all lint bench bench-engines docs docs-config clean

$(VENV)/.installed: setup.cfg pyproject.toml
	@echo "set-up 1/4: a virtual environment in $(VENV) and pip itself..."
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	@echo "set-up 2/4: $(TORCH_SPEC) (the CPU build unless TORCH_SPEC says otherwise)..."
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	@echo "set-up 3/4: the package and its extras ($(EXTRAS)): the longest step, a few minutes..."
	# deepspeed's setup imports torch: build it against the torch installed above. setuptools' notice on every
	# editable install (a folder named like the package may shadow it) is moot here: that folder is the package.
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q --no-build-isolation -e ".[$(EXTRAS)]"
	# DeepSpeed compiles its CPU communication op on first use: here, once, into this environment's own cache
	# (trainer/core/deepspeed_ops.py), the one its runs load.
	@echo "set-up 4/4: DeepSpeed's CPU communication op (built once, about 1-2 minutes) and ANI-1x's parameters..."
	$(PY) -m trainer.core.deepspeed_ops \
		|| echo "(not prebuilt: DeepSpeed builds it on first use)"
	# ANI-1x's parameters (the ani1x force field) into the data cache: pip fetches the pinned wheel, checksummed.
	$(VENV)/bin/trainer data fetch ani1x > /dev/null
	touch $@

setup: $(VENV)/.installed

# `trainer train --nproc N` launches N DDP processes itself (torch.distributed.run on a free port) and stands between
# them and the terminal: Ctrl-C stops every process at a step with a checkpoint, and errors stay one line.
train: setup
	@# runs/<config name>, without the config's folder, is another folder: a run there is continued only when asked.
	@named=runs/$(basename $(notdir $(CONFIG))); if [ "$$named" != "$(RUN_DIR)" ] && [ -d "$$named" ] && [ ! -d "$(RUN_DIR)" ]; \
		then echo "make train: training in $(RUN_DIR); $$named is left as it is (make train RUN_DIR=$$named continues it)"; fi
	$(VENV)/bin/trainer train $(CONFIG) --nproc $(NPROC) run.output_dir=$(RUN_DIR) run.resume=$(RESUME)
	$(VENV)/bin/trainer export $(RUN_DIR)
	# SAMPLES=0 skips sampling (for a task that does not generate, e.g. CONFIG=configs/regression/tiny.yaml).
	if [ "$(SAMPLES)" != 0 ]; then $(VENV)/bin/trainer sample $(RUN_DIR) --nproc $(NPROC) num_samples=$(SAMPLES) \
		out=$(RUN_DIR)/samples.fasta; fi
	$(VENV)/bin/trainer plot $(RUN_DIR)

lint: setup
	$(VENV)/bin/ruff check trainer tests benchmarks scripts

# CI's suite: everything but the `extended` repeats (docs/testing.md; its time: BENCHMARKS.md); test-all adds them.
# TEST_WORKERS pytest-xdist workers share the machine (most tests wait on launchers and interpreter start-ups,
# so 2 workers fill 2 cores; 0: one process). Each test file goes whole to one worker, so a module fixture is
# built once (xdist's loadgroup does not group under pytest 9.2); the regression runs are shared (conftest.py).
TEST_WORKERS ?= 2
XDIST       = -n $(TEST_WORKERS) --dist loadfile
# Then the tests that compare two runs' weights or log-probabilities (marker `numerics`) again under torch's AVX2 and
# portable kernels: a result must not depend on the CPU's vector unit, and a machine with AVX-512 must not hide it.
NUMERICS_KERNELS ?= avx2 default
test: setup
	$(PY) -m pytest -q --durations=25 $(XDIST) -m "not extended" $(PYTEST_ARGS) tests
	for kernels in $(NUMERICS_KERNELS); do \
		echo "numerics under ATEN_CPU_CAPABILITY=$$kernels:"; \
		ATEN_CPU_CAPABILITY=$$kernels $(PY) -m pytest -q $(XDIST) -m "numerics and not extended" $(PYTEST_ARGS) tests \
			|| exit 1; \
	done

test-all: setup
	$(PY) -m pytest -q --durations=25 $(XDIST) $(PYTEST_ARGS) tests

bench: setup
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q --no-build-isolation -e ".[$(EXTRAS),bench]"
	$(PY) benchmarks/overhead.py --out BENCHMARKS.md
	$(PY) benchmarks/ingest.py --out BENCHMARKS.md
	$(PY) benchmarks/throughput.py --device cpu --out BENCHMARKS.md

# Streaming engines on a UniRef50-shaped FASTA (benchmarks/stream_engines.py): HF datasets and ours run in .venv;
# MosaicML streaming and LitData, whose pins conflict with .venv's (numpy < 2.2), in their own .venv-engines.
ENGINES_VENV ?= .venv-engines
ENGINES_RECORDS ?= 1000000
ENGINES_WORKDIR ?= /tmp/stream-engines
$(ENGINES_VENV)/.installed: benchmarks/requirements-engines.txt
	$(PYTHON) -m venv $(ENGINES_VENV)
	$(ENGINES_VENV)/bin/python -m pip install -q --upgrade pip setuptools wheel
	$(ENGINES_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(ENGINES_VENV)/bin/python -m pip install -q -r benchmarks/requirements-engines.txt
	touch $@

bench-engines: setup $(ENGINES_VENV)/.installed
	$(PY) benchmarks/stream_engines.py --records $(ENGINES_RECORDS) --workdir $(ENGINES_WORKDIR) \
		--engines-python $(ENGINES_VENV)/bin/python

# The documentation site: the docs extra (mkdocs-material, mkdocstrings) into the venv, then a strict build.
docs: setup
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q --no-build-isolation -e ".[$(EXTRAS),docs]"
	$(VENV)/bin/mkdocs build --strict

# The per-family parts of the docs, from the registry: docs/configuration.md's config key tables (from the dataclass
# docstrings; a new task's section is added) and docs/api/specs.md's list of spec modules.
docs-config: setup
	$(PY) scripts/update_docs_config.py

clean:
	rm -rf runs build site *.egg-info
