"""``HttpListener``: the server's HTTP endpoint for operators: ``/metrics``, ``/healthz``, ``/readyz``.

``/metrics`` is prometheus_client's own WSGI app over the server's registry (text or OpenMetrics
format, gzip when asked). ``/healthz`` and ``/readyz`` answer 200 or 503 with a small JSON body from
the probe functions the owner passes (``CacheServer.health`` and ``readiness``).

One thread, spawned through the server's ``Supervisor``, waits on the listening socket and on a
waker (no timed polling); each accepted connection is served on its own short-lived thread
(wsgiref's server with ``ThreadingMixIn``, as prometheus_client's ``start_http_server`` does), with
a socket timeout, so a slow client never delays a probe. No auth: bind it to loopback unless the
network is trusted.
"""

from __future__ import annotations

import json
import logging
import selectors
import socket
import socketserver
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

from lmcache_core.errors import BindError
from lmcache_core.log_budget import LogBudget
from lmcache_core.supervision import Supervisor
from lmcache_core.transport.waker import Waker

logger = logging.getLogger(__name__)

#: A probe: (healthy or ready, a JSON-able body saying why).
Probe = Callable[[], tuple[bool, dict[str, Any]]]
# A connection that sends (or takes) nothing for this long is closed. Probes and scrapes send their
# request at once; short, so idle connections cannot hold every slot (and the probes) for long.
_CLIENT_TIMEOUT_S = 2.0
_MAX_CONNECTIONS = 128  # served at once (probes and scrapes take milliseconds)
_JOIN_S = 2.0
_INDEX = b"lmcache: /metrics (Prometheus), /healthz (liveness), /readyz (readiness)\n"
_StartResponse = Callable[..., Any]


class _Handler(WSGIRequestHandler):
    timeout = _CLIENT_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # request threads are not joined (nor tracked) at close
    block_on_close = False
    timeout = 0  # handle_request() after our own wait: never block in it

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Each connection has a thread for up to its timeout per read: clients that connect and
        # idle would otherwise add threads without bound. Past this many, new ones are closed.
        self._connections = threading.BoundedSemaphore(_MAX_CONNECTIONS)
        self._failures = LogBudget(logger=logger)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._connections.acquire(blocking=False):
            logger.debug("HTTP: %d connections open, closing one from %s", _MAX_CONNECTIONS,
                         client_address)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # its thread did not start: it will not give the slot back
            self._connections.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._connections.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that idles past its timeout or goes away is its own business (socketserver
        printed a traceback to stderr for each); anything else is logged, rationed."""
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            logger.debug("HTTP client %s: %s", client_address, exc)
            return
        self._failures.log(logging.ERROR, "HTTP request from %s failed", client_address,
                           exc_info=True)

    def server_bind(self) -> None:
        # HTTPServer.server_bind would resolve our own name (getfqdn: a DNS round trip).
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)
        self.setup_environ()


class HttpListener:
    """Serves ``/metrics`` from ``registry`` and one path per probe, on ``host:port``."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry,
                 probes: Mapping[str, Probe], supervisor: Supervisor) -> None:
        self.host = host
        self.port = port
        self._metrics = make_wsgi_app(registry)
        self._probes = dict(probes)
        self._supervisor = supervisor
        self._server: _Server | None = None
        self._waker = Waker()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://host:port``, the real port once started."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> str:
        """Bind (BindError naming the url if that fails) and serve; returns the bound url."""
        try:
            family, _, _, _, address = socket.getaddrinfo(
                self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
            server_class = type("_BoundServer", (_Server,), {"address_family": family})
            self._server = server_class(address[:2], _Handler)
        except OSError as exc:
            why = exc.strerror or str(exc)
            raise BindError(f"cannot listen on {self.url} (server.http_url): {why}; set another "
                            f"port, port 0 for any free one, or off") from None
        self._server.set_app(self._app)
        self.port = int(self._server.server_address[1])
        self._thread = self._supervisor.spawn("lmcache-http", self._serve)
        return self.url

    def stop(self, timeout_s: float = _JOIN_S) -> None:
        """Stop accepting, join the thread, close the socket. Requests being answered finish on
        their own threads. Idempotent."""
        if self._server is None or self._stopping.is_set():
            return
        self._supervisor.retire(self._thread)
        self._stopping.set()
        self._waker.wake()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("the HTTP thread did not end within %.1fs", timeout_s)
                return  # it may still use the socket and the waker
        self._server.server_close()
        self._waker.close()

    def _serve(self) -> None:
        server, waker = self._server, self._waker
        assert server is not None
        with selectors.DefaultSelector() as selector:
            selector.register(server.socket, selectors.EVENT_READ)
            selector.register(waker.fd, selectors.EVENT_READ)
            while not self._stopping.is_set():
                for key, _ in selector.select():
                    if key.fd == waker.fd:
                        waker.drain()
                    elif not self._stopping.is_set():
                        server.handle_request()  # accept, then answer on a new thread

    # ------------------------------------------------------------------ WSGI

    def _app(self, environ: dict[str, Any], start_response: _StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        method = environ.get("REQUEST_METHOD", "GET")
        if path == "/metrics":
            return self._metrics(environ, start_response)
        probe = self._probes.get(path)
        if probe is None and path != "/":
            return _respond(start_response, "404 Not Found", b"not found\n" + _INDEX, "text/plain")
        if method not in ("GET", "HEAD"):
            return _respond(start_response, "405 Method Not Allowed", b"use GET\n", "text/plain",
                            [("Allow", "GET, HEAD")])
        if probe is None:
            return _respond(start_response, "200 OK", _INDEX, "text/plain")
        try:
            ok, body = probe()
        except Exception as exc:
            logger.exception("the %s probe raised", path)
            ok, body = False, {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}
        data = json.dumps(body).encode() + b"\n"
        return _respond(start_response, "200 OK" if ok else "503 Service Unavailable",
                        b"" if method == "HEAD" else data, "application/json")


def _respond(start_response: _StartResponse, status: str, body: bytes, content_type: str,
             extra: list[tuple[str, str]] | None = None) -> list[bytes]:
    start_response(status, [("Content-Type", f"{content_type}; charset=utf-8"),
                            ("Cache-Control", "no-store"), *(extra or [])])
    return [body]
