"""What each failure raises, named for what happened: one Redis down is StoreUnavailable,
a Redlock without a majority its subclass QuorumUnavailable, and a key that holds
something not ours ForeignData (a ConfigError); against real servers."""

from __future__ import annotations

import pickle

import pytest
import redis
from servers import RedisServer, free_port

from celery_redlock import (
    ConfigError,
    ForeignData,
    Lock,
    QuorumUnavailable,
    Redlock,
    RedlockError,
    StoreUnavailable,
)


def _dead_client() -> redis.Redis:
    """A client of a loopback port nothing listens on, with short timeouts."""
    return redis.Redis(port=free_port(), socket_connect_timeout=0.2, socket_timeout=0.2)


def test_one_redis_down_raises_store_unavailable_not_a_quorum_error() -> None:
    """Lock.acquire on a Redis that is down: StoreUnavailable saying "Redis unavailable",
    which is not a QuorumUnavailable (there is no quorum), and survives a pickle."""
    client = _dead_client()
    try:
        with pytest.raises(StoreUnavailable) as caught:
            Lock(client, "errors:one", ttl=5).acquire(blocking=False)
    finally:
        client.close()
    assert not isinstance(caught.value, QuorumUnavailable)
    assert "Redis unavailable" in str(caught.value)
    again = pickle.loads(pickle.dumps(caught.value))
    assert type(again) is StoreUnavailable and str(again) == str(caught.value)


def test_a_redlock_without_a_majority_raises_quorum_unavailable(
    three_servers: list[RedisServer],
) -> None:
    """Two of three masters down: QuorumUnavailable, which is a StoreUnavailable, naming
    the masters needed; a pickle keeps its class."""
    clients = [three_servers[0].client(), _dead_client(), _dead_client()]
    try:
        with pytest.raises(QuorumUnavailable) as caught:
            Redlock(clients, "errors:quorum", ttl=5).acquire(blocking=False)
    finally:
        for client in clients:
            client.close()
    assert isinstance(caught.value, StoreUnavailable)
    assert "need 2 of 3 masters" in str(caught.value)
    assert type(pickle.loads(pickle.dumps(caught.value))) is QuorumUnavailable


def test_foreign_data_at_a_lock_key_raises_foreign_data(redis_client: redis.Redis) -> None:
    """A string where the lock's hash goes: ForeignData naming the key, a ConfigError (so
    code that caught ConfigError still does), never StoreUnavailable; the value stays."""
    redis_client.set("redlock:{errors:foreign}", "someone else's")
    with pytest.raises(ForeignData) as caught:
        Lock(redis_client, "errors:foreign", ttl=5).acquire(blocking=False)
    assert isinstance(caught.value, ConfigError) and isinstance(caught.value, RedlockError)
    assert not isinstance(caught.value, StoreUnavailable)
    assert "redlock:{errors:foreign}" in str(caught.value)
    assert redis_client.get("redlock:{errors:foreign}") == b"someone else's"
