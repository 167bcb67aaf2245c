# pdist — the two commands a newcomer needs are `make lesson L=00` and `make test`.
# Both create .venv and install pdist (editable) with its test tools on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
MPIRUN := $(VENV)/bin/mpirun
L      ?= 00
N      ?= 1
ARGS   ?=
STAMP  := $(VENV)/.installed

.PHONY: venv lesson test test-fast bench lint clean

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# make lesson L=03 N=4   ->  mpirun -n 4 python lessons/03_*.py
lesson: $(STAMP)
	@f=$$(ls lessons/$(L)_*.py | head -n 1); \
	if [ "$(N)" = "1" ]; then $(PY) $$f $(ARGS); \
	else $(MPIRUN) -n $(N) $(PY) $$f $(ARGS); fi

test: $(STAMP)
	$(PY) -m pytest -q tests

test-fast: $(STAMP)
	$(PY) -m pytest -q tests -m "not slow"

bench: $(STAMP)
	for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
