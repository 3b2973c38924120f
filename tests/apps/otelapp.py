"""A Celery app for the prefork tracing test, set up as docs/tracing.md shows.

Each pool child sets OpenTelemetry's global tracer provider and instruments Celery in
its own ``worker_process_init``; celery-redlock is told nothing. Every finished span
is pushed as one JSON object onto the ``spans`` list of OTELAPP_RECORD, for the test.

OTELAPP_BROKER, OTELAPP_BACKEND, OTELAPP_LOCKS, OTELAPP_RECORD: Redis URLs.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import Any

import redis
from celery import Celery
from celery.signals import worker_process_init
from opentelemetry import trace
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from celery_redlock import LockedTask

app = Celery(
    "otelapp",
    broker=os.environ.get("OTELAPP_BROKER", "redis://127.0.0.1:1/0"),
    backend=os.environ.get("OTELAPP_BACKEND", "redis://127.0.0.1:1/2"),
)
app.conf.redlock_url = os.environ.get("OTELAPP_LOCKS", "redis://127.0.0.1:1/1")
app.conf.worker_prefetch_multiplier = 1
app.conf.broker_connection_retry_on_startup = True


class RedisSpanExporter(SpanExporter):
    """Pushes each span (name, ids, parent, attributes, pid) onto a Redis list."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        for span in spans:
            ctx = span.get_span_context()
            record: dict[str, Any] = {
                "name": span.name,
                "trace_id": ctx.trace_id,
                "span_id": ctx.span_id,
                "parent_id": span.parent.span_id if span.parent is not None else None,
                "attributes": dict(span.attributes or {}),
                "pid": os.getpid(),
            }
            self.client.rpush("spans", json.dumps(record, default=str))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.client.close()


@worker_process_init.connect(weak=False)
def init_tracing(**_: Any) -> None:
    provider = TracerProvider()
    provider.add_span_processor(
        SimpleSpanProcessor(RedisSpanExporter(os.environ["OTELAPP_RECORD"]))
    )
    trace.set_tracer_provider(provider)
    CeleryInstrumentor().instrument()


@app.task(base=LockedTask, lock_key="otel:<n>")
def work(n: int) -> int:
    time.sleep(0.1)
    return n
