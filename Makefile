# Set-up and everyday commands. `make setup` builds .venv with Python 3.12 (pyenv's if present).
PYTHON312 ?= $(shell (ls -d $$(pyenv root 2>/dev/null)/versions/3.12.*/bin/python3.12 2>/dev/null; command -v python3.12) | head -n 1)
VENV := .venv
PY := $(VENV)/bin/python
PROMPT ?= def fibonacci(n):

.PHONY: setup generate test lint
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON312)" || (echo "error: Python 3.12 not found (install it, e.g. pyenv install 3.12)" >&2; exit 1)
	$(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,notebooks]'
	touch $@

generate: setup
	$(PY) -m jaxspec generate --prompt "$(PROMPT)"

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check jaxspec tests benchmarks scripts
	$(VENV)/bin/ruff format --check jaxspec tests benchmarks scripts
