"""The three policy kinds, one registry each: ``lock_on_contended`` (:data:`CONTENDED`),
``lock_on_duplicate`` (:data:`DUPLICATE`) and ``lock_on_lost`` (:data:`LOST`).

A registry is the configuration's side of a policy kind: its option's row checks a name
against it (the check accepts exactly the registered names and lists them in
registration order), and :func:`celery_redlock.app.config.resolve` turns the name into its
object once per task class and app, so a run never looks a policy up by name. The run
side fills the registries: :mod:`celery_redlock.task.contention` registers its strategies and
publish policies, :mod:`celery_redlock.task.interrupt` its lost policies. Adding a policy is
one ``register`` call beside its code.

When they are filled: on import of the package. ``celery_redlock/__init__.py`` imports
``task/locked_task.py``, which imports ``task/run.py``, which imports ``task/contention.py``
and ``task/interrupt.py``; and Python runs the package's ``__init__`` before any of its
modules, so a process that imports only ``celery_redlock.app.config`` still checks against full
registries (``tests/unit/test_config.py`` runs that in a fresh interpreter). The
configuration never imports the run side itself: the dependency points one way.
"""

from __future__ import annotations

from typing import Any, Generic, Protocol, TypeVar

from .checks import Choice

__all__ = ["CONTENDED", "DUPLICATE", "LOST", "POLICIES", "Named", "Policies"]


class Named(Protocol):
    """A policy: an object the run side uses, known by its name."""

    @property
    def name(self) -> str: ...


P = TypeVar("P", bound=Named)


class Policies(Choice, Generic[P]):
    """The registry of one policy kind: its names in registration order, each with its
    object. As a check it accepts exactly the registered names."""

    def __init__(self, kind: str, attribute: str) -> None:
        super().__init__()
        #: The task option whose values these are (``"lock_on_contended"``).
        self.kind = kind
        #: The ``TaskOptions`` attribute that holds a task's resolved policy (``"contended"``).
        self.attribute = attribute
        self._policies: dict[str, P] = {}

    @property
    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._policies)

    def register(self, policy: P) -> P:
        """Add *policy* under its name (a name registered twice is a ValueError)."""
        if policy.name in self._policies:
            raise ValueError(f"{self.kind} {policy.name!r} is registered already")
        self._policies[policy.name] = policy
        return policy

    def __getitem__(self, name: str) -> P:
        """The policy registered as *name* (KeyError naming the kind if none is)."""
        try:
            return self._policies[name]
        except KeyError:
            raise KeyError(f"no {self.kind} policy {name!r} (registered: {self.names})") from None

    def __repr__(self) -> str:
        return f"Policies({self.kind!r}: {', '.join(self.names)})"


#: ``lock_on_contended``: what a run gets when its key is held (``contention.Strategy``).
CONTENDED: Policies[Any] = Policies("lock_on_contended", "contended")
#: ``lock_on_duplicate``: what a publish gets that finds its key queued or running
#: (``contention.PublishPolicy``).
DUPLICATE: Policies[Any] = Policies("lock_on_duplicate", "duplicate")
#: ``lock_on_lost``: what a running body gets when its lock is lost (``interrupt.LostPolicy``).
LOST: Policies[Any] = Policies("lock_on_lost", "lost")

#: Task option -> its registry.
POLICIES: dict[str, Policies[Any]] = {p.kind: p for p in (CONTENDED, DUPLICATE, LOST)}
