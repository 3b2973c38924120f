"""Chaos scenarios: the seed goes in the report header, each scenario's figures in the summary."""

from __future__ import annotations

import pytest
from chaos_harness import FIGURES, LONG, SEED


def pytest_report_header() -> str:
    """First thing printed: the seed that replays this session's fault schedule."""
    mode = "long (make chaos)" if LONG else "short (make test)"
    return f"chaos: CHAOS_SEED={SEED} ({mode})"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line of figures per chaos scenario that ran, whatever the capture mode."""
    if not FIGURES:
        return
    terminalreporter.section(f"chaos figures (CHAOS_SEED={SEED})")
    for figures in FIGURES:
        terminalreporter.write_line(figures.line())
