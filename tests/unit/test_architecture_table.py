"""docs/architecture.md's capability x backend table says what the code says: each row's
"yes"/"no" per backend is what ``has(backend, capability)`` answers, and every
capability of the seam has a row."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from celery_redlock.core import backend as seam
from celery_redlock.core import connect, open_backend
from celery_redlock.core.backends import RedisBackend

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
HEADER = "| capability | verbs | memory | redis | quorum |"


def _doc_table() -> dict[str, tuple[str, str, str]]:
    """capability name -> the first word of its memory, redis and quorum cells."""
    lines = DOC.read_text("utf-8").splitlines()
    start = lines.index(HEADER) + 2  # past the header and its rule
    rows: dict[str, tuple[str, str, str]] = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        memory, redis_, quorum = (c.split()[0] for c in cells[2:5])
        rows[cells[0].strip("`")] = (memory, redis_, quorum)
    return rows


def _word(backend: Any, capability: type) -> str:
    """Whether *backend* (an instance, or a class whose verbs are its own) has every member
    of *capability*, as :func:`~celery_redlock.core.backend.has` looks them up."""
    return "yes" if all(hasattr(backend, n) for n in seam._members_of(capability)) else "no"


def test_the_capability_table_matches_the_backends() -> None:
    """Each backend has exactly the capabilities the doc's table gives it."""
    capabilities = {
        name: value
        for name, value in vars(seam).items()
        if isinstance(value, type) and value in seam._MEMBERS
    }
    assert {"Backend", "Permits", "Probe", "Sends"} <= set(capabilities)
    quorum = open_backend([connect(f"memory://table-{i}") for i in range(3)])
    # A Redis backend's verbs are its class's: no client is needed to read them.
    found = {
        name: (
            _word(connect("memory://table"), capability),
            _word(RedisBackend, capability),
            _word(quorum, capability),
        )
        for name, capability in capabilities.items()
    }
    assert _doc_table() == found
