"""The suite's own clock: `make test` prints the 15 slowest tests, timed by the wall clock
even in tests that freeze time (tests/conftest.py tells freezegun to leave pytest's timing
alone)."""

from __future__ import annotations

import time

from _pytest import timing
from freezegun import freeze_time


def test_pytests_timing_reads_the_real_clock_while_a_test_freezes_time() -> None:
    """Under freeze_time in 2001, the clock pytest times tests with still says now, and a
    duration measured across a frozen stretch is the real one, not the years between."""
    before = time.time()
    with freeze_time("2001-01-01"):
        assert time.time() < 1e9  # the test's own clock is frozen in 2001
        start = timing.perf_counter()
        time.sleep(0.01)
        took = timing.perf_counter() - start
        assert timing.time() >= before
    assert 0.005 <= took < 5.0, took
