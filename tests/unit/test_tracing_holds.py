"""The open hold spans are bounded, and end when tracing is switched off."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from celery_redlock.app import tracing
from celery_redlock.core.events import LockEvent

OWNER = {"task_name": "t", "task_id": "id-1"}


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """Tracing on into an in-memory exporter, at most two open holds; off afterwards."""
    exported = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    monkeypatch.setattr(tracing, "MAX_OPEN_HOLDS", 2)
    monkeypatch.setattr(tracing, "_mode", tracing._mode)  # restored after disable_tracing
    assert tracing.enable_tracing(provider)
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("caller"):
        yield exported
    tracing.disable_tracing()
    provider.shutdown()


def event(kind: str, name: str, fence: int) -> LockEvent:
    return LockEvent(
        kind,  # type: ignore[arg-type]
        name,
        f"redlock:{{{name}}}",
        fence=fence,
        holder=OWNER,
        limit=1,
        waited=0.0 if kind == "acquired" else None,
        held=0.5 if kind != "acquired" else None,
    )


def holds(exported: InMemorySpanExporter) -> dict[str, str]:
    return {
        str((s.attributes or {})["redlock.key"]): str((s.attributes or {})["redlock.outcome"])
        for s in exported.get_finished_spans()
        if s.name == "redlock.hold"
    }


def test_past_the_bound_the_oldest_open_hold_ends_untracked(
    exporter: InMemorySpanExporter,
) -> None:
    """Three acquisitions never released with room for two: the oldest hold span ends
    as ``untracked``; a release of a tracked one ends it as ``released``; one of an
    evicted hold (or of one never seen) makes nothing."""
    for fence, name in enumerate(("a", "b", "c"), start=1):
        tracing.tracing_hook(event("acquired", name, fence))
    assert holds(exporter) == {"a": "untracked"}
    tracing.tracing_hook(event("released", "b", 2))
    tracing.tracing_hook(event("released", "a", 1))
    tracing.tracing_hook(event("released", "zzz", 9))
    assert holds(exporter) == {"a": "untracked", "b": "released"}


def test_disable_tracing_ends_the_open_holds_and_stops_new_spans(
    exporter: InMemorySpanExporter,
) -> None:
    """disable_tracing(): a hold still open ends ``untracked``; later events make no span."""
    tracing.tracing_hook(event("acquired", "a", 1))
    tracing.disable_tracing()
    assert holds(exporter) == {"a": "untracked"}
    count = len(exporter.get_finished_spans())
    tracing.tracing_hook(event("acquired", "b", 2))
    assert len(exporter.get_finished_spans()) == count
    assert not tracing.tracing_on()
