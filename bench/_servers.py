"""A throwaway redis-server for benchmarks: free loopback port, temp dir, stopped by pid;
and where the servers and the measuring process run (``--pin``).

Placement (:func:`placement`, the ``--pin`` option of the benchmarks that time a client
against servers): ``split`` (the default) runs every server on the last CPU and this
process on the first, so a round trip crosses cores as it crosses a network, and the
servers never steal the client's CPU; ``same`` puts both on the first CPU; ``none``
leaves placement to the OS. On a machine with one CPU every mode is ``none``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import redis

HOST = "127.0.0.1"


@dataclass
class Server:
    """One redis-server process this benchmark started."""

    binary: str
    port: int
    proc: subprocess.Popen[bytes]
    tmp: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def client(self, **kwargs: object) -> redis.Redis:
        """A redis-py client to this server as users build one: ``redis.Redis(host, port)``
        with redis-py's defaults, unless *kwargs* say otherwise."""
        return redis.Redis(host=HOST, port=self.port, **kwargs)  # type: ignore[arg-type]

    def version(self) -> str:
        """The server's own ``redis_version`` (INFO server)."""
        client = self.client()
        try:
            return str(client.info("server").get("redis_version", "?"))
        finally:
            client.close()


def find_binary() -> str:
    """``$REDIS_SERVER``, else redis-server or valkey-server on PATH."""
    for candidate in (os.environ.get("REDIS_SERVER"), "redis-server", "valkey-server"):
        if candidate and (found := shutil.which(candidate)):
            return found
    raise SystemExit("no redis-server found: set $REDIS_SERVER or put redis-server on PATH")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def start(
    binary: str | None = None,
    wrapper: tuple[str, ...] = (),
    startup: float = 5.0,
    cpus: set[int] | None = None,
) -> Server:
    """Start redis-server on a free loopback port; wait (at most *startup* seconds) until it
    answers PING. *wrapper*: a command the server runs under (``valgrind ...``); *cpus*:
    the CPUs it may run on (see :func:`placement`)."""
    binary = binary or find_binary()
    for _ in range(5):
        port = _free_port()
        tmp = tempfile.mkdtemp(prefix=f"bench-lock-{port}-")
        proc = subprocess.Popen(
            [*wrapper, binary, "--port", str(port), "--bind", HOST, "--save", "",
             "--appendonly", "no", "--dir", tmp, "--daemonize", "no", "--logfile", ""],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        server = Server(binary, port, proc, tmp)
        if cpus:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(proc.pid, cpus)
        probe = redis.Redis(host=HOST, port=port, socket_timeout=0.5)
        try:
            for _ in range(round(startup / 0.02)):  # at most ~startup seconds
                if proc.poll() is not None:
                    break  # port taken meanwhile: try another
                with contextlib.suppress(redis.RedisError):
                    if probe.ping():
                        return server
                time.sleep(0.02)
        finally:
            probe.close()
        stop(server)
    raise SystemExit("redis-server did not come up on a free port in 5 tries")


def stop(server: Server) -> None:
    """SIGTERM the server by pid (SIGKILL after 5 s) and remove its temp dir."""
    if server.proc.poll() is None:
        with contextlib.suppress(OSError):
            os.kill(server.pid, signal.SIGTERM)
        try:
            server.proc.wait(5)
        except subprocess.TimeoutExpired:
            os.kill(server.pid, signal.SIGKILL)
            server.proc.wait(5)
    shutil.rmtree(server.tmp, ignore_errors=True)


@contextlib.contextmanager
def running(binary: str | None = None, cpus: set[int] | None = None) -> Iterator[Server]:
    """A server for the ``with`` block, stopped afterwards, also on error or Ctrl-C."""
    server = start(binary, cpus=cpus)
    try:
        yield server
    finally:
        stop(server)


# --------------------------------------------------------------------------- placement
PIN_MODES = ("split", "same", "none")


def add_pin_option(parser: argparse.ArgumentParser, default: str = "split") -> None:
    """``--pin split|same|none`` (and ``--no-pin``, the same as ``--pin none``)."""
    parser.add_argument(
        "--pin",
        choices=PIN_MODES,
        default=default,
        help="split: servers on the last CPU, this process on the first (a round trip "
        "crosses cores, as a network hop); same: both on the first CPU; none: the OS "
        f"places them (default {default})",
    )
    parser.add_argument(
        "--no-pin", dest="pin", action="store_const", const="none", help="the same as --pin none"
    )


def placement(mode: str) -> tuple[str, set[int] | None, set[int] | None]:
    """(mode in force, the servers' CPUs, this process's CPUs) for *mode*."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return "none", None, None
    if mode == "none" or len(cpus) < 2:
        return "none", None, None
    if mode == "same":
        return "same", {cpus[0]}, {cpus[0]}
    return "split", {cpus[-1]}, {cpus[0]}


def pin_self(cpus: set[int] | None) -> None:
    """Run every thread of this process (and what it starts later) on *cpus*."""
    if not cpus:
        return
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, cpus)


def describe_pin(mode: str, servers: set[int] | None, client: set[int] | None) -> str:
    """One phrase for a results line."""
    if mode == "none" or not servers or not client:
        return "placement left to the OS (--pin none)"
    if mode == "same":
        return f"servers and client on CPU {min(client)} (--pin same)"
    return f"servers on CPU {min(servers)}, client on CPU {min(client)} (--pin split)"
