"""Chaos scenarios: each scenario's figures go on the report of the test it ended in.

tests/conftest.py prints them in the session summary, and the seed in the header: under
pytest-xdist the scenarios run in worker processes, which take the seed from the
environment the main process set up (see there).
"""

from __future__ import annotations

from collections.abc import Generator

import pytest
from chaos_harness import FIGURES

#: How many of this process's FIGURES went out on a report already.
_reported = 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Generator[None, pytest.TestReport, None]:
    """Attach the figures of scenarios that ended since the last report (in this test's
    setup, call or teardown: a module fixture runs its scenario in a setup) to it."""
    global _reported
    outcome = yield
    report = outcome.get_result()
    for figures in FIGURES[_reported:]:
        report.user_properties.append(("chaos figures", figures.line()))
    _reported = len(FIGURES)
