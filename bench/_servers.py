"""A throwaway redis-server for benchmarks: free loopback port, temp dir, stopped by pid."""

from __future__ import annotations

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
        """A plain redis-py client to this server."""
        params: dict[str, object] = {"host": HOST, "port": self.port, "socket_timeout": 5}
        params.update(kwargs)
        return redis.Redis(**params)  # type: ignore[arg-type]

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


def start(binary: str | None = None, wrapper: tuple[str, ...] = (), startup: float = 5.0) -> Server:
    """Start redis-server on a free loopback port; wait (at most *startup* seconds) until it
    answers PING. *wrapper*: a command the server runs under (``valgrind ...``)."""
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
def running(binary: str | None = None) -> Iterator[Server]:
    """A server for the ``with`` block, stopped afterwards, also on error or Ctrl-C."""
    server = start(binary)
    try:
        yield server
    finally:
        stop(server)
