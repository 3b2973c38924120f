"""One Celery app's side of celery-redlock: its options and their checks (rows, config,
checks, flags, policies), its per-process state, its flow rules and controls, and what it
reports (observability). Nothing here runs a task; ``task/`` and ``worker/`` build on it.
"""
