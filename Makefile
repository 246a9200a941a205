# Two entry points that work on a fresh machine with only Python 3.11+:
#   make demo   — set up .venv, then run the main job on the embedded demo data
#   make test   — set up .venv, then run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch/torchvision: this pair installs from the local wheel mirror; ranges in pyproject stay open.
TORCH_PAIR ?= torch==2.14.1 torchvision==0.29.1
DEMO_OUT ?= demo-out
DEMO_IMAGES ?= 512
DEMO_SIZE ?= 64

.PHONY: venv demo test lint clean

# One line per step, saying what it installs and about how long it takes; pip itself stays quiet (-q).
$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || { echo "creating the virtual environment $(VENV) (a few seconds)"; $(PYTHON) -m venv $(VENV); }
	@echo "upgrading pip in $(VENV) (about 10 s)"
	@$(PY) -m pip install -q --upgrade pip
	@echo "installing $(TORCH_PAIR) (about a minute)"
	@$(PY) -m pip install -q $(TORCH_PAIR)
	@echo "installing dlstore and its extras test, plot, dask, s3 (about 2 minutes)"
	@$(PY) -m pip install -q -e '.[test,plot,dask,s3]'
	@touch $@
	@echo "$(VENV) is ready"

venv: $(VENV)/.installed

# The same demo images throughout: converted to a zarr cache, looked at, then the bench compares
# reading the files (raw) with reading that very cache (--cache).
demo: venv
	@echo "the demo: $(DEMO_IMAGES) generated photo-like images → a zarr cache at $(DEMO_SIZE) px, then bench files vs that cache (about a minute)"
	$(VENV)/bin/dlstore convert demo $(DEMO_OUT)/cache-zarr --format zarr --size $(DEMO_SIZE) --demo-images $(DEMO_IMAGES) --overwrite
	$(VENV)/bin/dlstore info $(DEMO_OUT)/cache-zarr
	$(VENV)/bin/dlstore verify $(DEMO_OUT)/cache-zarr
	$(VENV)/bin/dlstore bench demo --size $(DEMO_SIZE) --demo-images $(DEMO_IMAGES) --cache $(DEMO_OUT)/cache-zarr --loaders raw,zarr --out $(DEMO_OUT)/bench

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: venv lint
	$(PY) -m pytest -q -m "not slow and not gpu" tests

clean:
	rm -rf $(VENV) $(DEMO_OUT) build *.egg-info
