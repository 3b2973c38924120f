"""What the worker's pool offers a locked run, read from the pool class at start-up.

Celery names the pool it runs by its class (``WorkController.pool_cls``, resolved from
``-P``). What differs for a locked run between the pools Celery ships:

========  ==================================  ===================  ======================
pool      where a body runs                   dead-child watch     ``lock_on_lost="raise"``
========  ==================================  ===================  ======================
prefork   a forked child's main thread        yes                  a signal: cuts a
                                                                   blocking call short
solo      the worker's main thread            no child to watch    a signal, as prefork
threads   a thread of the worker              no child to watch    at the body's next
                                                                   Python instruction
gevent,   a green thread of the worker        no child to watch    at the body's next
eventlet  (the renewal thread is one too)                          switch (I/O, sleep)
========  ==================================  ===================  ======================

A pool is told apart by its class (a subclass of Celery's prefork, solo or threads pool)
and by its public ``is_green`` attribute; an unknown pool gets no child watch, and its
runs still release their own locks (a lost child's lock expires within its TTL).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Pool", "pool_of"]


@dataclass(frozen=True)
class Pool:
    """The worker's pool, as a locked run sees it."""

    #: The ``-P`` name (``prefork``, ``gevent``, ...), else the class's import path.
    name: str
    #: Tasks run in forked child processes: the main process watches them and frees the
    #: lock of a run whose child died at once.
    children: bool = False
    #: Tasks run as green threads (gevent, eventlet); so does the renewal thread.
    green: bool = False
    #: Tasks run one at a time in the worker's main thread (solo).
    solo: bool = False
    #: Tasks run in threads of the worker (threads).
    threads: bool = False

    def limits(self) -> str | None:
        """The one start-up line that says what this pool cannot do for a locked run, or
        None (prefork: everything)."""
        if self.children:
            return None
        where = (
            "as green threads of this process"
            if self.green
            else "in this process's main thread"
            if self.solo
            else "in threads of this process"
            if self.threads
            else "in a way celery-redlock does not know"
        )
        line = (
            f"celery-redlock: pool {self.name} runs tasks {where}: no pool child to watch "
            "(a run that ends frees its own lock; a killed worker's locks expire within "
            "their TTL)"
        )
        if self.green:
            zero = f"{self.name}.sleep(0)" if self.name in ("gevent", "eventlet") else "sleep(0)"
            return line + (
                "; lock renewal runs as a green thread too, so a body must yield (I/O, "
                f"time.sleep, {zero}) at least every lock_ttl/3, and lock_on_lost='raise' "
                "interrupts a body at its next yield"
            )
        if self.threads:
            return line + (
                "; lock_on_lost='raise' interrupts a body at its next Python instruction, "
                "so a body inside one long blocking call (time.sleep, a socket read) learns "
                "of the loss when that call returns"
            )
        return line


def pool_of(pool_cls: Any) -> Pool:
    """The :class:`Pool` of a worker whose pool class is *pool_cls*."""
    from celery import concurrency  # noqa: PLC0415 - a worker's start only

    if not isinstance(pool_cls, type):
        return Pool(name=repr(pool_cls))
    path = f"{pool_cls.__module__}:{pool_cls.__qualname__}"
    aliases: dict[str, str] = getattr(concurrency, "ALIASES", {})
    name = next((alias for alias, target in aliases.items() if target == path), path)

    def kind(alias: str) -> bool:
        # Only the pools Celery ships that this class could derive from; gevent and
        # eventlet are never imported here (that would import the library).
        try:
            shipped = concurrency.get_implementation(alias)
        except Exception:  # a Celery without this pool
            return False
        return isinstance(shipped, type) and issubclass(pool_cls, shipped)

    return Pool(
        name=name,
        children=kind("prefork"),
        green=bool(getattr(pool_cls, "is_green", False)),
        solo=kind("solo"),
        threads=kind("threads"),
    )
