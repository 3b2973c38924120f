"""Whether a holder's worker still runs, as far as the board can tell cheaply and truly.

A holder record names the host (``hostname``) and the process (``pid``) that took the
lock, and a task run's record its worker's node (``worker``: ``w1@host``). When that
host is the board's own host, the board asks the operating system whether the pid is
alive (``kill(pid, 0)``, no signal sent): a pid that is not is a worker that no longer
answers, and its hold is left to expire. On another host nothing is claimed (the lease's
expiry ends it there: no renewal comes).
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Mapping
from typing import Any

__all__ = ["gone", "this_host"]


@functools.cache
def this_host() -> frozenset[str]:
    """The names of the board's host: its host name and that name's first label."""
    name = socket.gethostname()
    return frozenset({name, name.split(".")[0], "localhost"})


def _host_of(node: str) -> str:
    """The host part of a node name: ``w1@host`` -> ``host``; a bare host stays."""
    return node.rsplit("@", 1)[-1]


def gone(holder: Mapping[str, Any]) -> str:
    """Why *holder*'s worker is known not to run (``"pid 4121 is not running on host"``),
    or "" when it runs or nothing can be said of it."""
    node, pid = holder.get("hostname") or holder.get("worker"), holder.get("pid")
    if not isinstance(node, str) or not isinstance(pid, int) or isinstance(pid, bool):
        return ""
    host = _host_of(node)
    if pid <= 0 or host not in this_host():
        return ""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"pid {pid} is not running on {host}"
    except (PermissionError, OSError):  # alive under another user, or not ours to ask
        return ""
    return ""
