"""A Celery app for ``celery locks`` tests.

``LOCKSAPP_REDLOCK_URL`` sets ``redlock_url`` (a comma-separated value becomes a list:
Redlock masters). In-process tests import this module and set ``app.conf.redlock_url``
to their own throwaway servers instead.
"""

from __future__ import annotations

import os

from celery import Celery

app = Celery("locksapp", broker="memory://")
_url = os.environ.get("LOCKSAPP_REDLOCK_URL", "")
app.conf.redlock_url = (_url.split(",") if "," in _url else _url) or None
app.conf.redlock_ttl = 30.0
