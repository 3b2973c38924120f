"""Fixtures giving tests real, throwaway Redis servers, proxies, sentinels and clusters.

All of them live on 127.0.0.1 on freshly picked ports and are stopped at teardown; the Redis the
machine runs on 6379 is never touched. ``servers`` (and ``workers``, ``lua``) are in tests/,
on sys.path from tests/conftest.py, which bench/ imports them from as well.
"""

from __future__ import annotations

import atexit
import gc
import os
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import celery
import kombu
import pytest
import redis
from celery.contrib.testing.worker import test_worker_started, test_worker_stopped
from inprocess import Env
from kombu.asynchronous import set_event_loop
from servers import (
    ClusterSetup,
    FaultProxy,
    RedisServer,
    SentinelSetup,
    kill_all_servers,
    start_servers,
)
from workers import forget_results

# Servers must not outlive an interrupted run: atexit covers normal exit and Ctrl-C, and a
# SIGTERM handler (installed only if nobody else owns SIGTERM) covers being terminated.
atexit.register(kill_all_servers)


def _kill_servers_then_die(signum: int, frame: FrameType | None) -> None:
    """On SIGTERM, kill our servers, then terminate with the default action."""
    kill_all_servers()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


if (
    threading.current_thread() is threading.main_thread()
    and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
):
    signal.signal(signal.SIGTERM, _kill_servers_then_die)


def _keep_the_hub_polling(worker: Any = None, **_: Any) -> None:
    """kombu < 5.7: an ack from a pool thread (``start_worker`` with ``pool="threads"``) cannot
    wake the worker's event loop, so with its prefetch full the loop sleeps until its next timer
    (up to 10 s) before it fetches again. A 50 ms no-op timer entry bounds that sleep."""
    timer = getattr(getattr(worker, "hub", None), "timer", None)
    if timer is not None and hasattr(timer, "call_repeatedly"):
        timer.call_repeatedly(0.05, lambda: None)


def _forget_the_hub(**_: Any) -> None:
    """kombu < 5.7: the next in-process worker would reuse this worker's closed event loop, whose
    timer is not the one the new consumer schedules countdown/ETA tasks on, so they never ran.
    With no current loop, the next worker makes its own."""
    set_event_loop(None)


if tuple(kombu.VERSION[:2]) < (5, 7):  # kombu 5.7 wakes the loop itself
    test_worker_started.connect(_keep_the_hub_polling, weak=False)
    test_worker_stopped.connect(_forget_the_hub, weak=False)


#: Celery before 5.7 unsubscribes a result's task id when any AsyncResult of it is
#: collected, retrying for up to 20 s when that result's Redis is gone (celery#4925).
#: Results left in reference cycles by earlier tests are collected before each test
#: there, so that this never runs inside a timed part of another test.
_COLLECT_FIRST = celery.VERSION < (5, 7)


@pytest.fixture(autouse=True)
def _collect_earlier_results() -> None:
    if _COLLECT_FIRST:
        gc.collect()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh throwaway server for one test, stopped afterwards."""
    server = RedisServer.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    """One throwaway server for one test module (its broker, results, locks and records,
    in databases the module picks), stopped after the module's last test."""
    srv = RedisServer.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def three_servers() -> Iterator[list[RedisServer]]:
    """Three independent throwaway servers for one test module (a Redlock's masters),
    stopped after the module's last test; nothing else connects to them."""
    started = start_servers(3)
    try:
        yield started
    finally:
        for srv in started:
            srv.stop()


@pytest.fixture(scope="session")
def shared_redis() -> Iterator[RedisServer]:
    """One throwaway server shared by the session's fast tests."""
    server = RedisServer.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_client(shared_redis: RedisServer) -> Iterator[redis.Redis]:
    """A client to ``shared_redis`` after FLUSHALL and CONFIG RESETSTAT on it."""
    if shared_redis.paused:
        shared_redis.resume()
    if not shared_redis.alive():
        shared_redis.restart()
    client = shared_redis.client()
    client.flushall()
    client.config_resetstat()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def env(shared_redis: RedisServer, redis_client: redis.Redis) -> Iterator[Env]:
    """The shared throwaway server, flushed, with clients of its lock and record dbs and
    the test's apps (:class:`inprocess.Env`), closed afterwards."""
    e = Env(shared_redis)
    try:
        yield e
    finally:
        gc.collect()  # results die now, while their server still runs (see forget_results)
        for app in e.apps:
            forget_results(app)
            app.close()
        e.locks.close()
        e.rec.close()


@pytest.fixture
def redis_servers() -> Iterator[Callable[[int], list[RedisServer]]]:
    """Factory ``redis_servers(n)`` starting n independent servers concurrently."""
    started: list[RedisServer] = []

    def factory(n: int) -> list[RedisServer]:
        servers = start_servers(n)
        started.extend(servers)
        return servers

    try:
        yield factory
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def fault_proxy() -> Iterator[Callable[[RedisServer], FaultProxy]]:
    """Factory ``fault_proxy(server)`` putting a fault-injecting proxy in front of a server."""
    proxies: list[FaultProxy] = []

    def factory(server: RedisServer) -> FaultProxy:
        proxy = FaultProxy.start(server.host, server.port)
        proxies.append(proxy)
        return proxy

    try:
        yield factory
    finally:
        for proxy in proxies:
            proxy.stop()


@pytest.fixture
def sentinel_setup() -> Iterator[SentinelSetup]:
    """A master, a replica and three sentinels monitoring ``mymaster``."""
    setup = SentinelSetup.start()
    try:
        yield setup
    finally:
        setup.stop()


@pytest.fixture
def redis_cluster() -> Iterator[ClusterSetup]:
    """A three-master Redis Cluster with all slots assigned and cluster_state:ok."""
    cluster = ClusterSetup.start()
    try:
        yield cluster
    finally:
        cluster.stop()
