"""What every test gets, with or without a server.

tests/unit/ (no server, no worker process) and tests/integration/ (real servers, worker
processes, chaos; its conftest.py starts the servers) both run under this file. It also puts
tests/ on sys.path (pytest's prepend import of a conftest's folder), so the integration
tests and bench/ share ``servers``, ``workers`` and ``lua`` from here, and subprocess
workers import ``tests.apps.<module>`` with the repository as their working directory.
"""

from __future__ import annotations

import os
import random
import subprocess
from collections.abc import Iterator
from typing import Any

import freezegun
import pytest

from celery_redlock.core.renewal import get_manager

# pytest times each test through _pytest.timing; freezegun replaces every module's time
# functions while a test freezes the clock, so without this a frozen test's duration (the
# 15 slowest that `make test` prints) is the frozen date's distance from the real one.
freezegun.configure(extend_ignore_list=["_pytest.timing", "_pytest.runner"])

# -- chaos scenarios: one seed for the session, every scenario's figures in the summary -----
# Here, not in tests/integration/: pytest-xdist's main process collects nothing, so it runs
# only the hooks of this conftest (loaded for the `tests` argument itself), not a subfolder's.
_CHAOS_LINES: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    """Choose the session's chaos seed here, in the main process, so that pytest-xdist's
    workers (started later, with this environment) all use the one printed."""
    os.environ.setdefault("CHAOS_SEED", str(random.SystemRandom().randrange(2**32)))


# -- the order of the files: the longest first ------------------------------------------------
# `make test` hands each of its seven processes a file at a time in the order collected
# (pytest-xdist's --dist loadfile with --no-loadscope-reorder). With the long files first the
# short ones fill the gaps at the end; in xdist's own order (most tests first) the chaos
# scenarios (10 tests, ~100 s) started last and the run waited on them. Each file's summed
# test time, from a junit report of a whole `make pytest` run on the 2-core machine
# (2026-12-04); every other file follows, in collection order (each under 20 s).
LONGEST_FIRST = (
    "integration/chaos/test_chaos.py",  # 102 s
    "integration/test_backends.py",  # 75 s
    "integration/test_beat.py",  # 53 s
    "integration/test_beat_led.py",  # 50 s
    "integration/test_dedup_worker.py",  # 43 s
    "integration/test_task_inprocess.py",  # 42 s
    "integration/test_sentinel_failover.py",  # 39 s
    "integration/test_examples.py",  # 38 s
    "integration/test_task_worker.py",  # 37 s
    "integration/test_pools.py",  # 36 s
    "integration/test_default_clients.py",  # 36 s
    "integration/test_dedup_tasks.py",  # 33 s
    "integration/test_test_mode.py",  # 32 s
    "integration/test_worker_config.py",  # 31 s
    "integration/test_hygiene.py",  # 31 s
    "integration/test_limit_workers.py",  # 31 s
    "integration/test_redlock.py",  # 30 s
    "integration/test_observability.py",  # 29 s
    "integration/test_demo.py",  # 28 s
    "integration/test_sentinel_cluster.py",  # 22 s
    "integration/test_renewal.py",  # 21 s
    "integration/test_board_browser.py",  # 21 s
)
_TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.hookimpl(trylast=True)  # after pytest's own reordering, whose order inside a file stays
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of LONGEST_FIRST first, in its order; a file's tests keep theirs."""
    gone = [name for name in LONGEST_FIRST if not os.path.isfile(os.path.join(_TESTS, name))]
    if gone:  # a file renamed or removed: the list in tests/conftest.py follows it
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FIRST names no such file: {gone}")
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.relpath(item.path, _TESTS), len(rank)))


# -- the source tree: a test writes its files in its own directory, never in the tree --------
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TREE_BEFORE: set[str] | None = None


def _tree_changes() -> set[str] | None:
    """Untracked (not ignored) and modified files of the checkout; None outside git."""
    try:
        found = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all"],
            cwd=_ROOT, capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return {line[3:] for line in found.stdout.splitlines() if line}


def pytest_sessionstart(session: pytest.Session) -> None:
    """Note what the checkout holds besides its commit (the main process only)."""
    global _TREE_BEFORE
    if not hasattr(session.config, "workerinput"):
        _TREE_BEFORE = _tree_changes()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the session when the tests left files in the source tree (a worker's state file
    named after -S, a picture written over a tracked one)."""
    if _TREE_BEFORE is None or hasattr(session.config, "workerinput"):
        return
    after = _tree_changes() or set()
    left = sorted(after - _TREE_BEFORE)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"the tests left files in the source tree: {left}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_report_header() -> str:
    """First thing printed: the seed that replays this session's chaos fault schedule."""
    mode = "long (make chaos)" if os.environ.get("CHAOS_LONG", "") not in ("", "0") else "short"
    return f"chaos: CHAOS_SEED={os.environ['CHAOS_SEED']} ({mode})"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Collect chaos figures from every test report, wherever the test ran."""
    _CHAOS_LINES.extend(value for name, value in report.user_properties if name == "chaos figures")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line of figures per chaos scenario that ran, whatever the capture mode."""
    if _CHAOS_LINES:
        terminalreporter.section(f"chaos figures (CHAOS_SEED={os.environ['CHAOS_SEED']})")
        for line in _CHAOS_LINES:
            terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def _forget_leftover_renewals() -> Iterator[None]:
    """A test that failed half-way must not leave locks for the next test's renewal thread."""
    yield
    manager = get_manager()
    for lock in manager.held():
        manager.unregister(lock)


# -- pytest-celery's in-process worker (celery_worker, and the plugin's redlock_worker) ------
# Every module that uses it wants the same worker: two threads (a test holds a lock in one
# run while another run meets it), and no ping check (it would run a task of its own).
@pytest.fixture(scope="session")
def celery_worker_pool() -> str:
    return "threads"


@pytest.fixture(scope="session")
def celery_worker_parameters() -> dict[str, Any]:
    return {"concurrency": 2, "perform_ping_check": False}
