"""A fork server for the suite's child processes: ``lmcache serve`` and the stand-in workers start
in a fraction of a second instead of importing torch again each time (2-8 s on a 2-core machine,
most of a server's start).

One process per pytest session (``python -m tests.forkserver SOCKET``) imports the heavy
third-party modules once, then forks a child for each ``spawn``: the child takes the requester's
stdin/stdout/stderr (passed over a unix socket), environment, working directory and argv, and
runs the module or script as ``python`` would (``-m module args`` or ``script args``), so it is
as real a process as a Popen child: its own pid, sockets, shared memory, signals, exit status
and interpreter exit (atexit runs). What is imported before the fork (``PRELOAD``: torch, numpy,
zmq, ``lmcache_core``, ...) keeps no per-process state from its import that a child would wrongly
share; the configuration and the environment are read after the fork, as in a fresh interpreter.
``gc.freeze()`` keeps those modules' objects out of the children's collections, so a child does
not copy the pages the collector would touch (it made a child's exit 2.6 s -> 0.8 s).

The requester gets a ``Child`` (the subset of ``subprocess.Popen`` the tests use): ``pid``,
``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``, ``returncode``. The server reaps
each child and sends its exit status (Popen's convention: ``-N`` for signal N) on the spawn's
connection. ``LMCACHE_TEST_EXEC=1`` makes ``spawn`` a plain Popen (every start a fresh
interpreter, as a user starts it); tests/integration/test_cli.py always starts its servers so.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import multiprocessing
import multiprocessing.context
import os
import runpy
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

#: Imported once before any fork: what every child needs and takes seconds (torch alone 2-8 s).
#: lmcache_core too (it reads no environment at import); not lmcache_cli, whose consoles take
#: their width and colours from the environment when imported.
PRELOAD = ("torch", "numpy", "zmq", "msgspec", "yaml", "blake3", "rich.console", "rich.logging",
           "typer", "redis", "lmcache_core.server.app", "lmcache_core.storage.remote",
           "lmcache_core.client.worker", "lmcache_core.client.scheduler", "lmcache_core.kv.share")
_MAX_REQUEST = 1 << 20


# ---------------------------------------------------------------- the server (its own process)


def serve(sock_path: str) -> list[str]:
    """Fork a child per request until stdin closes (pytest gone: the children are killed). Returns
    only in a child, with the argv it is to run."""
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    gc.freeze()  # the children's collector leaves the preloaded objects (and their pages) alone
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(sock_path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(sys.stdin, selectors.EVENT_READ, "stdin")
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, requester's connection)
    print("ready", flush=True)
    while True:
        for key, _ in sel.select():
            if key.data == "stdin":
                if not sys.stdin.readline():
                    _kill_all(children)
                    os._exit(0)
            elif key.data == "accept":
                conn, _ = listener.accept()
                argv = _fork(conn, children, sel, listener)
                if argv is not None:
                    return argv
            else:
                _reap(key.fd, children, sel)


def _fork(conn: socket.socket, children: dict[int, tuple[int, socket.socket]],
          sel: selectors.BaseSelector, listener: socket.socket) -> list[str] | None:
    message, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST, 3)
    try:
        request = json.loads(message)
    except ValueError:  # a requester that died before sending (or sent garbage): not ours to die of
        request = None
    if request is None or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        conn.close()
        return None
    pid = os.fork()
    if pid == 0:
        sel.close()
        listener.close()
        for _, other in children.values():
            other.close()
        for pidfd in children:
            os.close(pidfd)
        conn.close()
        _become(request, fds)
        return list(request["argv"])
    for fd in fds:
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    children[pidfd] = (pid, conn)
    sel.register(pidfd, selectors.EVENT_READ, "child")
    conn.send(json.dumps({"pid": pid}).encode())
    return None


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """In the child: the requester's stdio, environment and working directory."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    encoding = sys.stdout.encoding
    # new stdio objects on the new fds, buffered as at an interpreter's start (stderr by line)
    sys.stdin = sys.__stdin__ = open(0, encoding=encoding, closefd=False)  # noqa: SIM115
    sys.stdout = sys.__stdout__ = open(1, "w", 1 if os.isatty(1) else -1,  # noqa: SIM115
                                       encoding=encoding, closefd=False)
    sys.stderr = sys.__stderr__ = open(2, "w", 1, encoding=encoding,  # noqa: SIM115
                                       errors="backslashreplace", closefd=False)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _reap(pidfd: int, children: dict[int, tuple[int, socket.socket]],
          sel: selectors.BaseSelector) -> None:
    pid, conn = children.pop(pidfd)
    sel.unregister(pidfd)
    os.close(pidfd)
    _, status = os.waitpid(pid, 0)
    with contextlib.suppress(OSError):  # the requester may be gone
        conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
    conn.close()


def _kill_all(children: dict[int, tuple[int, socket.socket]]) -> None:
    for pidfd, (pid, _) in children.items():
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def run_argv(argv: list[str]) -> None:
    """Run ``-m module args`` or ``script args`` as the interpreter would run them as __main__."""
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = str(Path(argv[0]).resolve().parent)
        runpy.run_path(argv[0], run_name="__main__")


# ---------------------------------------------------------------- the tests' side


class Child:
    """A process the fork server started: the part of ``subprocess.Popen`` the tests use."""

    def __init__(self, conn: socket.socket, pid: int, stdin: IO[str] | None,
                 stdout: IO[str] | None) -> None:
        self._conn = conn
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._conn.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._conn.setblocking(True)
            self._conn.settimeout(timeout)
            try:
                self._read_status()
            except TimeoutError:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0) from None
        assert self.returncode is not None
        return self.returncode

    def _read_status(self) -> None:
        message = self._conn.recv(4096)
        if not message:
            raise RuntimeError(f"the fork server lost child {self.pid}")
        self.returncode = int(json.loads(message)["returncode"])
        self._conn.close()
        for stream in (self.stdin, self.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never a signal to a reaped pid (it may be another process now)
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The session's fork server (started on first use; stopped at exit, its children with it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self._folder = ""
        self._ready = False

    def prestart(self) -> None:
        """Start it now, without waiting for it (its imports overlap whatever runs meanwhile)."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._folder = tempfile.mkdtemp(prefix="lmcache-forkserver-")
                self._ready = False
                root = str(Path(__file__).resolve().parents[1])
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                    [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
                with open(f"{self._folder}/forkserver.log", "ab") as log:
                    self._proc = subprocess.Popen(
                        [sys.executable, "-m", "tests.forkserver", f"{self._folder}/fork.sock"],
                        cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                        stderr=log, text=True)

    def _ensure_started(self) -> str:
        self.prestart()
        with self._lock:
            assert self._proc is not None and self._proc.stdout is not None
            if not self._ready:
                if self._proc.stdout.readline().strip() != "ready":
                    log = Path(f"{self._folder}/forkserver.log").read_text(errors="replace")
                    raise RuntimeError(f"the fork server did not start:\n{log}")
                self._ready = True
            return f"{self._folder}/fork.sock"

    def spawn(self, argv: Sequence[str], *, stdin: int | None = None, stdout: int | None = None,
              stderr: int | None = None, env: dict[str, str] | None = None,
              cwd: str | Path | None = None, text: bool = True) -> Child:
        """Start ``argv`` (``[-m, module, ...]`` or ``[script, ...]``, no interpreter): stdio
        as Popen takes them (a file descriptor, ``subprocess.PIPE``, ``subprocess.STDOUT`` for
        stderr, or None for this process's own)."""
        assert text, "only text pipes"
        sock_path = self._ensure_started()
        mine: list[int] = []  # fds to close here once the child holds them
        child_fds, pipe_in, pipe_out = [], None, None
        for index, spec in enumerate((stdin, stdout, stderr)):
            if spec == subprocess.PIPE:
                read, write = os.pipe()
                ours, theirs = (write, read) if index == 0 else (read, write)
                mine.append(theirs)
                if index == 0:
                    pipe_in = os.fdopen(ours, "w")
                else:
                    pipe_out = os.fdopen(ours, "r")
                child_fds.append(theirs)
            elif spec == subprocess.STDOUT:
                child_fds.append(child_fds[1])
            else:
                child_fds.append(index if spec is None else int(spec))
        request = {"argv": list(argv), "env": dict(os.environ if env is None else env),
                   "cwd": str(cwd or os.getcwd())}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(sock_path)
            socket.send_fds(conn, [json.dumps(request).encode()], child_fds)
            reply = json.loads(conn.recv(4096))
        finally:
            for fd in mine:
                os.close(fd)
        return Child(conn, int(reply["pid"]), pipe_in, pipe_out)

    def stop(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                assert self._proc.stdin is not None
                with contextlib.suppress(OSError):
                    self._proc.stdin.close()  # EOF: it kills its children and exits
                try:
                    self._proc.wait(10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait(5)
            if self._folder:
                shutil.rmtree(self._folder, ignore_errors=True)


_SERVER = ForkServer()


def spawn(argv: Sequence[str], *, fresh: bool = False,
          **popen: Any) -> Child | subprocess.Popen[str]:
    """Start a Python child (``argv`` without the interpreter) through the session's fork server,
    or with a plain Popen (a fresh interpreter, a child of this process: it stays a zombie until
    waited for) when ``fresh`` or under ``LMCACHE_TEST_EXEC=1``."""
    if fresh or os.environ.get("LMCACHE_TEST_EXEC") == "1":
        return subprocess.Popen([sys.executable, *argv], text=True, **popen)
    return _SERVER.spawn(argv, **popen)


def mp_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context for the tests' children driven over a ``Pipe``: its fork
    server, which preloads ``PRELOAD`` once and forks each child from that clean interpreter (no
    state of the test's process, as with spawn, without importing torch again); spawn itself
    under ``LMCACHE_TEST_EXEC=1``."""
    if os.environ.get("LMCACHE_TEST_EXEC") == "1":
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    return context


def prestart() -> None:
    """Start the session's fork server in the background (a no-op under LMCACHE_TEST_EXEC=1)."""
    if os.environ.get("LMCACHE_TEST_EXEC") != "1":
        _SERVER.prestart()


def stop() -> None:
    _SERVER.stop()


if __name__ == "__main__":
    run_argv(serve(sys.argv[1]))
