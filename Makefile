# Two entry points: `make demo` (engine on the embedded toy preset -> demo.mp4) and `make test` (CPU suite).
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: demo test install

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[engine,test]"
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) -m engine demo --out demo.mp4

# Two workers of one thread each (a module's tests stay on one worker, with its engine): most tests wait on engine
# processes, so this takes two thirds of one worker's time on two cores; more threads than cores thrash.
test: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile --durations=25
