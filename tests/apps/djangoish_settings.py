"""A Django-style settings module (``settings.py``): Celery's settings under the
``CELERY_`` namespace, upper case, read by :mod:`tests.apps.djangoish` with
``config_from_object(..., namespace="CELERY")``; configured from the environment:

NS_BROKER  CELERY_BROKER_URL and CELERY_RESULT_BACKEND (a throwaway Redis)
NS_LOCKS   CELERY_REDLOCK_URL
NS_TTL     CELERY_REDLOCK_TTL
NS_RECORD  a Redis URL where tasks record what they did (not a Celery setting)
NS_EXTRA   optional JSON object of more upper-case settings (a misspelt one included)
"""

from __future__ import annotations

import json
import os

DEBUG = True
CELERY_BROKER_URL = os.environ.get("NS_BROKER", "redis://127.0.0.1:1/0")
CELERY_RESULT_BACKEND = os.environ.get("NS_BROKER", "redis://127.0.0.1:1/0")
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_REDLOCK_URL = os.environ.get("NS_LOCKS", "redis://127.0.0.1:1/6")
CELERY_REDLOCK_TTL = float(os.environ.get("NS_TTL", "30"))
globals().update(json.loads(os.environ.get("NS_EXTRA") or "{}"))
