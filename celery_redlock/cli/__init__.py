"""``celery locks``: the command (command) and how it shows locks, rates and controls
(render). ``celery_redlock.cli:locks`` is the ``celery.commands`` entry point."""

from __future__ import annotations

from .command import locks

__all__ = ["locks"]
