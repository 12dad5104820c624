"""A stand-in OpenAI-compatible server for ``lmcache bench serve``'s tests: it really listens on
127.0.0.1 (a threaded ``http.server``), lists one model, and streams completions as server-sent
events with delays and failures the test chooses, recording what it got and when.

Each completion request takes the next behaviour of ``script`` (then ``"ok"``):

- ``ok``: ``first_token_s``, then ``max_tokens`` chunks ``token_gap_s`` apart, (usage,) ``[DONE]``
- ``http500``: a 500 reply with a JSON error
- ``cut``: two tokens, then the connection closes in the middle of the chunked body
- ``no_done``: two tokens, then the body ends properly but without ``data: [DONE]``
- ``malformed``: one token, then a data line that is not JSON
- ``stall``: one token, then nothing until the stub closes (a client must time out)
- ``trickle``: a token every ``token_gap_s``, never ``[DONE]``, until the stub closes (each wait
  short: only a deadline on the whole request ends it)
- ``long_line``: one token, then a data line that never ends (a piece every ``token_gap_s``)

Answers are unique per request (``" a<request>_<token>"``), so a test can find them in later prompts.
Times are ``time.monotonic()``, compared only with one another.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

STALL_BOUND_S = 30.0  # a stalled stream ends by itself after this, should the stub not be closed


@dataclass
class StubRequest:
    number: int
    body: dict[str, Any]
    behaviour: str
    arrived: float
    finished: float | None = None
    answer: str = ""
    client_gone: bool = False  # the client closed the connection before the answer's end

    @property
    def prompt(self) -> str:
        return str(self.body["prompt"])


class OpenAIStub:
    def __init__(self, *, first_token_s: float = 0.0, token_gap_s: float = 0.0,
                 script: tuple[str, ...] = (), usage: bool = False, refuse: tuple[str, ...] = (),
                 hold_until: int | None = None, model: str = "stub-model",
                 hook: Callable[[StubRequest], None] | None = None) -> None:
        """``hook``: called with each completion request before it is answered (e.g. to do what
        an engine beside lmcache would: look the prompt up, store it)."""
        self.first_token_s, self.token_gap_s = first_token_s, token_gap_s
        self.script, self.usage, self.refuse = list(script), usage, refuse
        self.hold_until = hold_until  # answer nothing until this many completions arrived
        self.model = model
        self.hook = hook
        self.requests: list[StubRequest] = []  # completions, in arrival order
        self.refused = 0
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Condition()
        self.closing = threading.Event()
        self.server = _Server(("127.0.0.1", 0), _handler(self))
        # a short poll: closing the stub waits for the serving loop to notice, up to one poll
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,),
                                       name="openai-stub", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self) -> OpenAIStub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.closing.set()
        with self.lock:
            self.lock.notify_all()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    def arrive(self, body: dict[str, Any]) -> StubRequest | None:
        """Record a completion request and pick its behaviour; None when it is refused (400)."""
        with self.lock:
            if any(field in body for field in self.refuse):
                self.refused += 1
                return None
            behaviour = self.script.pop(0) if self.script else "ok"
            request = StubRequest(len(self.requests), body, behaviour, time.monotonic())
            self.requests.append(request)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.lock.notify_all()
            if self.hold_until is not None:
                self.lock.wait_for(lambda: len(self.requests) >= self.hold_until  # type: ignore[operator]
                                   or self.closing.is_set(), timeout=STALL_BOUND_S)
            return request

    def leave(self, request: StubRequest) -> None:
        with self.lock:
            request.finished = time.monotonic()
            self.in_flight -= 1


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # http.server's backlog is 5: more clients connecting at once lose their SYN and retry it a
    # second later, past a short --timeout (uvicorn, in front of vLLM, listens with 2048)
    request_queue_size = 128


def _handler(stub: OpenAIStub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive and chunked bodies, as uvicorn serves vLLM

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            if self.path.rstrip("/") != "/v1/models":
                return self._reply(404, {"error": {"message": "not found"}})
            self._reply(200, {"object": "list", "data": [{"id": stub.model, "object": "model"}]})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/completions":
                return self._reply(404, {"error": {"message": "not found"}})
            request = stub.arrive(body)
            if request is None:
                fields = ", ".join(f for f in stub.refuse if f in body)
                return self._reply(400, {"error": {"message": "Unrecognized request argument "
                                                              f"supplied: {fields}"}})
            try:
                if stub.hook is not None:
                    stub.hook(request)
                self._complete(request)
            except (BrokenPipeError, ConnectionResetError):
                request.client_gone = True  # the client gave up (its timeout) or left
                self.close_connection = True
            finally:
                stub.leave(request)

        def _complete(self, request: StubRequest) -> None:
            if request.behaviour == "http500":
                return self._reply(500, {"error": {"message": "stub: internal error"}})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            time.sleep(stub.first_token_s)
            tokens = {"cut": 2, "no_done": 2, "malformed": 1, "stall": 1, "long_line": 1,
                      "trickle": 0}.get(request.behaviour, int(request.body["max_tokens"]))
            for i in range(tokens):
                if i:
                    time.sleep(stub.token_gap_s)
                text = f" a{request.number}_{i}"
                request.answer += text
                self._event(json.dumps({"id": f"cmpl-{request.number}", "object": "text_completion",
                                        "choices": [{"index": 0, "text": text,
                                                     "finish_reason": None}]}))
            if request.behaviour == "cut":
                self.close_connection = True  # the socket closes with the chunked body unfinished
                return
            if request.behaviour == "malformed":
                self._event("{not json")
            elif request.behaviour == "stall":
                stub.closing.wait(STALL_BOUND_S)
                self.close_connection = True
                return
            elif request.behaviour in ("trickle", "long_line"):
                self._endless(request)
                self.close_connection = True
                return
            elif request.behaviour == "ok":
                if stub.usage and (request.body.get("stream_options") or {}).get("include_usage"):
                    self._event(json.dumps({"choices": [], "usage": {
                        "prompt_tokens": 2 * len(request.prompt.split()),
                        "completion_tokens": tokens}}))
                self._event("[DONE]")
            self.wfile.write(b"0\r\n\r\n")

        def _endless(self, request: StubRequest) -> None:
            """Tokens (``trickle``) or pieces of one line (``long_line``) every ``token_gap_s``,
            until the stub closes or the client leaves (bounded by ``STALL_BOUND_S``)."""
            if request.behaviour == "long_line":
                self._chunk(b"data: {\"choices\": [{\"text\": \"")
            ends = time.monotonic() + STALL_BOUND_S
            i = 0
            while not stub.closing.wait(stub.token_gap_s) and time.monotonic() < ends:
                if request.behaviour == "long_line":
                    self._chunk(b"x" * 2**19)  # past the client's 1 MiB line in 3 pieces
                else:
                    self._event(json.dumps({"choices": [{"index": 0, "text": f" t{i}"}]}))
                i += 1

        def _event(self, data: str) -> None:
            self._chunk(f"data: {data}\n\n".encode())

        def _chunk(self, payload: bytes) -> None:
            self.wfile.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
            self.wfile.flush()

        def _reply(self, status: int, data: dict[str, Any]) -> None:
            payload = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    return Handler
