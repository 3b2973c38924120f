"""Tracing without OpenTelemetry, and its automatic switch, each in a fresh interpreter.

A subprocess is the only place where "was ``opentelemetry`` imported?" has a clean
answer: this test session imports the SDK for tests/integration/test_tracing.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: A locked task run eagerly and called directly on memory:// (no server), then a
#: report: what of OpenTelemetry got imported, whether tracing is on, whether the
#: tracing hook is still registered.
RUN = """
import builtins, json, sys
tried = []  # the celery_redlock modules that import an opentelemetry module
_import = builtins.__import__

def _recording_import(name, globals=None, *args, **kwargs):
    importer = (globals or {}).get("__name__", "")
    if name.split(".")[0] == "opentelemetry" and importer.startswith("celery_redlock"):
        tried.append(importer)
    return _import(name, globals, *args, **kwargs)

builtins.__import__ = _recording_import
from celery import Celery
import celery_redlock
from celery_redlock import LockedTask
from celery_redlock.app import tracing
from celery_redlock.core import events

app = Celery("tr", broker="memory://", backend="cache+memory://", set_as_current=False)
app.conf.update(redlock_url="memory://tracing-off", task_always_eager=True)

@app.task(base=LockedTask, shared=False, lock_key="k:<n>")
def work(n):
    return n

with_spans = SETUP
assert work.apply((1,)).get() == 1
assert work(2) == 2
assert work.delay(3).get() == 3
print(json.dumps({
    "tried": tried,
    "otel": sorted(
        m for m, mod in sys.modules.items() if m.split(".")[0] == "opentelemetry" and mod
    ),
    "on": tracing.tracing_on(),
    "hooked": tracing.tracing_hook in events._hooks,
    "spans": with_spans(),
}))
"""

#: Makes every ``opentelemetry`` module unimportable, as where the extra is not installed.
BLOCK = """
import sys
sys.modules["opentelemetry"] = None  # import opentelemetry... raises ImportError
"""

#: An SDK provider set as the global one before the first locked run, as a user's
#: start-up code does; the runs happen under a span of the caller's.
CONFIGURED = """
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
caller = trace.get_tracer("test").start_span("caller")
from opentelemetry import context
context.attach(trace.set_span_in_context(caller))

def with_spans():
    parent = caller.get_span_context().span_id
    return sorted(
        [s.name, dict(s.attributes)["redlock.outcome"], s.parent.span_id == parent]
        for s in exporter.get_finished_spans()
    )
"""


def _run(prelude: str, setup: str = "lambda: []") -> dict[str, object]:
    script = textwrap.dedent(prelude) + RUN.replace("SETUP", setup)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_without_opentelemetry_nothing_is_imported_and_no_hook_is_registered() -> None:
    """With ``opentelemetry`` unimportable, importing celery_redlock and running locked
    tasks (eager, direct, delay) imports none of it and registers no tracing hook: no
    lock event pays for tracing."""
    report = _run(BLOCK)
    assert report == {"tried": [], "otel": [], "on": False, "hooked": False, "spans": []}


def test_installed_but_not_configured_makes_no_spans_and_the_hook_removes_itself() -> None:
    """With the package installed but no tracer provider set, the first lock event
    decides "off" and the hook is gone, so later events cost nothing. (redis-py imports
    OpenTelemetry by itself where it is installed; celery-redlock only looks at the
    provider of a module already imported.)"""
    pytest.importorskip("opentelemetry.trace")
    report = _run("")
    assert (report["on"], report["hooked"], report["spans"]) == (False, False, [])
    assert set(report["tried"]) <= {"celery_redlock.app.tracing"}, report["tried"]


def test_a_provider_set_before_the_first_run_turns_spans_on_by_itself() -> None:
    """A global SDK provider set at start-up, no call to celery-redlock: each locked run
    makes an acquire and a hold span, children of the span current at the call."""
    pytest.importorskip("opentelemetry.sdk")
    report = _run(CONFIGURED, setup="with_spans")
    assert report["on"] is True and report["hooked"] is True
    assert report["spans"] == sorted(
        [["redlock.acquire", "acquired", True], ["redlock.hold", "released", True]] * 3
    )
