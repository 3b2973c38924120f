"""Following a Sentinel-managed master through a failover: :class:`MasterWatch`, one per
Sentinel connection pool in each process, through which the Redis backend sends every
script to such a master.

What a planned failover (``SENTINEL FAILOVER``) does to clients that only follow
redis-py's Sentinel pool (measured on loopback)::

    t=0.00  the leader sentinel picks the replica R to promote
    t=0.12  +failover-state-send-slaveof-noone: it tells R to stop replicating
    t=0.19  R is a master. The old master M is one too and still takes writes;
            nothing written to M from now on reaches R
    t=1.16  +switch-master: the sentinels name R. The pool asks the sentinels only
            when it opens a connection: connections already open keep locking on M,
            new ones lock on R. One key gets two holders, neither told; R's fence
            counters lag M's, so fences repeat and go back
    t=11.2  +convert-to-slave: M becomes R's replica and drops what only it had

What the watch does, in every process that locks on a Sentinel-managed master:

* It listens to every sentinel (one thread and one pub/sub connection each, for the
  life of the pool in this process). From the leader's
  ``+failover-state-send-slaveof-noone`` until ``+switch-master`` (or the failover's
  end), no script goes to the old master: a call reports it unavailable
  (:class:`~.client.MasterChanging`, then ``StoreUnavailable``) rather than
  write what R would never see.
* On ``+switch-master`` (or when a call finds its connection on a server other than
  the one the sentinels name) it first marks the old master as replaced
  (``master_mark.lua``), then makes the pool drop its connections there, renews every
  lock this process holds on that master at once (a lock missing on R is reported lost
  now, not at the next round), and logs a WARNING naming them.
* Every script goes out behind ``master_guard.lua``, with the config-epoch at which the
  sentinels made *the server its connection reached* the master: a server marked as
  replaced refuses it (so a process that has not heard of the switch yet cannot take a
  lock there after another took it on R), and every fence it hands out is at least
  ``epoch * 10**12`` plus the server's clock in microseconds, above every fence a
  master of an earlier epoch handed out.

What no client can close: a lock written on M less than one replication lag before R
stopped replicating is missing on R; its holder is told by the renewal on R (see
docs/sentinel-cluster.md, "Failover").
"""

from __future__ import annotations

import logging
import re
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

from redis import exceptions as rx
from redis.sentinel import SentinelConnectionPool

from ... import process
from ...backend_types import text
from ...renewal import get_manager
from .client import MasterChanging, checkout
from .scripts import MASTER_MARK, Script, send_script

__all__ = ["MAX_EPOCH", "MasterView", "MasterWatch", "is_sentinel_master", "watch_of"]

log = logging.getLogger("celery_redlock.failover")

#: The highest config-epoch a fence floor takes: ``epoch * 10**12`` plus the clock in
#: microseconds (below 2**52 until the year 2112) stays below 2**53, where the scripts'
#: numbers (doubles) are exact. Past it, fences no longer rise across failovers.
MAX_EPOCH = 4503
#: The sentinels' events the watch listens to (PSUBSCRIBE patterns).
CHANNELS = ("+switch-master", "+failover-state-send-slaveof-noone", "-failover-abort-*")
#: How long a listener waits for a message before it looks at its state again (s).
LISTEN_WAKE = 1.0
#: While a failover is under way: how often the leader is asked whether it still is (s).
PAUSED_WAKE = 0.2
#: How long a failover holds calls back after the last sign that it is under way (s).
PAUSE_LIMIT = 5.0
#: A listener whose sentinel failed waits this long before it connects again (s).
RETRY_WAIT = 1.0
#: The longest a mark on an old master may take to write (s); it is best effort.
MARK_TIMEOUT = 0.5
#: How long a mark lives on the old master (ms): until the sentinels have made it a
#: replica (which replaces its data) many times over.
MARK_TTL_MS = 24 * 3600 * 1000
_REPLACED = re.compile(r"\bREPLACED (\d+)")


class MasterView(NamedTuple):
    """The master of a service as the sentinels name it: its address, and the
    config-epoch at which they made it the master."""

    address: tuple[str, int]
    epoch: int


def is_sentinel_master(pool: Any) -> bool:
    """True for the pool of a Sentinel ``master_for()`` client."""
    return isinstance(pool, SentinelConnectionPool) and bool(getattr(pool, "is_master", False))


class MasterWatch:
    """The sentinels' view of one service's master, for one connection pool in this
    process, and the threads that keep it current (started on first use, stopped when
    the pool goes)."""

    def __init__(self, pool: Any) -> None:
        self._pool = weakref.ref(pool)
        self.service: str = pool.service_name
        self._manager = pool.sentinel_manager
        #: redis-py (5.1+) may replace the address sentinels give with one IP; the pool's
        #: connections then reach that IP, which is what a view must name too.
        self._forced_ip: str | None = getattr(self._manager, "_force_master_ip", None)
        self._view: MasterView | None = None
        #: monotonic() until which calls are held back (a failover under way), 0.0 none.
        self._paused_until = 0.0
        self._pausing: Any = None  # the sentinel that announced the failover
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        #: Key prefix -> its replaced-master mark key (every prefix scripts used here).
        self._marks: dict[str, str] = {}
        self._finalizer = weakref.finalize(pool, _gone, id(pool), self)
        self._warned_epoch = False

    # -- calls ------------------------------------------------------------------------
    def run(self, pool: Any, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """*script* on the master, behind ``master_guard.lua``, on a connection of *pool*
        given back before it returns (as :func:`~.scripts.run`)."""
        if not self._threads:
            self._start()
        mark = self._mark_of(keys[0] if keys else "")
        guarded = script.guarded
        conn = checkout(pool)
        try:
            return conn.retry.call_with_retry(
                lambda: self._attempt(conn, guarded, keys, args, mark),
                lambda _error: conn.disconnect(),
            )
        finally:
            pool.release(conn)

    def _attempt(
        self, conn: Any, script: Script, keys: Sequence[str], args: Sequence[Any], mark: str
    ) -> Any:
        conn.connect()  # a no-op when connected; else the pool resolves the master
        address = (str(conn.host), int(conn.port))
        epoch = self.epoch_of(address)
        try:
            return send_script(conn, script, [*keys, mark], [*args, epoch])
        except rx.ResponseError as exc:
            replaced = _REPLACED.search(str(exc))
            if replaced is None:
                raise
        conn.disconnect()
        self.refresh()
        raise MasterChanging(
            f"{_host(address)} was replaced as the master of {self.service!r} at "
            f"config-epoch {replaced.group(1)}; nothing was changed there"
        )

    def epoch_of(self, address: tuple[str, int]) -> int:
        """The config-epoch of the master at *address* (for its fence floor); raises
        :class:`MasterChanging` when the sentinels name another server, or while a
        failover of this master is under way."""
        view = self._view
        if view is None or view.address != address:
            view = self.refresh(address)
        if self._paused_until and time.monotonic() < self._paused_until:
            raise MasterChanging(
                f"a failover of the Sentinel master {self.service!r} ({_host(view.address)}) "
                "is under way: nothing is sent to it until the sentinels name the new master"
            )
        if view.address != address:
            raise MasterChanging(
                f"{_host(address)} is not the master of {self.service!r}: the sentinels name "
                f"{_host(view.address)} (config-epoch {view.epoch})"
            )
        if view.epoch > MAX_EPOCH:
            if not self._warned_epoch:
                self._warned_epoch = True
                log.warning(
                    "Sentinel master %r is at config-epoch %d: fences no longer rise across "
                    "its failovers past epoch %d",
                    self.service,
                    view.epoch,
                    MAX_EPOCH,
                )
            return MAX_EPOCH
        return view.epoch

    @property
    def view(self) -> MasterView | None:
        """The master as this process last heard of it (None before the first call)."""
        return self._view

    # -- what the sentinels say -------------------------------------------------------
    def refresh(self, want: tuple[str, int] | None = None) -> MasterView:
        """Ask every sentinel for the master, and follow the one of the latest
        config-epoch when it is later than the one known here (or, when most sentinels
        agree on an earlier one, the sentinels' config was reset: follow that). With
        *want*, return at once when another thread has learned that address meanwhile.
        Raises :class:`MasterChanging` when no sentinel answers."""
        with self._lock:
            view = self._view
            if want is not None and view is not None and view.address == want:
                return view  # another thread learned it meanwhile
            found: list[tuple[MasterView, Any]] = []
            errors: list[str] = []
            for sentinel in list(self._manager.sentinels):
                try:
                    named = self._ask(sentinel)
                except (rx.ConnectionError, rx.TimeoutError, OSError) as exc:
                    errors.append(f"{_sentinel_name(sentinel)}: {type(exc).__name__}: {exc}")
                    continue
                if named is not None:
                    found.append((named, sentinel))
            if not found:
                raise MasterChanging(
                    f"no sentinel names a master for {self.service!r}"
                    + (f" ({'; '.join(errors)})" if errors else "")
                )
            best, sentinel = max(found, key=lambda each: each[0].epoch)
            agree = sum(named == best for named, _ in found)
            reset = agree > len(self._manager.sentinels) // 2
            moved = self._adopt(best, sentinel, reset=reset)
            view = self._view
        if moved is not None:
            self._announce(*moved)
        assert view is not None
        return view

    def _ask(self, sentinel: Any) -> MasterView | None:
        return self._view_of(sentinel.sentinel_masters().get(self.service))

    def _view_of(self, state: dict[str, Any] | None) -> MasterView | None:
        """The master a sentinel's ``SENTINEL MASTERS`` entry names (None: no entry, or
        a failover under way there: the leader gives the new config-epoch as soon as the
        replica is promoted, beside the old master's address, until the switch)."""
        if not state or _failing_over(state):
            return None
        host = self._forced_ip if self._forced_ip is not None else str(state["ip"])
        return MasterView((host, int(state["port"])), int(state.get("config-epoch", 0)))

    def _adopt(
        self, view: MasterView, sentinel: Any, *, reset: bool = False
    ) -> tuple[MasterView, MasterView] | None:
        """Follow *view* when it is newer than the known one (under the lock), or, with
        *reset* (most sentinels name it), when it differs; the old and new view when the
        master moved."""
        old = self._view
        if old is not None and view.epoch <= old.epoch and not (reset and view != old):
            return None
        if old is not None and old.address != view.address and view.epoch > old.epoch:
            self._mark_replaced(old.address, view.epoch)  # before anything goes to the new one
        self._view = view
        self._paused_until = 0.0
        if old is None or old.address == view.address:
            return None
        self._prefer(sentinel)
        self._drop_connections()
        return old, view

    def _prefer(self, sentinel: Any) -> None:
        """Ask *sentinel* first from now on, as redis-py does with the last one that
        answered: a sentinel that has not heard of the switch yet would name the old
        master to the pool's next connection."""
        sentinels = self._manager.sentinels
        if isinstance(sentinels, list) and sentinel in sentinels:
            i = sentinels.index(sentinel)
            sentinels[0], sentinels[i] = sentinels[i], sentinels[0]

    def _drop_connections(self) -> None:
        """Make the pool resolve the master again: its idle connections are closed, and
        the ones in use are closed when they are given back (redis-py's own rule for a
        master that moved)."""
        pool = self._pool()
        if pool is None:
            return
        try:
            pool.get_master_address()
        except Exception:
            log.debug("re-resolving the master of %r failed", self.service, exc_info=True)
            pool.disconnect(inuse_connections=False)

    def _mark_replaced(self, address: tuple[str, int], epoch: int) -> None:
        """Write on the old master that the master of *epoch* replaced it, under every key
        prefix used here, so that it refuses the scripts of processes that have not
        heard yet. Best effort: a server that cannot be reached takes no writes either."""
        pool = self._pool()
        marks = list(self._marks.values())
        if pool is None or not marks:
            return
        kwargs = dict(pool.connection_kwargs)
        for key in ("socket_timeout", "socket_connect_timeout"):
            kwargs[key] = min(kwargs.get(key) or MARK_TIMEOUT, MARK_TIMEOUT)
        conn = pool.connection_class(**kwargs)
        if not hasattr(conn, "connect_to"):  # not redis-py's Sentinel connection class
            return
        try:
            conn.connect_to(address)
            for mark in marks:
                send_script(conn, MASTER_MARK, [mark], [min(epoch, MAX_EPOCH), MARK_TTL_MS])
        except Exception as exc:
            log.info(
                "could not mark the old master %s of %r as replaced (%s: %s)",
                _host(address),
                self.service,
                type(exc).__name__,
                exc,
            )
        finally:
            conn.disconnect()

    def _mark_of(self, key: str) -> str:
        brace = key.find("{")
        prefix = key[:brace] if brace >= 0 else ""
        mark = self._marks.get(prefix)
        if mark is None:
            mark = self._marks.setdefault(prefix, f"{prefix}replaced-master-epoch")
        return mark

    def _announce(self, old: MasterView, new: MasterView) -> None:
        """Say that the master moved; with locks held there, renew them now and WARN."""
        pool = self._pool()
        manager = get_manager()
        held = [lock for lock in manager.held() if _on_pool(lock.backend, pool)]
        moved = (self.service, _host(old.address), old.epoch, _host(new.address), new.epoch)
        if not held:
            log.info(
                "Sentinel master %r moved from %s (config-epoch %d) to %s (config-epoch %d); "
                "this process holds no lock there",
                *moved,
            )
            return
        manager.renew_soon()
        names = ", ".join(
            f"{lock.name!r} (fence {getattr(lock, 'fence', None)})" for lock in held[:20]
        )
        if len(held) > 20:
            names += f" and {len(held) - 20} more"
        log.warning(
            "Sentinel master %r moved from %s (config-epoch %d) to %s (config-epoch %d) while "
            "this process held %d lock(s) there: %s. Each is renewed on the new master now: a "
            "lock the old master took too late to replicate is reported LOST (lock_on_lost) "
            "and may have had another holder meanwhile; fences from the new master are above "
            "every fence of the old one",
            *moved,
            len(held),
            names,
        )

    # -- the listeners ----------------------------------------------------------------
    def _start(self) -> None:
        with self._lock:
            if self._threads or self._stop.is_set():
                return
            for i, sentinel in enumerate(list(self._manager.sentinels)):
                thread = threading.Thread(
                    target=self._listen,
                    args=(sentinel,),
                    name=f"celery-redlock-sentinel-{self.service}-{i}",
                    daemon=True,
                )
                self._threads.append(thread)
                thread.start()

    def stop(self) -> None:
        """Stop the listeners (each closes its connection within :data:`LISTEN_WAKE`)."""
        self._stop.set()

    @property
    def threads(self) -> list[threading.Thread]:
        """The listener threads (for tests and diagnostics)."""
        return list(self._threads)

    def _listen(self, sentinel: Any) -> None:
        while not self._stop.is_set():
            pubsub = None
            try:
                pubsub = sentinel.pubsub()
                pubsub.psubscribe(*CHANNELS)
                while not self._stop.is_set():
                    paused = self._pausing is sentinel and self._paused_until
                    message = pubsub.get_message(timeout=PAUSED_WAKE if paused else LISTEN_WAKE)
                    if message is None:
                        if paused:
                            self._still_failing_over(sentinel)
                        continue
                    self._heard(sentinel, message)
            except Exception as exc:  # the listener outlives any error; it connects again
                if not self._stop.is_set():
                    log.debug(
                        "listening to sentinel %s failed (%s: %s); again in %.0f s",
                        _sentinel_name(sentinel),
                        type(exc).__name__,
                        exc,
                        RETRY_WAIT,
                    )
                    self._stop.wait(RETRY_WAIT)
            finally:
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except Exception:
                        log.debug("closing a sentinel subscription failed", exc_info=True)

    def _heard(self, sentinel: Any, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == "psubscribe":
            if message.get("data") == len(CHANNELS):  # (re)subscribed: catch up on a switch
                self._catch_up(sentinel)
            return
        if kind != "pmessage":
            return
        channel, words = text(message["channel"]), text(message["data"]).split()
        # +switch-master: "<name> <old ip> <old port> <new ip> <new port>"
        if channel == "+switch-master" and words[:1] == [self.service]:
            self._catch_up(sentinel)
        elif channel == "+failover-state-send-slaveof-noone":
            # "slave <ip:port> <ip> <port> @ <master name> <master ip> <master port>"
            at = words.index("@") if "@" in words else -1
            if at >= 0 and words[at + 1 : at + 2] == [self.service]:
                self._pause(sentinel, words[at + 2 : at + 4])
        # -failover-abort-*: "master <name> <ip> <port>"
        elif channel.startswith("-failover-abort") and words[1:2] == [self.service]:
            self._resume(f"the sentinels gave the failover up ({channel})")

    def _catch_up(self, sentinel: Any) -> None:
        """Follow what *sentinel* names now, when it is newer than what is known here."""
        try:
            state = sentinel.sentinel_masters().get(self.service)
        except (rx.RedisError, OSError) as exc:
            log.debug("asking sentinel %s failed: %s", _sentinel_name(sentinel), exc)
            return
        self._follow(state, sentinel)

    def _follow(self, state: dict[str, Any] | None, sentinel: Any) -> None:
        named = self._view_of(state)
        if named is None:
            return
        with self._lock:
            moved = self._adopt(named, sentinel)
        if moved is not None:
            self._announce(*moved)

    def _pause(self, sentinel: Any, master: list[str]) -> None:
        view = self._view
        if view is None or len(master) != 2 or _address(master) != view.address:
            return
        with self._lock:
            if self._view is view:
                self._pausing = sentinel
                self._paused_until = time.monotonic() + PAUSE_LIMIT
        log.info(
            "a failover of Sentinel master %r (%s) is under way: lock calls there are "
            "refused until the sentinels name the new master",
            self.service,
            _host(view.address),
        )

    def _resume(self, why: str) -> None:
        with self._lock:
            if not self._paused_until:
                return
            self._paused_until = 0.0
            self._pausing = None
        log.info("lock calls to Sentinel master %r go on: %s", self.service, why)

    def _still_failing_over(self, sentinel: Any) -> None:
        """While paused: follow a switch the message of which was missed, or hold calls
        back longer while the leader still reports the failover."""
        try:
            state = sentinel.sentinel_masters().get(self.service) or {}
        except (rx.RedisError, OSError):
            return
        self._follow(state, sentinel)
        if not self._paused_until:
            return
        if _failing_over(state):
            with self._lock:
                if self._paused_until:
                    self._paused_until = time.monotonic() + PAUSE_LIMIT
        else:
            self._resume("the sentinels report no failover under way")

    def _forked(self) -> None:
        """In a forked child: this watch's threads and connections are the parent's."""
        self._finalizer.detach()


def _failing_over(state: dict[str, Any]) -> bool:
    """True when a sentinel's entry for a master says it leads a failover of it now."""
    return "failover_in_progress" in str(state.get("flags", ""))


def _on_pool(backend: Any, pool: Any) -> bool:
    """True when *backend* (a Redis backend, or a quorum with one) sends to *pool*."""
    if pool is None:
        return False
    client = getattr(backend, "client", None)
    if client is not None and getattr(client, "connection_pool", None) is pool:
        return True
    return any(_on_pool(member, pool) for member in getattr(backend, "members", ()))


def _address(words: Sequence[str]) -> tuple[str, int]:
    return str(words[0]), int(words[1])


def _host(address: tuple[str, int]) -> str:
    return f"{address[0]}:{address[1]}"


def _sentinel_name(sentinel: Any) -> str:
    kwargs = getattr(getattr(sentinel, "connection_pool", None), "connection_kwargs", {})
    return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"


#: The watch of each pool in this process, by id(pool) (dropped when the pool goes).
_watches: dict[int, MasterWatch] = {}
#: Reentrant: a pool dropped in a reference cycle is finalized (_gone) by the cyclic
#: garbage collector, which may run at any allocation, also inside ``watch_of()`` while
#: this thread holds the lock (making a MasterWatch); a plain Lock deadlocks it there.
_watches_lock = process.ForkLock(threading.RLock)


def watch_of(pool: Any) -> MasterWatch:
    """The watch of *pool* (a Sentinel master pool) in this process, made on first use."""
    watch = _watches.get(id(pool))
    if watch is None or watch._pool() is not pool:
        with _watches_lock:
            watch = _watches.get(id(pool))
            if watch is None or watch._pool() is not pool:
                watch = _watches[id(pool)] = MasterWatch(pool)
    return watch


def _gone(key: int, watch: MasterWatch) -> None:
    watch.stop()
    with _watches_lock:
        if _watches.get(key) is watch:
            del _watches[key]


def _after_fork() -> None:
    for watch in _watches.values():
        watch._forked()
    _watches.clear()


process.on_fork(_after_fork)
