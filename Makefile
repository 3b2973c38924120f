# Every target creates .venv on first use and installs what it needs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: test test-fast lint typecheck pytest demo bench clean venv tests bench docs examples chaos test-compat

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,bench,demo,docs]'
	touch $(STAMP)

# The demo needs less than the tests: a fresh clone's `make demo` installs only that.
$(DEMO_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[demo]'
	touch $(DEMO_STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check celery_redlock tests bench examples tools
	$(PY) -m ruff format --check celery_redlock tests

typecheck: $(STAMP)
	$(PY) -m mypy

# Both halves, tests/unit and tests/integration (real servers, worker processes, chaos).
# Seven test processes (pytest-xdist), a test file each at a time: most tests wait on
# servers and workers, so seven keep the CI machine's two cores busy. Measured on the
# 2-core machine, the longest files first (below), in a checkout: 201 s of pytest with
# six, 182 s with seven (190-207 s from fresh clones), 185 s with eight and a rate test's
# timing failed. A file's module fixtures (one chaos scenario run checked by several
# tests) stay in one process. The files go out in the order collected, the longest first
# (tests/conftest.py, LONGEST_FIRST; 229 s -> 201 s with six against xdist's order, most
# tests first). Python writes its bytecode caches even where the environment says not to
# (PYTHONDONTWRITEBYTECODE): every worker, beat and CLI process a test starts imports the
# package (0.8 s from source, 0.55 s from the caches), and each pytest process rewrites
# the test modules' asserts. The caches are ignored by git (.gitignore: __pycache__/).
pytest: $(STAMP)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest tests -p no:randomly -n 7 --dist loadfile --no-loadscope-reorder --durations=15 --durations-min=0 $(PYTEST_ARGS)

test: lint typecheck docs pytest

# The unit half: no server, no worker process (the memory backend, freezegun for time);
# seconds, for the edit-test loop. `make test` runs it too, with everything else.
test-fast: $(STAMP)
	$(PY) -m pytest tests/unit -p no:randomly -q $(PYTEST_ARGS)

# The documentation site (mkdocs; the API reference from the docstrings) into build/site.
# --strict makes a warning (a broken link, a missing page, a docstring that does not
# resolve) fail the build, and so `make test`; --quiet would hide them from --strict.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# Fault injection for longer than `make test` does: CHAOS_MINUTES (default 10) of rounds of
# tests/integration/chaos with longer fault phases; CHAOS_SEED replays a run (the seed is
# printed first).
chaos: $(STAMP)
	$(PY) tests/integration/chaos/run_chaos.py

# The suite on every supported combination (oldest, newest, hiredis, valkey), one venv each
# under .compat/; by hand, not in CI. COMPAT=oldest (or "oldest,valkey") runs only those,
# COMPAT_PYTEST_ARGS="-x tests/integration/test_lock.py" replaces the default pytest
# arguments (seven processes, a file each, as `make pytest`).
COMPAT_PYTEST_ARGS ?= -n 7 --dist loadfile --no-loadscope-reorder
test-compat:
	COMPAT_PYTEST_ARGS="$(COMPAT_PYTEST_ARGS)" nice -n 10 $(PYTHON) tools/compat.py $(COMPAT)

# Two prefork workers, a LeaderScheduler beat and a throwaway Redis play a short script;
# writes build/demo-timeline.png, outside the tracked tree (run.py --png
# docs/demo-timeline.png refreshes the README's picture). Plain lines instead of the live
# view under CI=true.
demo: $(DEMO_STAMP)
	$(PY) examples/demo/run.py

bench: $(STAMP)
	$(PY) bench/bench_lock.py
	$(PY) bench/bench_redlock.py
	$(PY) bench/bench_tasks.py

clean:
	rm -rf $(VENV) build dist *.egg-info
