"""How ``lmcache bench serve`` sends a workload's requests: how many at once, when, and in which
order, on one asyncio loop with one httpx client.

- ``concurrency`` N: N requests in flight; a request is sent when a slot frees (first come, in plan
  order).
- ``arrivals`` (a Poisson schedule): each request is sent at its own time from the run's start,
  whether or not earlier answers are back (with ``concurrency`` as a cap on those in flight, if one
  is given), so a slow server meets the load a busy service would put on it.
- Either way a request that follows another (a chat user's next turn, a file's next line of the
  same user) waits for that one to finish: a user does not type before the answer is there.

A chat turn's prompt is made when it is sent: the user's history (the previous turn's prompt and the
answer the server actually streamed, partial when that turn failed, none when the client closed it
on purpose) and its new message.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from lmcache_cli.bench_serve_client import Completion, Endpoint
from lmcache_cli.bench_serve_workload import PlannedRequest, chat_prompt


@dataclass(frozen=True)
class EndpointSettings:
    """Where and how to send: the API base urls (``http://host:8000/v1``; several: replicas of
    one model, see ``replica``), the model (None: the first ``GET /models`` of the first url
    lists), an API key, the timeout of every wait and what one whole request may take."""

    base_urls: tuple[str, ...]
    model: str | None
    api_key: str | None
    timeout_s: float
    request_timeout_s: float


def replica(request: PlannedRequest, replicas: int) -> int:
    """Which of ``replicas`` servers a request goes to: round robin by user and turn, so a chat
    user's next turn lands on the next replica (its history was computed on another one: only a
    cache the replicas share can spare recomputing it); other requests by their index."""
    if replicas == 1:
        return 0
    if isinstance(request.user, int) and request.chat:
        return (request.user + request.turn) % replicas
    return request.index % replicas


@dataclass(frozen=True)
class Sent:
    """A request of the plan once it is done: its prompt's size, when it was due and how it went."""

    request: PlannedRequest
    prompt_words: int
    scheduled_s: float | None  # its arrival in the Poisson schedule, from the run's start
    completion: Completion


@dataclass(frozen=True)
class RunResult:
    model: str
    sent: list[Sent]  # in plan order
    started: float  # time.perf_counter() at the run's start (the schedule's zero)
    ended: float
    sent_extras: frozenset[str]  # the extension fields the server accepted (bench_serve_client)
    notes: list[str]


async def run(settings: EndpointSettings, plan: list[PlannedRequest], concurrency: int | None,
              arrivals: list[float] | None, on_done: Callable[[Sent], None]) -> RunResult:
    """Send every request of ``plan`` (raises ``EndpointError`` when no model can be found)."""
    # The benchmark measures the endpoint, never a proxy the environment may name; the pool is not
    # the limit (the slots below are), and each wait is bounded by the timeout.
    async with httpx.AsyncClient(timeout=httpx.Timeout(settings.timeout_s), trust_env=False,
                                 limits=httpx.Limits(max_connections=None,
                                                     max_keepalive_connections=None)) as client:
        model = settings.model or await Endpoint.served_model(client, settings.base_urls[0],
                                                              settings.api_key)
        endpoints = [Endpoint(client, url, model, settings.api_key, settings.request_timeout_s)
                     for url in settings.base_urls]
        started = time.perf_counter()
        sent = await send_all(endpoints, plan, concurrency, arrivals, on_done, started)
        extras = frozenset.intersection(*(frozenset(e.extras) for e in endpoints))
        notes = list(dict.fromkeys(note for e in endpoints for note in e.notes))
        return RunResult(model=model, sent=sent, started=started, ended=time.perf_counter(),
                         sent_extras=extras, notes=notes)


async def send_all(endpoints: list[Endpoint], plan: list[PlannedRequest], concurrency: int | None,
                   arrivals: list[float] | None, on_done: Callable[[Sent], None],
                   started: float) -> list[Sent]:
    finished = [asyncio.Event() for _ in plan]
    history: dict[int | str, str] = {}  # a chat user's last prompt and its streamed answer
    slots = asyncio.Semaphore(concurrency) if concurrency else None
    done: list[Sent | None] = [None] * len(plan)

    async def send(request: PlannedRequest) -> None:
        scheduled = arrivals[request.index] if arrivals is not None else None
        if scheduled is not None:
            await asyncio.sleep(max(0.0, started + scheduled - time.perf_counter()))
        if request.after is not None:
            await finished[request.after].wait()  # bounded: every wait of that request is
        async with slots or contextlib.nullcontext():
            prompt = chat_prompt(history.get(request.user, ""), request.text) if request.chat \
                else request.text
            endpoint = endpoints[replica(request, len(endpoints))]
            completion = await endpoint.complete(prompt, request.max_tokens, request.disconnect)
        if request.chat:  # a cut answer stays out of the history: how far it got is chance
            history[request.user] = prompt + ("" if completion.disconnected else completion.text)
        result = Sent(request, len(prompt.split()), scheduled, completion)
        done[request.index] = result
        finished[request.index].set()
        on_done(result)

    await asyncio.gather(*(send(request) for request in plan))
    return [result for result in done if result is not None]
