"""The package as a user installs it: ``python -m build`` makes the sdist and, from it, the
wheel; the wheel goes into a fresh virtualenv and everything below runs from there, in a
directory outside the source tree, so nothing is imported from the checkout.

The fresh venv borrows the test environment's installed dependencies (celery, redis-py,
pytest, pytest-celery) through a ``.pth`` line naming its site-packages directory; a
``.pth`` line that is a plain path runs none of that directory's own ``.pth`` files, so the
checkout's editable install is not loaded and ``celery_redlock`` comes from the wheel
alone (test_the_installed_package_is_the_wheel_not_the_checkout proves it). That keeps
the test free of downloads.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import RedisServer

import celery_redlock

ROOT = Path(__file__).resolve().parents[2]


class Installed:
    """A fresh venv with the built wheel installed, and a working directory outside the
    tree."""

    def __init__(self, venv: Path, work: Path, dist: Path) -> None:
        self.python = venv / "bin" / "python"
        self.work = work
        self.dist = dist

    def run(
        self, *argv: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run the venv's python with *argv* in the working directory (bounded)."""
        clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        return subprocess.run(
            [str(self.python), *argv],
            cwd=self.work, env={**clean, **(env or {})}, capture_output=True, text=True,
            timeout=180, check=False,
        )  # fmt: skip

    def output(self, code: str, *args: str) -> str:
        """What ``python -c`` *code* (*args* after it) prints in the venv; it must exit 0."""
        found = self.run("-c", code, *args)
        assert found.returncode == 0, found.stderr[-3000:]
        return found.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    """Build the sdist and the wheel from a copy of the tracked tree, then install the wheel
    (and nothing else) into a new venv."""
    top = tmp_path_factory.mktemp("wheel")
    source = top / "source"
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True, timeout=60,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).write_bytes(src.read_bytes())
    dist = top / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(source)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    venv = top / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    [wheel] = dist.glob("*.whl")
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
         "--quiet", "--no-deps", "--no-index", str(wheel)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    ours = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    (Path(ours) / "borrowed_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    work = top / "work"
    work.mkdir()
    yield Installed(venv, work, dist)


def test_build_makes_an_sdist_and_a_wheel_with_the_package_data(installed: Installed) -> None:
    """The sdist and the wheel are named for __version__ and carry the Lua scripts, the
    board's static files and py.typed."""
    version = celery_redlock.__version__
    [sdist] = installed.dist.glob("*.tar.gz")
    [wheel] = installed.dist.glob("*.whl")
    assert sdist.name == f"celery_redlock-{version}.tar.gz"
    assert wheel.name.startswith(f"celery_redlock-{version}-")
    names = set(zipfile.ZipFile(wheel).namelist())
    lua = {n for n in names if n.endswith(".lua")}
    tracked = {
        "celery_redlock/" + str(p.relative_to(ROOT / "celery_redlock"))
        for p in (ROOT / "celery_redlock").rglob("*.lua")
    }
    assert lua == tracked and lua, lua ^ tracked
    assert {"celery_redlock/py.typed", "celery_redlock/board/static/board.css",
            "celery_redlock/board/static/board.js"} <= names  # fmt: skip
    with tarfile.open(sdist) as tar:
        in_sdist = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    assert {"pyproject.toml", "README.md", "CHANGELOG.md", "LICENSE"} <= in_sdist


def test_the_installed_package_is_the_wheel_not_the_checkout(installed: Installed) -> None:
    """Imported in the fresh venv, celery_redlock lives in that venv, has py.typed beside it,
    and reports the version written in celery_redlock/__init__.py."""
    code = (
        "import importlib.metadata as m, pathlib, celery_redlock as c; "
        "p = pathlib.Path(c.__file__).parent; "
        "print(p); print(c.__version__); print(m.version('celery-redlock')); "
        "print((p / 'py.typed').is_file())"
    )
    where, version, meta, typed = installed.output(code).split()
    assert where.startswith(str(installed.python.parents[1])), where
    assert version == meta == celery_redlock.__version__
    assert typed == "True"


def test_locks_help_runs_from_the_installed_command(installed: Installed) -> None:
    """`celery -A app locks --help` finds the `locks` command through the installed entry
    point and lists its verbs."""
    (installed.work / "app.py").write_text(
        "from celery import Celery\n"
        "app = Celery('app', broker='memory://')\n"
        "app.conf.redlock_url = 'memory://'\n"
    )
    found = installed.run("-m", "celery", "-A", "app", "locks", "--help")
    assert found.returncode == 0, found.stdout[-2000:] + found.stderr[-2000:]
    for verb in ("list", "release", "serve"):
        assert verb in found.stdout, found.stdout


def test_the_lua_scripts_load_from_the_wheel_against_a_real_redis(
    installed: Installed, server: RedisServer
) -> None:
    """A Lock from the installed package takes and gives back a key on a real server, which
    needs every script it sends to be found as package data."""
    code = (
        "import sys, redis; from celery_redlock import Lock; "
        "r = redis.Redis.from_url(sys.argv[1]); "
        "lock = Lock(r, 'wheel:check', 5); assert lock.acquire(blocking=False); "
        "f = lock.fence; assert r.exists('redlock:{wheel:check}'); lock.release(); "
        "assert not r.exists('redlock:{wheel:check}'); print('fence', f)"
    )
    assert installed.output(code, f"redis://127.0.0.1:{server.port}/9").startswith("fence ")


def test_the_board_serves_its_page_and_static_files_from_the_wheel(installed: Installed) -> None:
    """The board's WSGI app, built from the installed package on a memory:// store, answers
    its overview and both static files."""
    code = (
        "import io; from celery import Celery; from celery_redlock.board import make_app; "
        "app = Celery('b', broker='memory://'); app.conf.redlock_url = 'memory://'; "
        "board = make_app(app); out = []\n"
        "for path in ('/', '/static/board.css', '/static/board.js'):\n"
        "    env = {'REQUEST_METHOD': 'GET', 'PATH_INFO': path, 'QUERY_STRING': '', "
        "'SERVER_NAME': '127.0.0.1', 'SERVER_PORT': '5566', 'HTTP_HOST': '127.0.0.1:5566', "
        "'wsgi.url_scheme': 'http', 'wsgi.input': io.BytesIO()}\n"
        "    seen = {}\n"
        "    body = b''.join(board(env, lambda s, h: seen.setdefault('s', s)))\n"
        "    print(path, seen['s'].split()[0], len(body))\n"
    )
    printed = installed.output(code).splitlines()
    lines = dict((p, (s, int(n))) for p, s, n in (line.split() for line in printed))
    for path in ("/", "/static/board.css", "/static/board.js"):
        status, size = lines[path]
        assert status == "200" and size > 100, (path, status, size)


def test_the_testing_pages_user_test_passes_in_the_installed_package(installed: Installed) -> None:
    """docs/testing.md's conftest.py and its eager test, as printed, pass in the fresh venv
    with no server: the pytest plugin (redlock_store) is found through the wheel's entry
    point. The page's other tests run in test_test_mode.py; Celery's own plugin is loaded
    by -p instead of pytest-celery's, whose imports cost seconds."""
    page = (ROOT / "docs" / "testing.md").read_text()
    section = page.split("\n## A complete test\n", 1)[1].split("\n## ", 1)[0]
    files = dict(re.findall(r"^`(\w+)\.py`[^\n]*:\n\n```python\n(.*?)```", section, re.S | re.M))
    assert sorted(files) == ["conftest", "test_sync"]
    tests = installed.work / "usertest"
    tests.mkdir()
    for name, text in files.items():
        (tests / f"{name}.py").write_text(text)
    found = installed.run(
        "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:celery",
        "-p", "celery.contrib.pytest", "-k", "test_eager_and_direct_calls_lock_too", str(tests),
    )  # fmt: skip
    assert found.returncode == 0, found.stdout[-3000:] + found.stderr[-3000:]
    assert "1 passed, 2 deselected" in found.stdout, found.stdout[-2000:]
