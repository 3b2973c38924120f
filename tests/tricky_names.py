"""Lock names that are hard to put in a Redis key and read back, shared by the tests of
key naming (test_keys_connect), the operator reads on every backend (test_backends) and
``celery locks`` (test_cli)."""

from __future__ import annotations

#: Braces (a name starting with "}" would leave the cluster hash tag empty), backslashes
#: (the escape of that "}"), the suffixes of a name's other keys, unicode, and over-long
#: names (stored as head + hash) starting with each of those.
TRICKY_NAMES = [
    "}{", "\\}{", "\\", "\\\\", "\\x", "\\\\x", "a}b", "{x}", "}", "}}", "{}", "{", "a:fence",
    "a}:fence", "b:permits", "b}:permits", "c:queued", "c}:queued", "d}:rate", "ünï☃ 名",
    "}" * 300, "\\" + "y" * 300, "\\}" + "z" * 300,
]  # fmt: skip
