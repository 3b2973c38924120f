"""The Lua scripts of the Redis backend (``lua/*.lua`` beside this module, one per file,
each with a header saying its KEYS, ARGV and replies): each read once and run with
``EVALSHA`` (``EVAL`` once, after ``NOSCRIPT``). What each verb sends and how its reply
reads is :mod:`.verbs`.

How a script is sent (:func:`run`): on a client with a connection pool of its own (a
plain or Sentinel-managed ``redis.Redis``), on a connection taken from that pool for the
call and given back before it returns, with redis-py's public connection API
(``pack_command``, ``send_packed_command``, ``read_response``) under the connection's own
retry policy (``conn.retry``, as redis-py's ``execute_command`` uses it). That skips the
per-command layers of ``execute_command`` (observability hooks, option parsing, response
callbacks, which scripts have none of): see docs/benchmarks.md, "Single-node lock". A
cluster client, or one that keeps a single connection, goes through its own
``evalsha``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from functools import partial
from importlib import resources
from typing import Any

from redis import exceptions as rx

from .client import checkout

__all__ = [
    "ACQUIRE",
    "CLAIM_FIELD",
    "CONTROL",
    "DEQUEUE",
    "ENQUEUE",
    "EXTEND",
    "EXTEND_MANY",
    "EXTEND_NODE",
    "FORCE_RELEASE",
    "HOLD_ALL",
    "INDEX_PRUNE",
    "LOG_EVENTS",
    "MASTER_MARK",
    "PARK",
    "PERMITS",
    "PERMIT_ACQUIRE",
    "PERMIT_EXTEND",
    "PERMIT_RELEASE",
    "RAISE_FENCE",
    "RATE",
    "RELEASE",
    "RELEASE_ALL",
    "Script",
    "pool_of",
    "run",
    "send_script",
]


#: The shared part that writes the operator's index, and the line in front of it that
#: switches it off (a Redis Cluster's scripts) or on (:attr:`Script.indexed`).
_INDEX_FILE = "index.lua"
_INDEX_OFF = "local INDEX = false\n"
_INDEX_ON = "local INDEX = true\n"


def _lua(filename: str) -> str:
    folder = resources.files("celery_redlock.core.backends.redis").joinpath("lua")
    return folder.joinpath(filename).read_text("utf-8")


#: A top-level definition of a shared part: from a ``local`` line at the start of a line
#: to the next one (the comment lines before a definition go with the one above it).
_DEFINITION = re.compile(r"(?m)^(?=local )")
_DEFINED = re.compile(r"local (?:function )?(\w+)")
_NAME = re.compile(r"[A-Za-z_]\w*")


def _used(part: str, code: str) -> str:
    """The definitions of the shared *part* that *code* calls or reads, and those they use
    in turn, in the part's order. Redis runs a script's whole text at every call: each
    local function it defines costs a closure a call, whether the script calls it or not
    (about as much as a command, for index.lua's dozen; docs/benchmarks.md)."""
    blocks = _DEFINITION.split(part)
    names: dict[str, int] = {}
    for i, block in enumerate(blocks):
        found = _DEFINED.match(block)
        names[found.group(1) if found else ""] = i
    wanted = set(_NAME.findall(code))
    keep = {names[""]} if "" in names else set()
    todo = [names[n] for n in wanted if n in names]
    while todo:
        i = todo.pop()
        if i in keep:
            continue
        keep.add(i)
        todo += [names[n] for n in _NAME.findall(blocks[i]) if n in names and names[n] not in keep]
    return "".join(block for i, block in enumerate(blocks) if i in keep)


class Script:
    """A Lua script of this package: the file, then any shared parts appended to it. In
    front of it, first each file of *uses* as it is (shared parts that define local
    functions, such as ``owner_of.lua``), then each of *functions* (Lua function name ->
    file) as a local function of ``(KEYS, ARGV)``, so that a script can run another's
    steps on keys and arguments it chooses. :attr:`guarded` is the same script with
    ``master_guard.lua`` in front, for a Sentinel-managed master.

    A script that uses ``index.lua`` writes the operator's index (see that file) only as
    :attr:`indexed`, the variant a plain Redis or a Sentinel master runs; as it is (a
    Redis Cluster's), the index functions do nothing."""

    __slots__ = ("_body", "_guarded", "_indexed", "name", "sha", "source")

    def __init__(
        self,
        filename: str,
        *parts: str,
        uses: Sequence[str] = (),
        functions: Mapping[str, str] | None = None,
    ) -> None:
        self.name = filename
        body = "".join(_lua(f) for f in (filename, *parts))
        steps = "".join(
            f"local function {fn}(KEYS, ARGV)\n{_lua(f)}end\n"
            for fn, f in (functions or {}).items()
        )
        head = "".join(_used(_lua(f), steps + body) for f in uses) + steps
        if _INDEX_FILE in uses:
            head = _INDEX_OFF + head
        flags = ""
        if body.startswith("#!"):  # script flags are read from the first line only
            flags, _, body = body.partition("\n")
            flags += "\n"
        self._body = flags + head + body
        self._guarded: Script | None = None
        self._indexed: Script | None = self if _INDEX_FILE not in uses else None
        self._set_source("")

    def _set_source(self, prelude: str) -> None:
        """The source: *prelude* in front of the body, after its ``#!lua`` line if any
        (script flags are read from the first line only)."""
        body, flags = self._body, ""
        if body.startswith("#!"):
            flags, _, body = body.partition("\n")
            flags += "\n"
        self.source = flags + prelude + body
        self.sha = hashlib.sha1(self.source.encode("utf-8"), usedforsecurity=False).hexdigest()

    @property
    def indexed(self) -> Script:
        """This script writing the operator's index (itself when it writes none)."""
        indexed = self._indexed
        if indexed is None:
            indexed = Script.__new__(Script)
            indexed.name = f"{self.name} (indexed)"
            indexed._body = self._body.replace(_INDEX_OFF, _INDEX_ON, 1)
            indexed._guarded, indexed._indexed = None, indexed
            indexed._set_source("")
            self._indexed = indexed
        return indexed

    @property
    def guarded(self) -> Script:
        """This script behind ``master_guard.lua``: it takes one key and one argument
        more, last (the replaced-master mark, the master's config-epoch)."""
        guarded = self._guarded
        if guarded is None:
            guarded = Script.__new__(Script)
            guarded.name = f"{self.name} (guarded)"
            guarded._body, guarded._guarded = self._body, None
            guarded._indexed = guarded if self._indexed is self else None
            guarded._set_source(_lua("master_guard.lua"))
            self._guarded = guarded
        return guarded


def pool_of(client: Any) -> Any:
    """The connection pool :func:`run` takes a connection from for *client*: its own pool,
    or None for a client that routes commands itself (a cluster) or holds one connection
    (``single_connection_client``)."""
    if getattr(client, "connection", None) is not None:
        return None
    pool = getattr(client, "connection_pool", None)
    return pool if pool is not None and hasattr(pool, "get_connection") else None


def run(script: Script, client: Any, pool: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
    """*script* on *client*: on a connection of *pool* (:func:`pool_of`; see the module
    docstring), or through the client itself when *pool* is None."""
    if pool is None:
        try:
            return client.evalsha(script.sha, len(keys), *keys, *args)
        except rx.NoScriptError:
            return client.eval(script.source, len(keys), *keys, *args)
    conn = checkout(pool)
    try:
        return conn.retry.call_with_retry(
            partial(send_script, conn, script, keys, args), lambda _error: conn.disconnect()
        )
    finally:
        pool.release(conn)


def send_script(conn: Any, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
    """*script* on the connected *conn* (``EVALSHA``; ``EVAL`` after ``NOSCRIPT``): its reply."""
    conn.send_packed_command(conn.pack_command("EVALSHA", script.sha, len(keys), *keys, *args))
    try:
        return conn.read_response()
    except rx.NoScriptError:  # a reply was read: the connection is fine
        conn.send_packed_command(conn.pack_command("EVAL", script.source, len(keys), *keys, *args))
        return conn.read_response()


ACQUIRE = Script("acquire.lua", uses=("fence_floor.lua", _INDEX_FILE))
RELEASE = Script("release.lua", uses=(_INDEX_FILE,))
EXTEND = Script("extend.lua", uses=("owner_of.lua", _INDEX_FILE))
EXTEND_MANY = Script("extend_many.lua", "extend_items.lua", uses=(_INDEX_FILE,))
EXTEND_NODE = Script(
    "extend_node.lua", "extend_items.lua", uses=(_INDEX_FILE,)
)  # a cluster node, across slots
RAISE_FENCE = Script("raise_fence.lua")
FORCE_RELEASE = Script("force_release.lua", uses=(_INDEX_FILE,))
CLAIM_FIELD = Script("claim_field.lua")
PERMIT_ACQUIRE = Script("permit_acquire.lua", uses=("fence_floor.lua", _INDEX_FILE))
PERMIT_RELEASE = Script("permit_release.lua", uses=(_INDEX_FILE,))
PERMIT_EXTEND = Script("permit_extend.lua", uses=(_INDEX_FILE,))
PERMITS = Script("permits.lua")
RATE = Script("rate.lua", uses=(_INDEX_FILE,))
ENQUEUE = Script("enqueue.lua", uses=(_INDEX_FILE,))
DEQUEUE = Script("dequeue.lua", uses=(_INDEX_FILE,))
PARK = Script("park.lua", uses=("owner_of.lua", _INDEX_FILE))
HOLD_ALL = Script(
    "hold_all.lua",
    uses=("fence_floor.lua", _INDEX_FILE),
    functions={"take_lock": "acquire.lua", "take_permit": "permit_acquire.lua"},
)
RELEASE_ALL = Script(
    "release_all.lua",
    uses=(_INDEX_FILE,),
    functions={"give_lock": "release.lua", "give_permit": "permit_release.lua"},
)
CONTROL = Script("control.lua", uses=(_INDEX_FILE,))
MASTER_MARK = Script("master_mark.lua")
LOG_EVENTS = Script("log_events.lua")
INDEX_PRUNE = Script("index_prune.lua")
