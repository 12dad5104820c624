"""Prometheus metrics of one server, and their documentation (``docs/metrics.md``).

Every figure of the stats schema (``lmcache_core.stats``) is exported as its field declares: one
family per ``metric`` name (``lmcache_`` prefix; a counter gets ``_total``), its help from the
declaration, labelled by ``tier`` for the families every tier shares and by key for a dict field;
nothing here names a counter. ``ServerCollector`` reads the same ``ServerStats`` SERVER_INFO sends
(``ServerViews.server_stats``) when Prometheus scrapes, and adds the families labelled by model,
tenant and version (``LABELLED``: pool shares and registrations, from lists, not fields). The
request latency histogram is the only per-request cost: ``ServerMetrics.observe``, which the
transport calls once per request (a ``perf_counter`` pair there, one ``Histogram.observe`` here:
about 1 us). The library's process and Python collectors add ``process_*`` and ``python_*``.

Names follow Prometheus conventions (base units, ``_total`` counters); label values come from small
fixed sets (op, error code, tier, model name: never a hash or a request id).
``python -m lmcache_core.server.metrics --markdown`` writes the table of every family.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Histogram,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from lmcache_core import __version__
from lmcache_core.engine import CacheEngine
from lmcache_core.protocol.ops import RequestType
from lmcache_core.server.listing import model_stats, tenant_stats
from lmcache_core.server.registry import KVRegistry
from lmcache_core.stats import Figure, ServerStats, Stats, declared, sections

#: Request latencies from 100 us (a lookup of a few chunks) to 10 s (a large copy under load).
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                   0.5, 1.0, 2.5, 5.0, 10.0)
#: Model names become label values; beyond this many the rest are summed under "other".
MAX_MODEL_LABELS = 32


class Labelled:
    """A family that is no field of the stats schema: per model, tenant, op or version."""

    def __init__(self, name: str, kind: str, label: str, help_text: str, where: str) -> None:
        self.name, self.kind, self.label, self.help, self.where = name, kind, label, help_text, where


#: Every family not declared in the stats schema, by name without ``lmcache_``.
LABELLED = {family.name: family for family in (
    Labelled("request_duration_seconds", "histogram", "op",
             "Time serving a request (decode, handler, encode; not the wait in the queue), by op "
             "(ours: lookup, store, ...; LMCache's clients' ops as lmcache.store, lmcache.lookup, ...).",
             ""),
    Labelled("model_used_bytes", "gauge", "model",
             "Bytes of a model's chunk pieces resident in the pool, by model.",
             "`models[].bytes_used`"),
    Labelled("model_pieces", "gauge", "model",
             "A model's chunk pieces resident in the pool, by model.", "`models[].pieces`"),
    Labelled("model_quota_bytes", "gauge", "model",
             "A model's memory quota (server.quotas), by model.", "`models[].quota_bytes`"),
    Labelled("tenant_used_bytes", "gauge", "tenant",
             "Bytes of a cache_salt tenant's chunk pieces resident in the pool, by tenant (its "
             "label in server.tenant_quotas, else its tag).", "`tenants[].bytes_used`"),
    Labelled("tenant_quota_bytes", "gauge", "tenant",
             "A cache_salt tenant's memory quota (server.tenant_quotas), by tenant.",
             "`tenants[].quota_bytes`"),
    Labelled("registered_workers", "gauge", "model",
             "KV caches registered (one per worker rank; a hybrid model's: one per KV-cache group), "
             "by model.", "`models[].registered`"),
    Labelled("build_info", "gauge", "version", "The lmcache version serving (always 1).",
             "`version`"),
)}


class ServerMetrics:
    """The registry ``/metrics`` serves, and the latency histogram the transport feeds."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        declared_latency = LABELLED["request_duration_seconds"]
        latency = Histogram(f"lmcache_{declared_latency.name}", declared_latency.help,
                            [declared_latency.label], buckets=LATENCY_BUCKETS,
                            registry=self.registry)
        # One child per op of ours made now: every op's series exists from the start, and
        # observe() does no label lookup. LMCache's ops (a fixed set of names) get theirs at first.
        self._latency = latency
        self._observers: dict[RequestType | str, Callable[[float], None]] = {
            op: latency.labels(op=op_label(op)).observe for op in RequestType}
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            self.registry.register(collector)

    def observe(self, op: RequestType | str, seconds: float, _error_code: str) -> None:
        """One served request (the transport's ``observe`` hook); a str op is LMCache's."""
        observer = self._observers.get(op)
        if observer is None:
            observer = self._observers[op] = self._latency.labels(op=op_label(op)).observe
        observer(seconds)

    def watch(self, collector: Collector) -> None:
        """Add a collector read at every scrape (the server's ``ServerCollector``)."""
        self.registry.register(collector)


def op_label(op: RequestType | str) -> str:
    """``lmc.store`` -> ``store``; LMCache's ``store`` (its op name) -> ``lmcache.store``."""
    if isinstance(op, RequestType):
        return op.value.removeprefix("lmc.")
    return "lmcache." + op


Family = CounterMetricFamily | GaugeMetricFamily


def schema_families(stats: ServerStats) -> list[Family]:
    """The families of every declared field of the configured sections of ``stats``."""
    families: dict[str, Family] = {}
    for name, _ in sections():
        section: Stats | None = getattr(stats, name)
        if section is None:
            continue
        for figure in declared(type(section)):  # its own class: what it holds is what is exported
            if figure.total_of:
                continue  # the sum of another family's samples, not one of its own
            family = families.get(figure.metric)
            if family is None:
                family = families[figure.metric] = _family(figure)
            value = getattr(section, figure.field)
            if figure.label:
                for key, count in sorted(value.items()):
                    family.add_metric([key], count)
            else:
                family.add_metric([section.tier] if figure.tier else [], value)
    return list(families.values())


def _family(figure: Figure) -> Family:
    labels = [figure.label] if figure.label else ["tier"] if figure.tier else []
    kind = CounterMetricFamily if figure.kind == "counter" else GaugeMetricFamily
    return kind(f"lmcache_{figure.metric}", figure.help, labels=labels)


def _labelled(name: str) -> GaugeMetricFamily:
    family = LABELLED[name]
    return GaugeMetricFamily(f"lmcache_{name}", family.help, labels=[family.label])


class ServerCollector(Collector):
    """Reads one server's figures when Prometheus scrapes; holds no state of its own."""

    def __init__(self, stats: Callable[[], ServerStats], engine: CacheEngine,
                 registry: KVRegistry) -> None:
        self._stats = stats  # ServerViews.server_stats: what SERVER_INFO sends
        self._engine = engine
        self._registry = registry

    def describe(self) -> Iterator[Metric]:
        return iter(())  # the names depend on the tiers configured: no check at registration

    def collect(self) -> Iterator[Metric]:
        yield from schema_families(self._stats())
        yield from self._models()
        yield from self._tenants()
        yield from self._workers()
        info = _labelled("build_info")
        info.add_metric([__version__], 1)
        yield info

    def _models(self) -> Iterator[Metric]:
        """Each model's share of the pool, by model (the largest first; beyond MAX_MODEL_LABELS
        the rest summed under "other"), and the quotas of those that have one."""
        rows = sorted(model_stats(self._engine), key=lambda row: (-row.bytes_used, row.model_name))
        used, pieces = _labelled("model_used_bytes"), _labelled("model_pieces")
        for row in rows[:MAX_MODEL_LABELS]:
            used.add_metric([row.model_name], row.bytes_used)
            pieces.add_metric([row.model_name], row.pieces)
        if len(rows) > MAX_MODEL_LABELS:
            rest = rows[MAX_MODEL_LABELS:]
            used.add_metric(["other"], sum(row.bytes_used for row in rest))
            pieces.add_metric(["other"], sum(row.pieces for row in rest))
        yield used
        yield pieces
        quotas = _labelled("model_quota_bytes")
        for model, quota in sorted(self._engine.quotas.items())[:MAX_MODEL_LABELS]:
            quotas.add_metric([model], quota)
        yield quotas

    def _tenants(self) -> Iterator[Metric]:
        """Each cache_salt tenant's bytes and quota, labelled by its label in
        server.tenant_quotas, else its tag (``keys.tenant_tag``): the named ones, then the
        largest others up to MAX_MODEL_LABELS in all."""
        used, quotas = _labelled("tenant_used_bytes"), _labelled("tenant_quota_bytes")
        for row in tenant_stats(self._engine)[:MAX_MODEL_LABELS]:
            used.add_metric([row.name or row.tenant], row.bytes_used)
            if row.quota_bytes is not None:
                quotas.add_metric([row.name or row.tenant], row.quota_bytes)
        yield used
        yield quotas

    def _workers(self) -> Iterator[Metric]:
        workers = _labelled("registered_workers")
        ranked = sorted(self._registry.models().items(), key=lambda item: (-item[1], item[0]))
        for model, count in ranked[:MAX_MODEL_LABELS]:
            workers.add_metric([model], count)
        if len(ranked) > MAX_MODEL_LABELS:
            workers.add_metric(["other"], sum(count for _, count in ranked[MAX_MODEL_LABELS:]))
        yield workers


# ---------------------------------------------------------------------------- the documentation


def markdown() -> str:
    """``docs/metrics.md``: every family, from the schema's declarations and ``LABELLED``."""
    rows: dict[str, list[str]] = {}  # family name -> [type, label, SERVER_INFO fields, help]
    totals: list[tuple[str, str]] = []  # (family, field) of the fields that sum a family
    for name, struct in sections():
        for figure in declared(struct):
            where = f"`stats.{name}.{figure.field}`"
            if figure.total_of:
                totals.append((figure.total_of, where + " (their sum)"))
            elif figure.metric in rows:
                rows[figure.metric][2] += ", " + where
            else:
                label = figure.label or ("tier" if figure.tier else "")
                rows[figure.metric] = [figure.kind, label, where, figure.help]
    for family in LABELLED.values():
        rows[family.name] = [family.kind, family.label, family.where, family.help]
    for family_name, where in totals:
        rows[family_name][2] = ", ".join(part for part in (rows[family_name][2], where) if part)
    lines = [
        "# Metrics",
        "",
        "Generated by `python -m lmcache_core.server.metrics --markdown > docs/metrics.md` from the",
        "stats schema (`lmcache_core/stats.py`) and `LABELLED` (`lmcache_core/server/metrics.py`);",
        "a test fails when this file is stale. `GET /metrics` on `server.http_url` serves them in",
        "the Prometheus text format; SERVER_INFO (`lmcache stats --json`) sends the same figures.",
        "Families labelled `tier` and those of `stats.disk`, `stats.remote`, `stats.events` appear",
        "only when that tier or `server.events_url` is configured. Counters are per server, not",
        "per model; model and tenant labels cover the 32 largest (the rest summed as `other`).",
        "",
        "| metric | type | SERVER_INFO | meaning |",
        "|---|---|---|---|",
    ]
    for family_name, (kind, label, where, help_text) in rows.items():
        name = f"lmcache_{family_name}" + ("_total" if kind == "counter" else "")
        shown = f"`{name}{{{label}}}`" if label else f"`{name}`"
        lines.append(f"| {shown} | {kind} | {where} | {help_text} |")
    lines.append("| `process_*`, `python_*` | | | From `prometheus_client`: CPU seconds, resident "
                 "and virtual memory, open fds, start time; Python version and GC. |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if argv != ["--markdown"]:
        print("usage: python -m lmcache_core.server.metrics --markdown", file=sys.stderr)
        return 2
    sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
