"""An OpenAI-compatible endpoint as ``lmcache bench serve`` uses it: the model it serves
(``GET /models``) and one streamed completion (``POST /completions``), timed as a client sees it.

Every outcome is a :class:`Completion`: a request that could not connect, got a status other than
200, a stream that is not server-sent events of completion chunks, one that stops before
``data: [DONE]``, or a wait past the timeout, is a failed completion whose ``error`` names the
reason (``FAILURE_REASONS``), never an exception and never a hang: httpx bounds every wait
(connecting, sending, each read of the stream) by the timeout, the whole request is bounded by
its own deadline (a stream that trickles forever, each piece within the timeout, fails by it), and
a line of the stream by ``MAX_LINE_BYTES`` (one that never ends is malformed, not memory).

Two request fields are vLLM's and OpenAI's extensions that some servers refuse with a 400:
``ignore_eos`` (answers as long as ``max_tokens``) and ``stream_options.include_usage`` (token
counts in a last chunk). A 400 or 422 whose body names one of them drops that field for the rest of
the run and sends the request again without it; :attr:`Endpoint.notes` says what was dropped.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

# Why a request failed: the keys of the report's failure counts (besides "http <status>").
CONNECT, TIMEOUT, CONNECTION_LOST = "connect error", "timeout", "connection lost"
MALFORMED, NO_DONE, STREAM_ERROR, NO_TOKENS = ("malformed stream", "no [DONE]", "error in stream",
                                               "no tokens")
FAILURE_REASONS = (CONNECT, TIMEOUT, CONNECTION_LOST, MALFORMED, NO_DONE, STREAM_ERROR, NO_TOKENS,
                   "http <status>")

IGNORE_EOS, INCLUDE_USAGE = "ignore_eos", "stream_options"
ERROR_BODY_BYTES = 4096  # of a non-200 reply's body: enough for its message, bounded
#: A line of the event stream: a completion chunk is a few hundred bytes (a token's text, its
#: log-probs at most); a line past this is not a completion stream.
MAX_LINE_BYTES = 1 << 20


class EndpointError(Exception):
    """The endpoint cannot be used at all (no model list, no model in it): one line for the user."""


@dataclass
class Completion:
    """One streamed completion as the client saw it; times are ``time.perf_counter()`` seconds."""

    started: float
    ended: float = 0.0
    ttft_s: float | None = None  # the first chunk with token text, from the request's start
    itl_s: list[float] = field(default_factory=list)  # the gaps between later chunks with text
    text: str = ""  # what the server streamed back (so far, when it failed)
    chunks: int = 0  # chunks that carried token text
    prompt_tokens: int | None = None  # from the stream's usage, when the server sent it
    completion_tokens: int | None = None
    error: str | None = None  # a reason of FAILURE_REASONS, None when the request succeeded
    detail: str = ""
    disconnected: bool = False  # the client closed the stream after its first text, on purpose

    @property
    def ok(self) -> bool:
        """Whether the answer came whole (neither failed nor cut by the client)."""
        return self.error is None and not self.disconnected

    @property
    def failed(self) -> bool:
        return self.error is not None

    def fail(self, reason: str, detail: str) -> Completion:
        self.error, self.detail = reason, detail[:300]
        return self


class MalformedStream(ValueError):
    """A line of the stream that is not an SSE event of a completion chunk."""


DONE = "[DONE]"


def parse_event(line: str) -> dict[str, Any] | str | None:
    """One line of a server-sent-events stream: a chunk (a JSON object), ``DONE`` for
    ``data: [DONE]``, or None for what carries nothing (blank lines, comments, other fields).
    Raises :class:`MalformedStream` for a data line that is not a JSON object."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == DONE:
        return DONE
    try:
        chunk = json.loads(data)
    except ValueError:
        raise MalformedStream(f"a data line is not JSON: {data[:80]!r}") from None
    if not isinstance(chunk, dict):
        raise MalformedStream(f"a data line is not a JSON object: {data[:80]!r}")
    return chunk


def chunk_text(chunk: dict[str, Any]) -> str:
    """The token text of a completion chunk ("" for a usage-only or empty chunk). Raises
    :class:`MalformedStream` for a chunk of another shape."""
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        raise MalformedStream("a chunk has no choices list")
    if not choices:
        return ""
    first = choices[0]
    text = first.get("text") if isinstance(first, dict) else None
    if text is None:
        return ""
    if not isinstance(text, str):
        raise MalformedStream("a choice's text is not a string")
    return text


class Endpoint:
    """Completions from one model of one OpenAI-compatible server, through one shared client."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, model: str,
                 api_key: str | None = None, request_timeout_s: float = math.inf) -> None:
        """``request_timeout_s``: what one whole request may take, from its send to
        ``data: [DONE]`` (checked as each piece of the stream comes: a stall between pieces is the
        client's per-wait timeout)."""
        self.client = client
        self.request_timeout_s = request_timeout_s
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.extras = {IGNORE_EOS, INCLUDE_USAGE}  # the fields the server has not refused
        self.notes: list[str] = []

    @staticmethod
    async def served_model(client: httpx.AsyncClient, base_url: str,
                           api_key: str | None = None) -> str:
        """The first model ``GET /models`` lists; :class:`EndpointError` when there is none."""
        url = base_url.rstrip("/") + "/models"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            response = await client.get(url, headers=headers)
        except httpx.HTTPError as exc:
            raise EndpointError(f"GET {url}: {_describe(exc)} (pass --model to skip it)") from None
        if response.status_code != 200:
            raise EndpointError(f"GET {url}: HTTP {response.status_code} "
                                f"{response.text[:200]!r} (pass --model to skip it)")
        try:
            models = response.json()["data"]
            return str(models[0]["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise EndpointError(f"GET {url}: no model listed in {response.text[:200]!r} "
                                "(pass --model)") from None

    def body(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                                "temperature": 0, "stream": True}
        if IGNORE_EOS in self.extras:
            body[IGNORE_EOS] = True
        if INCLUDE_USAGE in self.extras:
            body[INCLUDE_USAGE] = {"include_usage": True}
        return body

    async def complete(self, prompt: str, max_tokens: int, disconnect: bool = False) -> Completion:
        """Stream one completion; a refused extension field is dropped and the request sent again
        (each time with fewer fields, so at most twice more). ``disconnect``: close the stream
        once the first token text has come, as a user who leaves does (the server should abort
        the request)."""
        while True:
            outcome = await self._stream(prompt, max_tokens, disconnect)
            if isinstance(outcome, Completion):
                return outcome
            if outcome.name in self.extras:  # else another request of the run dropped it already
                self.extras.discard(outcome.name)
                self.notes.append(_REFUSED_NOTES[outcome.name])

    async def _stream(self, prompt: str, max_tokens: int, disconnect: bool) -> Completion | Refused:
        url = self.base_url + "/completions"
        body = self.body(prompt, max_tokens)
        done = Completion(started=time.perf_counter())
        try:
            async with self.client.stream("POST", url, json=body,
                                          headers=self.headers) as response:
                if response.status_code != 200:
                    return await self._refusal(response, done, body)
                await self._read(response, done, disconnect)
        except httpx.TimeoutException as exc:  # connecting, sending, or a read of the stream
            done.fail(TIMEOUT, _describe(exc))
        except httpx.ConnectError as exc:
            done.fail(CONNECT, _describe(exc))
        except httpx.HTTPError as exc:  # the peer closed or reset the connection, a bad reply
            done.fail(CONNECTION_LOST, _describe(exc))
        except MalformedStream as exc:
            done.fail(MALFORMED, str(exc))
        except RequestDeadline:
            done.fail(TIMEOUT, f"the whole request took over {self.request_timeout_s:g} s "
                      f"(--request-timeout), {done.chunks} chunk(s) in")
        done.ended = time.perf_counter()
        if not done.failed and done.ttft_s is None:
            done.fail(NO_TOKENS, "the stream ended without any token text")
        return done

    async def _read(self, response: httpx.Response, done: Completion, disconnect: bool) -> None:
        last = done.started
        deadline = done.started + self.request_timeout_s
        async for line in _lines(response, deadline):
            event = parse_event(line)
            if event is None:
                continue
            if event == DONE:
                return
            assert isinstance(event, dict)
            if "error" in event:
                done.fail(STREAM_ERROR, json.dumps(event["error"])[:300])
                return
            text = chunk_text(event)
            if text:
                now = time.perf_counter()
                if done.ttft_s is None:
                    done.ttft_s = now - done.started
                else:
                    done.itl_s.append(now - last)
                last = now
                done.text += text
                done.chunks += 1
                if disconnect:  # leaving the response's context closes the connection
                    done.disconnected = True
                    return
            usage = event.get("usage")
            if isinstance(usage, dict):
                done.prompt_tokens = _count(usage.get("prompt_tokens"))
                done.completion_tokens = _count(usage.get("completion_tokens"))
        done.fail(NO_DONE, f"the stream ended after {done.chunks} chunk(s) without data: [DONE]")

    async def _refusal(self, response: httpx.Response, done: Completion,
                       body: dict[str, Any]) -> Completion | Refused:
        """A reply other than 200: a failed completion, or, for a 400/422 whose message names an
        extension field the request carried, that field (to send the request again without it)."""
        head = bytearray()
        async for piece in response.aiter_bytes():
            head += piece
            if len(head) >= ERROR_BODY_BYTES:
                break
        text = head[:ERROR_BODY_BYTES].decode("utf-8", "replace")
        done.ended = time.perf_counter()
        if response.status_code in (400, 422):
            for name in (IGNORE_EOS, INCLUDE_USAGE):
                if name in body and (name in text or (name == INCLUDE_USAGE and "include_usage" in text)):
                    return Refused(name)
        return done.fail(f"http {response.status_code}", " ".join(text.split()))


class RequestDeadline(Exception):
    """The whole request took longer than its deadline."""


async def _lines(response: httpx.Response, deadline: float) -> AsyncIterator[str]:
    """The stream's lines (``\\n`` or ``\\r\\n`` ends one), each at most ``MAX_LINE_BYTES``
    (:class:`MalformedStream` past it), until the body ends or ``deadline`` (perf_counter) passes
    (:class:`RequestDeadline`)."""
    pending = bytearray()
    async for piece in response.aiter_bytes():
        if time.perf_counter() > deadline:
            raise RequestDeadline
        pending += piece
        start = 0
        while (end := pending.find(b"\n", start)) >= 0:
            yield pending[start:end].rstrip(b"\r").decode("utf-8", "replace")
            start = end + 1
        del pending[:start]
        if len(pending) > MAX_LINE_BYTES:
            raise MalformedStream(f"a line of over {MAX_LINE_BYTES} bytes")
    if pending:
        yield pending.rstrip(b"\r").decode("utf-8", "replace")


@dataclass(frozen=True)
class Refused:
    """A 400/422 reply that named the extension field ``name`` of the request."""

    name: str


_REFUSED_NOTES = {
    IGNORE_EOS: "the server refused ignore_eos: an answer may end before its max_tokens",
    INCLUDE_USAGE: "the server refused stream_options.include_usage: prompt tokens are estimated "
                   "from words",
}


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _describe(exc: httpx.HTTPError) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
