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

# Two workers: one process kept 1.3 of a 2-core CI machine's cores busy, and the suite took
# 13.6 minutes there; two took 10.2. Each module's tests go to one worker (--dist loadscope), so
# the module-scoped fixtures (trained smoke models, compiled engines) are built once, not once per
# worker: 11.9 minutes on a 2-core machine, against 15.3 with tests dealt one by one (that run
# also had about 40 s more of draft-head tests, since jitted).
# --durations lists the slowest tests, so that a CI run that nears its time budget says where.
test: setup
	$(PY) -m pytest -q -n 2 --dist loadscope --durations=15

lint: setup
	$(VENV)/bin/ruff check jaxspec tests benchmarks scripts
	$(VENV)/bin/ruff format --check jaxspec tests benchmarks scripts
