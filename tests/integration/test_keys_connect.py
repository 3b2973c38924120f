"""Key building, canonical rendering of values, and ``connect()`` URLs.

Property tests (hypothesis) for the key layout, ``render_value`` and
``KeyTemplate``; ``connect()`` against real servers over TCP and a unix socket;
bad URLs and passwords that must never show up in errors or reprs.
"""

from __future__ import annotations

import datetime as dt
import decimal
import enum
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from hypothesis import example, given, settings
from hypothesis import strategies as st
from redis.cluster import key_slot
from redis.connection import SSLConnection, UnixDomainSocketConnection
from servers import RedisServer, free_port
from tricky_names import TRICKY_NAMES

from celery_redlock import ConfigError, KeyTemplate, Lock, StoreUnavailable, connect
from celery_redlock.core.connect import LOCK_CLIENT_DEFAULTS, address_of, mask_url
from celery_redlock.core.keys import (
    MAX_NAME_LENGTH,
    lock_keys,
    name_of_key,
    normalize_name,
    permit_keys,
    rate_key,
    render_value,
)
from celery_redlock.core.records import LockRecords

names = st.text(min_size=1, max_size=300)
#: Names drawn mostly from the characters that shape a key.
key_names = st.text(alphabet="}{\\:ab", min_size=1, max_size=8) | names
identifiers = st.from_regex(r"\A[A-Za-z_][A-Za-z0-9_]{0,11}\Z")
json_scalars = st.none() | st.booleans() | st.integers() | st.text(max_size=20)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


# --------------------------------------------------------------------------- keys


def test_keys_show_the_name_inside_a_hash_tag_under_the_prefix() -> None:
    """sync:42 lives at redlock:{sync:42}, with :fence, :notify and :waiting beside it."""
    keys = lock_keys("sync:42")
    assert (keys.name, keys.lock) == ("sync:42", "redlock:{sync:42}")
    assert keys.fence == "redlock:{sync:42}:fence"
    assert keys.notify == "redlock:{sync:42}:notify"
    assert keys.waiting == "redlock:{sync:42}:waiting"
    assert lock_keys("sync:42", "app:locks:").lock == "app:locks:{sync:42}"
    assert lock_keys("x", "").lock == "{x}"


@settings(max_examples=300)
@given(name=names, prefix=st.sampled_from(["redlock:", "", "a:b:"]))
@example(name="}abc", prefix="redlock:")
@example(name="{}", prefix="redlock:")
@example(name="\\}{", prefix="redlock:")
@example(name="\\", prefix="")
def test_all_keys_of_one_lock_share_one_cluster_slot(name: str, prefix: str) -> None:
    """Whatever the name, all keys of a lock, semaphore and rate limiter share one slot."""
    keys = every_key(name, prefix)
    assert len({key_slot(k.encode()) for k in keys}) == 1, keys


def every_key(name: str, prefix: str = "redlock:") -> set[str]:
    """Every key celery-redlock writes for *name*: the lock's, a semaphore's, a rate
    limiter's and a records hash's (beat's ticks)."""
    keys, permits = lock_keys(name, prefix), permit_keys(name, prefix)
    return {
        keys.lock, keys.fence, keys.notify, keys.waiting, keys.queued, keys.done,
        keys.released, permits.lock, rate_key(name, prefix), f"{keys.lock}:ticks",
    }  # fmt: skip


@pytest.mark.parametrize("prefix", ["redlock:", "", "a:b:"])
def test_no_two_tricky_names_share_a_key_and_each_key_gives_its_name_back(prefix: str) -> None:
    """Each tricky name's keys share one slot, read back as its name, and are no other name's."""
    owner: dict[str, str] = {}
    for name in [*TRICKY_NAMES, "\ud800", "\ud800" * 200]:  # lone surrogates: head + hash
        keys = every_key(name, prefix)
        assert len({key_slot(k.encode()) for k in keys}) == 1, keys
        assert {name_of_key(k, prefix) for k in keys} == {normalize_name(name)}
        for key in keys:
            assert owner.setdefault(key, name) == name, f"{name!r} and {owner[key]!r}: {key!r}"


@settings(max_examples=500)
@given(a=key_names, b=key_names, prefix=st.sampled_from(["redlock:", ""]))
@example(a="}{", b="\\}{", prefix="redlock:")
@example(a="\\x", b="\\\\x", prefix="redlock:")
def test_two_different_names_never_share_a_key(a: str, b: str, prefix: str) -> None:
    """Two names stored differently have no key in common, and every key names its name."""
    keys_a, keys_b = every_key(a, prefix), every_key(b, prefix)
    assert {name_of_key(k, prefix) for k in keys_a} == {normalize_name(a)}
    if normalize_name(a) != normalize_name(b):
        assert not keys_a & keys_b


def test_a_records_suffix_with_a_closing_brace_is_refused() -> None:
    """A records suffix with "}" is refused: <prefix>{a}:x} is the lock key of name "a}:x"."""
    with pytest.raises(ConfigError, match="must not contain"):
        LockRecords(Lock(connect("memory://records-suffix"), "a"), "x}")


@given(name=st.text(min_size=1, max_size=MAX_NAME_LENGTH))
def test_names_up_to_the_limit_are_kept_verbatim(name: str) -> None:
    """A name within the length limit is stored exactly as written."""
    assert normalize_name(name) == name


@given(
    head=st.text(min_size=MAX_NAME_LENGTH + 1, max_size=400),
    tail_a=st.text(max_size=20),
    tail_b=st.text(max_size=20),
)
def test_long_names_become_a_bounded_readable_head_plus_a_hash(
    head: str, tail_a: str, tail_b: str
) -> None:
    """Over-long names are shortened deterministically, keep their head, and stay distinct."""
    a, b = head + tail_a, head + tail_b
    short_a = normalize_name(a)
    assert short_a == normalize_name(a)
    assert len(short_a) < MAX_NAME_LENGTH
    assert short_a.startswith(a[:100])
    assert (normalize_name(b) == short_a) == (a == b)
    assert lock_keys(a).name == short_a


@pytest.mark.parametrize("prefix", ["lock{", "a}b", 5])
def test_bad_key_prefix_is_a_config_error(prefix: Any) -> None:
    """A prefix with braces (it would break the hash tag) or not a string is refused."""
    with pytest.raises(ConfigError) as caught:
        lock_keys("x", prefix)
    assert repr(prefix) in str(caught.value)


def test_empty_name_is_a_config_error() -> None:
    """Key building refuses an empty name."""
    with pytest.raises(ConfigError, match="''"):
        lock_keys("")


# --------------------------------------------------------------------------- render_value


@given(st.text())
def test_strings_render_as_themselves(text: str) -> None:
    """A string argument appears in the key unchanged."""
    assert render_value(text) == text


def test_an_id_passed_as_int_or_as_string_locks_the_same_name() -> None:
    """sync:<user_id> with 42 or "42" is one lock, sync:42 (as the README says)."""
    template = KeyTemplate("sync:<user_id>")
    assert template.render({"user_id": 42}) == template.render({"user_id": "42"}) == "sync:42"


@given(st.integers())
def test_numbers_render_with_one_spelling(number: int) -> None:
    """Integers render as their decimal digits; an integral float renders like the integer."""
    assert render_value(number) == str(number)
    if abs(number) < 2**53:
        assert render_value(float(number)) == str(number)


def test_scalars_have_one_canonical_spelling() -> None:
    """None, booleans, UUIDs, decimals, dates and enums each render one fixed way."""

    class Color(enum.Enum):
        RED = "red"

    u = uuid.UUID("12345678-1234-5678-1234-567812345678")
    assert render_value(None) == "null"
    assert (render_value(True), render_value(False)) == ("true", "false")
    assert render_value(u) == "12345678-1234-5678-1234-567812345678"
    assert render_value(decimal.Decimal("1.50")) == "1.50"
    assert render_value(dt.date(2024, 6, 1)) == "2024-06-01"
    assert render_value(dt.datetime(2024, 6, 1, 12, 30)) == "2024-06-01T12:30:00"
    assert render_value(Color.RED) == "red"
    assert render_value(b"\x00\xff") == "00ff"
    assert render_value(1.5) == "1.5"


def test_a_value_and_its_text_form_render_alike() -> None:
    """A UUID, date, decimal, float or text enum renders exactly as its text would (no quotes).

    Celery's JSON serializer hands the worker a UUID when the caller sent a UUID and a
    str when it sent a str: both must give the one name a user reads and types.
    """

    class Color(enum.Enum):
        RED = "red"

    u = uuid.UUID("12345678-1234-5678-1234-567812345678")
    day = dt.date(2024, 6, 1)
    template = KeyTemplate("sync:<user_id>")
    for value, text in [
        (u, str(u)),
        (day, "2024-06-01"),
        (decimal.Decimal("1.50"), "1.50"),
        (2.5, "2.5"),
        (Color.RED, "red"),
    ]:
        assert render_value(value) == render_value(text) == text
        assert template.render({"user_id": value}) == template.render({"user_id": text})
    # Inside a container, text stays JSON text, and a UUID equals its string there too.
    inside = render_value({"ids": [u], "day": day})
    assert inside == render_value({"ids": [str(u)], "day": str(day)})


def test_a_uuid_and_its_string_exclude_each_other(redis_server: RedisServer) -> None:
    """A holder of sync:<user_id> rendered from a UUID blocks one rendered from its string."""
    u = uuid.UUID("12345678-1234-5678-1234-567812345678")
    template = KeyTemplate("sync:<user_id>")
    client = connect(redis_server.url)
    holder = Lock(client, template.render({"user_id": u}), ttl=5, auto_renew=False)
    assert holder.acquire(blocking=False)
    try:
        other = Lock(client, template.render({"user_id": str(u)}), ttl=5, auto_renew=False)
        assert not other.acquire(blocking=False)
        assert redis_server.client().exists(f"redlock:{{sync:{u}}}")
    finally:
        holder.release()


@given(json_values.filter(lambda v: not isinstance(v, str)))
def test_json_like_values_render_to_json_that_decodes_back(value: Any) -> None:
    """Containers of ints/strings/bools/None render to JSON that decodes to the same value."""
    assert json.loads(render_value(value)) == value


@given(st.dictionaries(st.text(max_size=8), json_values, max_size=6))
def test_dict_key_order_does_not_change_the_rendering(mapping: dict[str, Any]) -> None:
    """Two dicts with the same items in another order render identically."""
    reordered = dict(reversed(list(mapping.items())))
    assert render_value(reordered) == render_value(mapping)


@given(st.sets(st.integers() | st.text(max_size=8), max_size=8))
def test_set_iteration_order_does_not_change_the_rendering(items: set[Any]) -> None:
    """A set renders the same whatever order it was built in."""
    assert render_value(set(sorted(items, key=repr, reverse=True))) == render_value(items)
    assert render_value(frozenset(items)) == render_value(items)


@given(
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(allow_nan=False, allow_infinity=False),
)
def test_floats_render_deterministically_and_distinctly(a: float, b: float) -> None:
    """Equal floats render alike (1.0 like 1), different floats never collide."""
    assert render_value(a) == render_value(float(repr(a)))
    assert (render_value(a) == render_value(b)) == (a == b)


_RENDERED = (
    "{'tags': {'b', 'a', 'c', 'zz', 'q'}, "
    "'ids': frozenset({'x1', 'x2', 'x3'}), 'n': 3, 'when': datetime.date(2024, 1, 2)}"
)
_RENDER_IN_CHILD = (
    "import sys; from celery_redlock.core.keys import render_value; "
    f"import datetime; sys.stdout.write(render_value({_RENDERED}))"
)


def test_rendering_is_stable_across_processes_with_different_hash_seeds() -> None:
    """Sets of strings (whose order depends on PYTHONHASHSEED) render the same in every
    process: this one and two children, each with a hash seed of its own."""
    outputs = {render_value(eval(_RENDERED, {"datetime": dt}))}
    seeds = [seed for seed in ("1", "2", "3") if seed != os.environ.get("PYTHONHASHSEED")]
    for seed in seeds[:2]:
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", _RENDER_IN_CHILD],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        outputs.add(done.stdout)
    assert len(outputs) == 1
    assert json.loads(outputs.pop()) == {
        "ids": ["x1", "x2", "x3"],
        "n": 3,
        "tags": ["a", "b", "c", "q", "zz"],
        "when": "2024-01-02",
    }


def test_objects_without_a_canonical_form_are_refused() -> None:
    """An arbitrary object (its str() may hold a memory address) is refused, naming its type."""

    class Opaque:
        pass

    with pytest.raises(TypeError, match="Opaque"):
        render_value(Opaque())
    with pytest.raises(TypeError, match="Opaque"):
        render_value({"nested": [Opaque()]})


# --------------------------------------------------------------------------- KeyTemplate

literal_text = st.text(alphabet=st.characters(blacklist_characters="<>"), max_size=10)
arg_values = st.integers() | st.text(max_size=10) | st.booleans() | st.none()


@given(
    parts=st.lists(st.tuples(literal_text, identifiers), min_size=1, max_size=4),
    tail=literal_text,
    values=st.lists(arg_values, min_size=4, max_size=4),
)
def test_template_renders_literal_text_and_canonical_arguments(
    parts: list[tuple[str, str]], tail: str, values: list[Any]
) -> None:
    """A template is its literal text with each <arg> replaced by render_value(argument)."""
    template = "".join(f"{text}<{arg}>" for text, arg in parts) + tail
    arguments = {arg: values[i % len(values)] for i, (_, arg) in enumerate(parts)}
    expected = "".join(text + render_value(arguments[arg]) for text, arg in parts) + tail
    compiled = KeyTemplate(template)
    assert compiled.render(arguments) == expected
    assert compiled.fields == tuple(dict.fromkeys(arg for _, arg in parts))


def test_template_reads_attributes_and_mapping_keys() -> None:
    """<user.id> reads attribute id of an object, or key id of a mapping."""
    template = KeyTemplate("sync:<user.id>:<kind>")
    assert template.fields == ("user", "kind")
    assert template.render({"user": SimpleNamespace(id=42), "kind": "full"}) == "sync:42:full"
    assert template.render({"user": {"id": "u-7"}, "kind": 1}) == "sync:u-7:1"


def test_template_missing_argument_is_a_config_error_naming_it() -> None:
    """Rendering without an argument the template needs names that argument."""
    with pytest.raises(ConfigError, match="'user_id'"):
        KeyTemplate("sync:<user_id>").render({"other": 1})


@pytest.mark.parametrize("template", ["", "sync:<user_id", "sync:<1st>", "a:<x y>", "<a.>"])
def test_bad_template_is_a_config_error_naming_it(template: str) -> None:
    """Malformed templates are refused when built (at task definition), naming the template."""
    with pytest.raises(ConfigError) as caught:
        KeyTemplate(template)
    assert repr(template) in str(caught.value)


# --------------------------------------------------------------------------- connect


def test_connect_redis_url_gives_a_working_lock_client_with_lock_defaults(
    redis_server: RedisServer,
) -> None:
    """redis:// builds a redis.Redis with the lock timeouts; a Lock works on it."""
    client = connect(redis_server.url)
    assert isinstance(client, redis.Redis)
    kwargs = client.connection_pool.connection_kwargs
    for key, value in LOCK_CLIENT_DEFAULTS.items():
        assert kwargs[key] == value
    attempts: list[int] = []

    def refused() -> None:
        attempts.append(1)
        raise redis.ConnectionError("refused")

    # One retry: the policy runs a failing call twice (Retry.call_with_retry is public on
    # every supported redis-py; get_retries() only exists from redis-py 6).
    with pytest.raises(redis.ConnectionError):
        kwargs["retry"].call_with_retry(refused, lambda _error: None)
    assert len(attempts) == 2
    lock = Lock(client, "connect:tcp", ttl=5, auto_renew=False)
    assert lock.acquire(blocking=False)
    assert redis_server.client().exists("redlock:{connect:tcp}")
    lock.release()
    assert address_of(client) == f"127.0.0.1:{redis_server.port}/0"


def test_connect_options_and_database_number_are_honoured(redis_server: RedisServer) -> None:
    """Keyword options override the defaults; /3 in the URL puts the lock in database 3."""
    client = connect(redis_server.url.rsplit("/", 1)[0] + "/3", socket_timeout=0.7)
    assert isinstance(client, redis.Redis)
    assert client.connection_pool.connection_kwargs["socket_timeout"] == 0.7
    lock = Lock(client, "connect:db", ttl=5, auto_renew=False)
    assert lock.acquire(blocking=False)
    assert redis_server.client(db=3).exists("redlock:{connect:db}")
    assert not redis_server.client(db=0).exists("redlock:{connect:db}")
    lock.release()


def test_connect_list_gives_one_client_per_url(redis_servers: Any) -> None:
    """A list of URLs (Redlock masters) gives one independent client per URL, in order."""
    servers = redis_servers(2)
    clients = connect([s.url for s in servers])
    assert isinstance(clients, list) and len(clients) == 2
    for server, client in zip(servers, clients, strict=True):
        assert client.connection_pool.connection_kwargs["port"] == server.port
        assert client.ping()


@pytest.fixture
def unix_server() -> Iterator[tuple[RedisServer, str]]:
    """A throwaway server also listening on a unix socket in its private dir."""
    server = RedisServer.start(["--unixsocket", "{tmp}/redis.sock", "--unixsocketperm", "700"])
    try:
        yield server, str(Path(server.data_dir).parent / "redis.sock")
    finally:
        server.stop()


def test_connect_unix_socket_url(unix_server: tuple[RedisServer, str]) -> None:
    """unix:///path/redis.sock?db=2 reaches the server over its socket; a Lock works on it."""
    server, path = unix_server
    client = connect(f"unix://{path}?db=2")
    assert isinstance(client, redis.Redis)
    assert client.connection_pool.connection_class is UnixDomainSocketConnection
    lock = Lock(client, "connect:unix", ttl=5, auto_renew=False)
    assert lock.acquire(blocking=False)
    assert server.client(db=2).exists("redlock:{connect:unix}")
    assert address_of(client) == f"unix:{path}"
    assert path in client.client_info()["laddr"]  # this connection really is the socket
    lock.release()


def test_connect_rediss_url_uses_tls() -> None:
    """rediss:// builds a client whose connections speak TLS."""
    client = connect("rediss://127.0.0.1:6390/0")
    assert isinstance(client, redis.Redis)
    assert client.connection_pool.connection_class is SSLConnection


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("http://127.0.0.1:6379/0", "'http'"),
        ("memcached://u:s3cret@127.0.0.1:11211", "'memcached'"),
        ("127.0.0.1:6379", "'127.0.0.1:6379'"),
        ("", "''"),
        ("redis://u:s3cret@127.0.0.1:notaport/0", "notaport"),
        ("sentinel://:s3cret@127.0.0.1:26379", "master"),
        ("redis://u:s3cret@127.0.0.1:6379/x", "'x'"),
    ],
)
def test_bad_urls_are_config_errors_naming_the_problem_without_the_password(
    url: str, named: str
) -> None:
    """Unknown schemes, missing schemes, bad ports, a non-numeric db, a masterless Sentinel
    URL: ConfigError."""
    with pytest.raises(ConfigError) as caught:
        connect(url)
    message = str(caught.value)
    assert named in message
    assert "s3cret" not in message and "s3cret" not in repr(caught.value)


@pytest.mark.parametrize("bad", [[], 6379, None])
def test_connect_refuses_what_is_not_a_url_or_a_list(bad: Any) -> None:
    """An empty list or a non-string is a ConfigError."""
    with pytest.raises(ConfigError):
        connect(bad)


@given(
    scheme=st.sampled_from(["redis", "rediss", "sentinel", "unix"]),
    user=st.from_regex(r"\A[a-z]{0,6}\Z"),
    password=st.from_regex(r"\A[A-Za-z0-9!$&'()*+,;=:.~-]{1,16}\Z"),
)
def test_mask_url_hides_any_password(scheme: str, user: str, password: str) -> None:
    """mask_url replaces the password with *** and keeps the rest of the URL."""
    url = f"{scheme}://{user}:PW{password}@127.0.0.1:6379/0"
    masked = mask_url(url)
    assert f"PW{password}" not in masked
    assert masked == f"{scheme}://{user}:***@127.0.0.1:6379/0"


def test_mask_url_leaves_password_free_urls_alone() -> None:
    """URLs without a password come back unchanged."""
    for url in ("redis://127.0.0.1:6379/0", "unix:///tmp/r.sock", "redis://user@h:1/0"):
        assert mask_url(url) == url


def test_password_never_shows_in_client_repr_or_unavailable_errors() -> None:
    """A dead Redis behind a password URL: the error and the client repr carry no password."""
    port = free_port()  # nothing listens here
    client = connect(f"redis://admin:s3cret@127.0.0.1:{port}/0")
    assert "s3cret" not in repr(client)
    lock = Lock(client, "connect:down", ttl=5)
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as caught:
        lock.acquire()  # blocking: still fails promptly, waiting is for contention only
    assert time.monotonic() - started < 2 * 2.0 + 1.0
    assert f"127.0.0.1:{port}" in str(caught.value)
    assert "s3cret" not in str(caught.value) and "s3cret" not in repr(caught.value)


def test_password_protected_server_right_and_wrong_password(redis_server: RedisServer) -> None:
    """With requirepass, the right URL password locks; a wrong one fails without echoing it."""
    server = redis_server
    server.client().config_set("requirepass", "s3cret")
    good = connect(f"redis://:s3cret@127.0.0.1:{server.port}/0")
    try:
        lock = Lock(good, "connect:auth", ttl=5, auto_renew=False)
        assert lock.acquire(blocking=False)
        lock.release()
        bad = connect(f"redis://:wr0ngpass@127.0.0.1:{server.port}/0")
        with pytest.raises(StoreUnavailable) as caught:
            Lock(bad, "connect:auth", ttl=5).acquire(blocking=False)
        assert "wr0ngpass" not in str(caught.value) and "wr0ngpass" not in repr(caught.value)
    finally:
        good.config_set("requirepass", "")  # let the fixture's password-less teardown in
