"""A publish's claim of its queued hold, answered while Celery builds the message.

A de-duplicating publish (:func:`celery_redlock.task.dedup.publish_held`) sends its claim
(:meth:`~celery_redlock.core.queued.QueuedHold.claim_later`) and then calls Celery's own
``apply_async``: the claim's round trip to Redis overlaps Celery's work on the message
(its body serialised, its headers made). The answer is read where the message is built and
nothing has gone to the broker yet: in ``app.amqp.create_task_message``, which
:func:`hook` wraps once per app. A duplicate stops the publish there (:class:`NotSent`),
before a producer is taken and before ``before_task_publish`` is sent: nothing is sent.

Timeline of one ``lock_on="enqueue"`` call::

    claim sent (EVALSHA written, not read)
    apply_async -> send_task -> create_task_message builds the message   | the claim's
                                                                         | round trip
    the wrapper reads the answer: queued -> the message goes out; a duplicate -> NotSent

Where the hook cannot be installed (an ``app.amqp`` without ``create_task_message``, as a
custom AMQP class might have), the publish reads the answer before calling Celery.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from ..core import Queued
from ..core.queued import PendingClaim

__all__ = ["Deciding", "NotSent", "deciding", "hook"]


class NotSent(Exception):
    """Stops a publish whose claim found a duplicate (raised in the message builder)."""

    def __init__(self, found: Queued) -> None:
        super().__init__(found.owner)
        self.found = found


@dataclass
class Deciding:
    """One publish waiting for its claim's answer."""

    task_id: str
    pending: PendingClaim
    #: Reads the answer and decides: the claim to go on with (None: the answer could not
    #: be read, sent anyway), or raises :class:`NotSent`.
    decide: Callable[[PendingClaim], Queued | None]
    decided: bool = False
    found: Queued | None = field(default=None)

    def answer(self) -> Queued | None:
        """The decision, made now if it was not made while the message was built."""
        if not self.decided:
            self.decided = True
            self.found = self.decide(self.pending)
        return self.found


_deciding: ContextVar[Deciding | None] = ContextVar("celery_redlock_deciding", default=None)


@contextlib.contextmanager
def deciding(
    task_id: str, pending: PendingClaim, decide: Callable[[PendingClaim], Queued | None]
) -> Iterator[Deciding]:
    """While Celery publishes *task_id*, its message builder decides with *decide*."""
    state = Deciding(task_id, pending, decide)
    token = _deciding.set(state)
    try:
        yield state
    finally:
        _deciding.reset(token)
        pending.close()


def hook(app: Any) -> bool:
    """Wrap ``app.amqp.create_task_message`` (once per app) so that the publish waiting
    for a claim decides once its message is built; False when the app's AMQP has no
    such builder (the publish then decides before calling Celery)."""
    amqp = app.amqp
    build = getattr(amqp, "create_task_message", None)
    if getattr(build, "redlock_decides", False):
        return True
    if not callable(build):
        return False

    def create_task_message(task_id: Any, *args: Any, **kwargs: Any) -> Any:
        message = build(task_id, *args, **kwargs)
        state = _deciding.get()
        if state is not None and state.task_id == task_id:
            state.answer()  # a duplicate raises NotSent: nothing reaches the broker
        return message

    create_task_message.redlock_decides = True  # type: ignore[attr-defined]
    amqp.create_task_message = create_task_message
    return True
