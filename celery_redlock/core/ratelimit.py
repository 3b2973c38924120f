"""``RateLimiter``: at most *rate* grants per period for one name, across every process.

One backend call (on Redis one script, ``rate.lua``), one round trip per decision,
O(1) memory per name that expires when the limiter is idle again. The algorithm is
GCRA (the generic cell rate algorithm, as in ATM networks and redis-cell): the state is
one timestamp, the *theoretical arrival time* ``tat``, the moment the limiter is empty
again. With the
emission interval ``T = period / rate`` and ``burst`` b, a grant is possible when
``tat - now <= (b - 1) * T``, and moves ``tat`` on by ``T``.

Why GCRA rather than a window:

- a fixed window lets twice the rate through across a window boundary, and a sliding
  log (a sorted set of grant times, as dramatiq's window limiter keeps buckets) costs
  memory per grant; GCRA keeps one number, exact at every instant: in any window of
  one period, at most ``rate + burst - 1`` grants;
- a refusal writes nothing and knows exactly how long until the next grant
  (``tat - (b - 1) * T - now``): ``retry_after`` is a computed time, not a guess;
- time is the server's (``TIME`` inside the script): callers' clocks never disagree.

A refused caller that will come back later (a Celery task re-queued with a countdown)
may *join the line* (``acquire(queue=True)``): it is promised the next slot no other
returning caller was promised, and told to come back exactly then. Returning callers
are spread one per slot instead of all coming back at the next free slot and all but
one being refused again. A returning caller is told to come back a little early
(:func:`slot_lead`: a quarter interval, at most 50 ms) and is expected at its slot within
that lead; a grant that has been possible that long with no promised caller claiming it
lapses to whoever asks. Callers stuck behind a backlog (a re-queued message behind the
rest of a burst of 200) then cost the rate nothing: the grant goes to one that is here.
The line is a hint, not a grant: grants are decided only by ``tat``, so it can never let
more through than the rate.

Not on a list of Redlock masters: a grant counted on a majority of masters does not
bound the grants (three masters: grants counted on {1,2}, {2,3}, {1,3} are three
grants, each master counting two): a backend decides rates when it has the
:class:`~.backend.Rates` capability; a quorum has not.
"""

from __future__ import annotations

import math
import random
import re
import time
from collections.abc import Mapping
from typing import Any

from . import events
from .backend import Rates, need
from .backend_types import RateGrant
from .backends import open_backend
from .errors import ConfigError
from .keys import rate_key
from .lease import check_timeout

__all__ = ["PERIODS", "RateGrant", "RateLimiter", "parse_rate", "slot_lead"]

#: Rate suffixes and their periods in seconds.
PERIODS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*([smhd])\s*$")


def slot_lead(interval: float) -> float:
    """How early a caller promised a slot comes back, and how long after its slot its
    grant waits for it before it lapses: a quarter of the interval, at most 50 ms."""
    return min(interval / 4, 0.05)


def parse_rate(rate: Any) -> tuple[float, float, str]:
    """``(grants, period in seconds, text)`` of a rate: ``"N/s"``, ``"N/m"``, ``"N/h"``,
    ``"N/d"``, or a number of grants per second. ConfigError for anything else."""
    if isinstance(rate, str):
        match = _RATE.match(rate)
        if match is None:
            raise ConfigError(
                f"rate must look like '10/s', '10/m', '10/h' or '10/d' (grants per second, "
                f"minute, hour or day), got {rate!r}"
            )
        grants, period = float(match.group(1)), PERIODS[match.group(2)]
        text = rate.strip().replace(" ", "")
    elif isinstance(rate, (int, float)) and not isinstance(rate, bool):
        grants, period, text = float(rate), 1.0, f"{rate:g}/s"
    else:
        raise ConfigError(
            f"rate must be a string such as '10/m' or a number per second, got {rate!r}"
        )
    if not math.isfinite(grants) or grants <= 0:
        raise ConfigError(f"rate must allow more than 0 grants per period, got {rate!r}")
    if period * 1e6 / grants < 1:
        raise ConfigError(f"rate {rate!r} is above one grant per microsecond")
    return grants, period, text


class RateLimiter:
    """At most *rate* grants per period for *name*, with *burst* at once after an idle spell.

    >>> api = RateLimiter(redis.Redis(), "partner-api:acme", "10/m", burst=2)
    >>> grant = api.acquire()            # never blocks by default
    >>> if grant:
    ...     call_partner()
    ... else:
    ...     reschedule(in_seconds=grant.retry_after)

    *rate* is ``"N/s"``, ``"N/m"``, ``"N/h"``, ``"N/d"`` or a number per second.
    *target* is one Redis (a client, a Sentinel ``master_for()`` client, a
    ``RedisCluster``); a list of Redlock masters is refused (a ConfigError).
    The key ``<prefix>{<name>}:rate`` shares the hash tag of the lock of that name.
    *owner_info* (``task_name``, ...) is the ``holder`` of its ``rate_limited`` events.
    """

    def __init__(
        self,
        target: Any,
        name: str,
        rate: Any,
        *,
        burst: int = 1,
        key_prefix: str = "redlock:",
        owner_info: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"rate limiter name must be a non-empty string, got {name!r}")
        self.grants, self.period, self.rate = parse_rate(rate)
        if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
            raise ConfigError(f"burst must be a whole number >= 1, got {burst!r}")
        self.burst = burst
        self.backend: Rates = need(open_backend(target), Rates)
        self.name = name
        self.key = rate_key(name, key_prefix)
        #: Who asks (``task_name``, ``task_id``, ...): the ``holder`` of its events.
        self.owner_info: dict[str, Any] = dict(owner_info or {})
        #: Microseconds between grants at the steady rate (``T``).
        self.interval_us = max(1, round(self.period * 1e6 / self.grants))
        #: Microseconds a possible grant waits for a promised caller (:func:`slot_lead`).
        self.grace_us = round(slot_lead(self.interval_us / 1e6) * 1e6)

    @property
    def interval(self) -> float:
        """Seconds between grants at the steady rate."""
        return self.interval_us / 1e6

    def acquire(
        self,
        blocking: bool = False,
        timeout: float | None = None,
        *,
        queue: bool | None = None,
    ) -> RateGrant:
        """One grant if the rate allows it now; a refusal consumes nothing.

        Non-blocking (the default): one round trip; the result says whether it was
        granted and ``retry_after``, the seconds until the next grant is possible.
        With ``queue=True`` a refused caller joins the line, and ``retry_after`` is its
        own slot (see the module doc): it asks again then, without *queue*.

        Blocking: joins the line first (a slot within *timeout* only; ``queue=False``
        for a caller that was already promised one), sleeps until its slot and asks
        again, until granted or *timeout* (None: no limit) runs out. Each sleep is the
        computed time to the next slot, never a poll.

        *timeout* is None (no limit) or seconds >= 0, and only with blocking: a negative
        or NaN timeout, or one with ``blocking=False``, is a :class:`ConfigError` (a
        ``ValueError``) naming it, as for :meth:`Lock.acquire
        <celery_redlock.core.lock.Lock.acquire>`.
        """
        timeout = check_timeout(timeout, bool(blocking))  # as Lock.acquire checks it
        if not blocking:
            return self._decide("queue" if queue else "take")
        begin = time.monotonic()
        deadline = None if timeout is None else begin + timeout
        most = 0 if timeout is None else max(1, round(timeout * 1e6))
        grant = self.backend.rate(
            self.name,
            self.key,
            self.interval_us,
            self.burst,
            mode="take" if queue is False else "queue",
            most_us=most,
            grace_us=self.grace_us,
        )
        if not grant.granted:
            self._refused(grant)
        while not grant.granted:
            wait = grant.retry_after + random.uniform(0, min(0.001, self.interval / 10))
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or wait > left:
                    return grant
            time.sleep(wait)
            grant = self.backend.rate(
                self.name, self.key, self.interval_us, self.burst, mode="take"
            )
        self._granted(time.monotonic() - begin)
        return grant

    def peek(self) -> RateGrant:
        """Whether a grant is possible now, and when the next one is; writes nothing."""
        return self.backend.rate(self.name, self.key, self.interval_us, self.burst, mode="peek")

    def _decide(self, mode: str) -> RateGrant:
        begin = time.monotonic()
        grant = self.backend.rate(
            self.name, self.key, self.interval_us, self.burst, mode=mode, grace_us=self.grace_us
        )
        if not grant.granted:
            self._refused(grant)
        else:
            self._granted(time.monotonic() - begin)
        return grant

    def _granted(self, waited: float) -> None:
        """The ``granted`` event: *waited* seconds from the ask (a blocking one's sleeps
        included) to the grant."""
        self._emit("granted", waited=waited)

    def _refused(self, grant: RateGrant) -> None:
        self._emit("rate_limited", retry_after=grant.retry_after)

    def _emit(self, kind: events.EventKind, **fields: Any) -> None:
        """This limiter's *kind* event, built only when a hook wants it."""
        if events.wanted(kind):
            events.emit(
                events.LockEvent(
                    kind=kind, name=self.name, key=self.key, holder=self.owner_info, **fields
                )
            )

    def __repr__(self) -> str:
        return f"<RateLimiter {self.name!r} {self.rate} burst={self.burst}>"
