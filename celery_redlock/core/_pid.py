"""This process's id, read once per process instead of once per use.

``os.getpid()`` is a system call (glibc stopped caching it), and the lock paths ask
it about a dozen times per locked task, to tell a forked child from its parent.
``current`` is set at import and again in every child forked through ``os.fork()``
(which is how multiprocessing and billiard fork), by a hook registered at import,
which runs before ``os.fork()`` returns in the child.
"""

from __future__ import annotations

import os

__all__ = ["current"]

#: The id of the process this module runs in.
current: int = os.getpid()


def _after_fork_in_child() -> None:
    global current
    current = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)
