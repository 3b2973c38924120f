"""The Django project's Celery app, as a Django project writes it."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.apps.djbeat.settings")

app = Celery("djbeat")
app.config_from_object("django.conf:settings", namespace="CELERY")


@app.task(name="djbeat.tick")
def tick() -> None:
    """Does nothing: the tests count what beat publishes."""
