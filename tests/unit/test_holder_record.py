"""The holder record a lock stores, written from parts made once per lock object and
process, is the JSON of the whole record: what `celery locks` and errors read."""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import pytest

from celery_redlock import Lock, connect


@pytest.mark.parametrize(
    "owner_info",
    [
        {},
        {"task_name": "proj.sync", "task_id": "abc", "retries": 2},
        {"pid": 5, "hostname": "elsewhere"},  # owner_info overrides what the lock writes
        {"nested": [1, {"b": None}], "at": 1.5},
    ],
)
def test_the_record_is_the_json_of_host_pid_time_and_owner_info(owner_info: Any) -> None:
    """Each acquire's record decodes to host, pid, the time and owner_info (which wins),
    in that order, byte for byte what json.dumps of the whole dict writes."""
    lock = Lock(connect("memory://record"), "r", owner_info=owner_info, auto_renew=False)
    with lock:
        (holder,) = lock.read_holders()
    for record in (lock._holder_record(), json.dumps(holder, separators=(",", ":"))):
        decoded = json.loads(record)
        whole = {"hostname": socket.gethostname(), "pid": os.getpid()}
        whole["acquired_at"] = decoded["acquired_at"]
        whole.update(owner_info)
        assert record == json.dumps(whole, separators=(",", ":"))


def test_a_forked_child_writes_its_own_pid() -> None:
    """The parts are made again in a forked child: its records name its own pid."""
    lock = Lock(connect("memory://record-fork"), "r", auto_renew=False)
    assert json.loads(lock._holder_record())["pid"] == os.getpid()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        os.write(write, lock._holder_record().encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child = json.loads(pipe.read())
    os.waitpid(pid, 0)
    assert child["pid"] == pid
