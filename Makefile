# pdist — the two commands a newcomer needs are `make lesson L=00` and `make test`.
# Both create .venv and install pdist (editable) with its test tools and the mpich wheel on
# first use. On a cluster, bring your own Python and MPI (README, "On a cluster"):
#   make lesson L=03 N=4 PYTHON=$HOME/envs/pdist/bin/python MPIRUN="srun --mpi=pmix"
# PYTHON given (environment or command line): make uses that Python as it is and installs
# nothing. A $(VENV) that make did not create (no $(STAMP)) is used as it is too.
VENV   ?= .venv
STAMP  := $(VENV)/.installed
ifeq ($(origin PYTHON),undefined)
PY     := $(VENV)/bin/python
else
PY     := $(PYTHON)
endif
BASE_PYTHON ?= python3
# the mpirun beside $(PY), else the first on PATH; MPIRUN (environment or command line) wins
MPIRUN ?= $(shell d=$$(dirname "$$(command -v $(PY) 2>/dev/null || echo $(PY))"); \
            if [ -x "$$d/mpirun" ]; then echo "$$d/mpirun"; else echo mpirun; fi)
L      ?= 00
N      ?= 1
ARGS   ?=

.PHONY: venv lesson test test-fast budgets bench lint clean grade handout

venv: $(STAMP)

# make's own venv: created and installed once (again when setup.cfg changes); a venv or a
# PYTHON that make did not create is checked (pdist and mpi4py import) and never installed into
$(STAMP): setup.cfg pyproject.toml
	@if [ "$(origin PYTHON)" != "undefined" ] || { [ -x $(VENV)/bin/python ] && [ ! -e $(STAMP) ]; }; then \
	  $(PY) -c "import pdist, mpi4py" 2>/dev/null || { echo "make: $(PY) cannot import pdist and mpi4py; \
	install them there (README, On a cluster), or unset PYTHON and remove $(VENV) to let make create it"; exit 2; }; \
	  echo "make: using $(PY) as it is (make did not create it: nothing installed)"; \
	else \
	  set -e; $(BASE_PYTHON) -m venv $(VENV); \
	  $(VENV)/bin/python -m pip install -q --upgrade pip; \
	  $(VENV)/bin/python -m pip install -q -e '.[test,mpich]'; \
	  touch $(STAMP); \
	fi

# make lesson L=03 N=4   ->  mpirun -n 4 python lessons/03_*.py
lesson: $(STAMP)
	@f=$$(ls lessons/$(L)_*.py | head -n 1); \
	if [ "$(N)" = "1" ]; then $(PY) $$f $(ARGS); \
	else $(MPIRUN) -n $(N) $(PY) $$f $(ARGS); fi

# the suite in parallel: TEST_JOBS pytest-xdist workers (default 2 per core) that share the
# cores by counting each job's ranks (tests/conftest.py); TEST_JOBS=0 runs it in one process
CORES     := $(shell nproc 2>/dev/null || echo 2)
TEST_JOBS ?= $(shell echo $$(( $(CORES) * 2 )))
PYTEST    := $(PY) -m pytest -q tests $(if $(filter 0,$(TEST_JOBS)),,-n $(TEST_JOBS))

test: $(STAMP)
	$(PYTEST)

# the suite without the tests marked slow (setup.cfg)
test-fast: $(STAMP)
	$(PYTEST) -m "not slow"

# files under 300 lines, functions under 60, 0 import cycles and no import up the layers in pdist/
# (docs/design.md, "Modules"; stdlib only; CI runs it)
budgets:
	$(BASE_PYTHON) .ci/budgets.py

# the course's autograder: every exercise in lessons/exercises/ (EX="01 03" for some; ARGS="--reference" etc.)
EX ?=
grade: $(STAMP)
	$(PY) -m pdist.grade $(EX) $(ARGS)

# the student copy: make handout DIR=../course-copy  (exercises blank; no reference answers, no wrong-answer fixtures)
DIR ?=
handout: $(STAMP)
	@test -n "$(DIR)" || { echo "usage: make handout DIR=/path/to/new/folder"; exit 2; }
	$(PY) -m pdist.course handout $(DIR)

# every benchmark, each launched the way its docstring says (prints tables; takes a few minutes)
bench: $(STAMP)
	$(PY) bench/step_time.py
	$(PY) bench/profile_step.py
	$(PY) bench/mlp_peer.py
	$(MPIRUN) -n 2 $(PY) bench/collectives.py
	$(MPIRUN) -n 4 $(PY) bench/oversubscribed.py
	$(PY) bench/data_parallel.py
	$(MPIRUN) -n 2 $(PY) bench/zero.py
	$(PY) bench/tensor_parallel.py
	$(PY) bench/pipeline.py
	$(MPIRUN) -n 2 $(PY) bench/checkpoint.py
	$(PY) bench/failures.py

# pyflakes-level checks (undefined names, unused variables, syntax)
lint: $(STAMP)
	$(PY) -m pip install -q ruff
	$(VENV)/bin/ruff check --select F,E9 pdist lessons bench tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
