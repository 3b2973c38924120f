"""The Django project's settings: django-celery-beat's tables in one SQLite file
(``DJBEAT_DB``), Celery's settings under the ``CELERY_`` namespace, the broker and the
locks on a throwaway Redis (``DJBEAT_REDIS``, a ``redis://host:port`` URL)."""

from __future__ import annotations

import os

import django

SECRET_KEY = "tests-only"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["django_celery_beat"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("DJBEAT_DB", "djbeat.sqlite3"),
        "OPTIONS": {"timeout": 20},
    }
}
# Two beats and the test's own edits write the one file: a deferred transaction that
# reads, then writes, gets "database is locked" at once when another writer is ahead of
# it (SQLite does not wait there); an IMMEDIATE one takes the write lock first and waits
# its timeout like any other (Django 5.1 and later).
if django.VERSION >= (5, 1):
    DATABASES["default"]["OPTIONS"]["transaction_mode"] = "IMMEDIATE"
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"

_REDIS = os.environ.get("DJBEAT_REDIS", "redis://127.0.0.1:1")
CELERY_BROKER_URL = f"{_REDIS}/0"
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_REDLOCK_URL = f"{_REDIS}/1"
CELERY_REDLOCK_BEAT_TTL = float(os.environ.get("DJBEAT_TTL", "2"))
CELERY_REDLOCK_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
CELERY_BEAT_MAX_LOOP_INTERVAL = 1
