"""The Lua scripts' shared parts (``owner_of.lua``, ``fence_floor.lua``): every script the
Redis backend sends defines each shared function it calls, once and before the first call;
a script with flags takes nothing in front. Read from the sources, no server."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from celery_redlock.core.backends.redis import scripts
from celery_redlock.core.backends.redis.scripts import Script

LUA = resources.files("celery_redlock.core.backends.redis").joinpath("lua")
SHARED = sorted(
    path.name.removesuffix(".lua")
    for path in LUA.iterdir()
    if path.name.endswith(".lua") and "a shared part" in path.read_text("utf-8").split("\n")[0]
)
SENT = {name: value for name, value in vars(scripts).items() if isinstance(value, Script)}


def test_the_shared_parts_are_found() -> None:
    """The scan sees both parts (it would pass vacuously otherwise)."""
    assert SHARED == ["fence_floor", "owner_of"]
    assert len(SENT) >= 20


@pytest.mark.parametrize("name", sorted(SENT))
def test_each_script_defines_the_shared_functions_it_calls(name: str) -> None:
    """A script calling owner_of(...) or fence_floor(...) has its local function in
    front, once, and before the first call (also behind the Sentinel guard)."""
    for source in (SENT[name].source, SENT[name].guarded.source):
        code = "\n".join(line.split("--")[0] for line in source.split("\n"))
        for part in SHARED:
            defined = [m.start() for m in re.finditer(rf"local function {part}\(", code)]
            calls = [m.start() for m in re.finditer(rf"(?<!function ){part}\(", code)]
            if calls:
                assert len(defined) == 1, f"{name}: {part} defined {len(defined)} times"
                assert defined[0] < calls[0], f"{name}: {part} called before it is defined"
            else:
                assert not defined, f"{name}: {part} put in front but never called"


def test_a_script_with_flags_takes_nothing_in_front() -> None:
    """Redis reads a script's flags (#!lua) from its first line only: a part in front of
    one would drop them silently, so building such a script fails at import."""
    assert scripts.EXTEND_NODE.source.startswith("#!lua")
    with pytest.raises(ValueError, match=r"extend_node\.lua: a script with flags"):
        Script("extend_node.lua", uses=("owner_of.lua",))
