# Two commands do all the set-up: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
THREADS ?= 2
# llama.cpp's own GGUF converter, from the llama-cpp-python sdist (downloaded, never built): the
# tests convert tiny checkpoints with it; without the download those tests skip and say why.
SDIST   := .cache/sdist/llama_cpp_python-0.3.36.tar.gz

.PHONY: demo test test-fast setup kernels clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

$(STAMP): $(VPY) requirements.txt requirements-models.txt pyproject.toml
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -r requirements.txt
	$(VPY) -m pip install -q --no-deps -r requirements-models.txt
	$(VPY) -m pip install -q --no-deps -e .
	touch $(STAMP)

# longattn's CPU kernels, built once per install into the environment (about half a minute; a
# no-op when built). Where they cannot be built, longattn runs PyTorch's ops and says so.
kernels: $(STAMP)
	-$(VPY) -m longattn.ops.native

setup: $(STAMP) kernels

demo: $(STAMP) kernels
	$(VENV)/bin/longattn demo --threads $(THREADS)

$(SDIST):
	@mkdir -p $(dir $(SDIST))
	-$(VPY) -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d $(dir $(SDIST))

test: $(STAMP) $(SDIST) kernels
	LONGATTN_LLAMACPP_SDIST=$(abspath $(SDIST)) $(VPY) -m pytest -q --durations=25 tests

test-fast: $(STAMP) kernels
	$(VPY) -m pytest -q -m "not real" tests

clean:
	rm -rf $(VENV) .cache build *.egg-info src/*.egg-info
