"""The version is written in one place, celery_redlock.__version__, and the CHANGELOG has
a dated heading for it."""

from __future__ import annotations

import re
from pathlib import Path

import celery_redlock

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_reads_the_version_from_the_package() -> None:
    """pyproject.toml writes no version of its own: setuptools takes __version__."""
    text = (ROOT / "pyproject.toml").read_text()  # tomllib is 3.11+; these lines suffice
    project = text.split("\n[project]\n", 1)[1].split("\n[", 1)[0]
    assert not re.search(r"^version\s*=", project, re.M), "a second version in [project]"
    assert re.search(r'^dynamic = \[[^\]]*"version"', project, re.M)
    dynamic = text.split("\n[tool.setuptools.dynamic]\n", 1)[1].split("\n[", 1)[0]
    assert re.search(r'^version = \{ ?attr = "celery_redlock.__version__" ?\}', dynamic, re.M)


def test_the_changelog_has_a_dated_heading_for_the_version() -> None:
    """The CHANGELOG's first release heading is `## [<__version__>] - YYYY-MM-DD`."""
    text = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[(\d[^\]]*)\] - (\d{4}-\d{2}-\d{2})$", text, re.M)
    assert releases, "no dated release heading"
    assert releases[0][0] == celery_redlock.__version__, releases[0]
