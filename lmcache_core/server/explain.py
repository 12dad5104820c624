"""The EXPLAIN handler of ``lmcache serve`` (``lmcache lookup --explain``), and the count of stores
by hash mode it reports.

A lookup that misses says nothing of why. EXPLAIN says who holds the probes the CLI hashed (the
first chunk of each variant of a prompt: as asked, unsalted, at other chunk sizes) under any model
and layout, in memory, on disk and in Redis, and what the server knows of the asked model: its
registered workers, its layouts, its pieces per tenant tag and how its chunks were named (token
ids or vLLM's block hashes, which the hashes themselves do not tell). The CLI names the cause.

Nothing is loaded, locked, touched or counted. Memory and the disk's index are looked through
pair by pair (one dict look-up per (model, layout) and probe, the engine's lock held for a batch
of pairs at a time); Redis is asked for exact keys of a bounded set of (model, layout) pairs, in
one pipelined STRLEN within the lookup budget, never SCANned. It runs on the worker threads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from lmcache_core.engine import CacheEngine
from lmcache_core.protocol import explain_messages as em
from lmcache_core.server.registry import KVRegistry

#: Models whose stores are counted by hash mode: the last ones stored (a server serves a few).
MAX_MODE_MODELS = 256
#: (model, layout) pairs whose Redis keys one explain asks for: the asked model's first.
MAX_REMOTE_PAIRS = 16
#: Tenant tags listed per model (the most pieces first).
MAX_TENANTS = 64
#: Holders one reply lists (a probe held under many names is rare; each is a few dozen bytes).
MAX_HOLDERS = 1024


class StoreModes:
    """Stores per model by hash mode (``StoreRequest.hash_mode``): "vllm" (vLLM's block hashes),
    "tokens" (a chain over token ids), "" (not said: the adapters' token mode, an older client).
    The one count of them; thread-safe (stores run on the worker threads); the last
    ``MAX_MODE_MODELS`` models stored."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._counts: OrderedDict[str, dict[str, int]] = OrderedDict()

    def count(self, model_name: str, mode: str) -> None:
        with self._mutex:
            counts = self._counts.setdefault(model_name, {})
            counts[mode] = counts.get(mode, 0) + 1
            self._counts.move_to_end(model_name)
            if len(self._counts) > MAX_MODE_MODELS:
                self._counts.popitem(last=False)

    def of(self, model_name: str) -> dict[str, int]:
        with self._mutex:
            return dict(self._counts.get(model_name, {}))


class ExplainHandler:
    """EXPLAIN over one engine and registry; ``budget_s``: how long Redis may take."""

    def __init__(self, engine: CacheEngine, registry: KVRegistry, modes: StoreModes,
                 budget_s: float) -> None:
        self.engine = engine
        self.registry = registry
        self.modes = modes
        self.budget_s = budget_s

    def explain(self, request: em.ExplainRequest, _client: bytes) -> em.ExplainReply:
        model = request.model_name
        shapes = self.registry.shapes()
        pairs = self.engine.pairs()
        asked = [(model, name) for name in (request.layout, request.hint_layout) if name]
        registered = [(m, layout) for m, layout, _ in shapes]
        remote_pairs = _asked_first(model, asked + registered + pairs)[:MAX_REMOTE_PAIRS]
        finds = self.engine.holders(request.probes, model, remote_pairs, self.budget_s)
        pieces, tenants = self.engine.store.model_tenants(model)
        holders = [em.ProbeHolder(probe=h.probe, model_name=h.model_name, layout=h.layout,
                                  tier=h.tier, heads=list(h.ranges), tenants=list(h.tenants))
                   for h in finds.found[:MAX_HOLDERS]]
        return em.ExplainReply(
            holders=holders, pieces=pieces,
            layouts=sorted({layout for m, layout in pairs if m == model}),
            registered=[em.RegisteredShape(layout=layout, world_size=world, workers=workers)
                        for (m, layout, world), workers in sorted(shapes.items()) if m == model],
            hash_modes=self.modes.of(model),
            tenants=[em.TenantPieces(tenant=tag, pieces=count) for tag, count in sorted(
                tenants.items(), key=lambda item: (-item[1], item[0]))[:MAX_TENANTS]],
            remote=finds.remote, cut=finds.cut or len(finds.found) > MAX_HOLDERS)


def _asked_first(model: str, pairs: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """``pairs`` once each, the asked model's first (in their order)."""
    unique = list(dict.fromkeys(pairs))
    return [p for p in unique if p[0] == model] + [p for p in unique if p[0] != model]
