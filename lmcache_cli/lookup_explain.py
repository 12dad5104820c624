"""``lmcache lookup --explain``: why a prompt's lookup hits, misses or stops short, in one line.

A lookup names a chunk by (model name, layout fingerprint, head range, chunk hash) and the hash
by the chunk size and the chain's seed (LMCache's ``NONE_HASH``, or a cache_salt's and LoRA
adapter's). When the engine that stored a prompt and the one that looks it up disagree on any of
them, the lookup finds nothing and says nothing. For a prompt that is not a full hit, this hashes
variants of it (as asked, without the salt, at other chunk sizes) and sends the first chunk hash
of each as a probe of one EXPLAIN: the server says under which model, layout and head ranges
each is held, in which tier, and what it knows of the asked model (its layouts, registered
workers, stores by hash mode, pieces per tenant). The nearest mismatch is named here, in this
order: the prompt held under another model name, another layout, for another world size; held
without the salt; at another chunk size; the model stored from vLLM's block hashes; the model's
pieces held by other tenants; else not stored. Never imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from lmcache_cli.common import EXIT_USAGE, fail

#: Chunk sizes tried besides the server's: powers of two from 16 to 4096, their 1.5x
#: (48 ... 3072), and every multiple of 16 up to 512 (the sizes a config is likely to hold),
#: those the prompt is long enough for.
_POWERS = [16 << k for k in range(9)]
_SIZES = sorted({*_POWERS, *(3 * p for p in _POWERS if 3 * p <= 4096), *range(16, 513, 16)})
#: Why a lookup missed, as ``--json``'s ``cause`` names it, and as the table's line says it.
CAUSES = {
    "model_name": "other model name",
    "layout": "other layout",
    "world_size": "other world size",
    "chunk_size": "other chunk size",
    "hash_mode": "other hash mode",
    "tenant": "other tenant",
    "not_stored": "not stored",
}


class Probe(NamedTuple):
    """One variant of a prompt sent as a probe: its ``chunk``-th chunk hash at ``chunk_size``,
    from the asked seed (``asked_seed``: the one --salt/--lora make, else LMCache's) or from the
    unsalted one."""

    chunk_hash: bytes
    chunk_size: int
    chunk: int
    asked_seed: bool


class Asked(NamedTuple):
    """What a lookup asked for: the keys' model, world size and layout (the one the peek counted
    in, else --layout's or the config's; ``exact``: --layout's alone, else every layout the
    server knows for the model was tried too), the server's chunk size, and the seed's parts."""

    model: str
    world_size: int
    layout: str
    exact: bool
    chunk_size: int
    salt: str | None
    lora: str | None

    @property
    def seeded(self) -> bool:
        return bool(self.salt or self.lora)


def seed_parts(salt: str | None, lora: str | None) -> list[tuple[str, str]]:
    """The chain seed's parts, as the vLLM connector makes them (``connector_requests.
    request_prefix``): ``("salt", cache_salt)``, then ``("lora", "NAME#ID")``; exit 2 for a salt
    that is empty or a LoRA that is not ``NAME#ID``."""
    parts: list[tuple[str, str]] = []
    if salt is not None:
        if not salt:
            fail("--salt is empty: a request without a cache_salt is unsalted (leave --salt out)",
                 EXIT_USAGE)
        parts.append(("salt", salt))
    if lora is not None:
        name, sep, lora_id = lora.rpartition("#")
        if not sep or not name or not lora_id.isdigit():
            fail(f"--lora {lora[:80]!r} is not NAME#ID: the LoRA adapter's name and integer id, as "
                 "vLLM's LoRARequest (lora_name, lora_int_id), e.g. sql-adapter#1", EXIT_USAGE)
        parts.append(("lora", lora))
    return parts


def probes_for(prompt: Sequence[int], asked: Asked, hit: int, seed: bytes) -> list[Probe]:
    """The variants of ``prompt`` to ask about: its first chunk past the ``hit`` ones as asked
    and unsalted (when seeded); for a prompt of which nothing was held, its first chunk at every
    other chunk size it is long enough for, from the asked seed and unsalted."""
    from lmcache_core.keys import NONE_HASH, chain_hashes

    seeds = [(seed, True)] + ([(NONE_HASH, False)] if asked.seeded else [])
    size = asked.chunk_size
    probes: list[Probe] = []
    if len(prompt) >= (hit + 1) * size:
        for start, as_asked in seeds:
            probes.append(Probe(chain_hashes(prompt[:(hit + 1) * size], size, start)[hit], size,
                                hit, as_asked))
    if not hit:
        for start, as_asked in seeds:
            probes += [Probe(chain_hashes(prompt[:other], other, start)[0], other, 0, as_asked)
                       for other in _SIZES if other != size and other <= len(prompt)]
    return probes


def explain_prompt(client: Any, prompt: Sequence[int], row: dict[str, Any], asked: Asked,
                   seed: bytes, layouts: tuple[str | None, str | None]) -> dict[str, Any]:
    """A prompt's ``explain`` object: one EXPLAIN of its probes unless it is a full hit
    (``layouts``: the lookup's ``layout`` and ``hint_layout``)."""
    from lmcache_core.protocol import explain_messages as em
    from lmcache_core.protocol import ops

    full, hit = row["full_chunks"], row["hit_chunks"]
    if full and hit == full:
        return explain(asked, row, [], None)
    probes = probes_for(prompt, asked, hit, seed)
    reply = em.ExplainReply(holders=[])  # a prompt too short for any chunk size: nothing to ask
    if probes:
        reply = client.call(ops.EXPLAIN, em.ExplainRequest(
            model_name=asked.model, world_size=asked.world_size,
            probes=[p.chunk_hash for p in probes], layout=layouts[0], hint_layout=layouts[1]))
    return explain(asked, row, probes, reply)


def candidates(reply: Any, probes: Sequence[Probe]) -> list[dict[str, Any]]:
    """Where the probes are held, as ``--json`` lists them (stable keys)."""
    out: list[dict[str, Any]] = []
    for holder in reply.holders:
        probe = probes[holder.probe]
        out.append({"model": holder.model_name, "layout": holder.layout, "tier": holder.tier,
                    "heads": [list(r) for r in holder.heads], "chunk_size": probe.chunk_size,
                    "chunk": probe.chunk, "seed": "asked" if probe.asked_seed else "unsalted",
                    "tenants": list(holder.tenants)})
    return out


def explain(asked: Asked, row: dict[str, Any], probes: Sequence[Probe],
            reply: Any | None) -> dict[str, Any]:
    """The ``explain`` object of a prompt's row (``verdict``, ``cause``, ``detail``,
    ``candidates``); ``reply``: the EXPLAIN reply (None for a full hit: nothing was asked)."""
    full, hit = row["full_chunks"], row["hit_chunks"]
    if full and hit == full:
        return {"verdict": "hit", "cause": None, "candidates": [],
                "detail": f"all {full} chunk(s) held ({_tiers(row)})"}
    verdict = "partial" if hit else "miss"
    assert reply is not None
    cause, detail = _cause(asked, row, probes, reply)
    if hit:
        detail = f"the first {hit} of {full} chunk(s) are held ({_tiers(row)}); past them: {detail}"
    notes = _notes(reply)
    return {"verdict": verdict, "cause": cause, "candidates": candidates(reply, probes),
            "detail": detail + (f" ({notes})" if notes else "")}


def _tiers(row: dict[str, Any]) -> str:
    parts = [(row["memory_chunks"], "memory"), (row["disk_chunks"], "disk"),
             (row["remote_chunks"], "Redis")]
    return ", ".join(f"{name} {count}" for count, name in parts if count) or "none"


def _notes(reply: Any) -> str:
    notes = {"down": "Redis is down: not asked", "timeout": "Redis did not answer in time",
             "cut": "Redis was asked for some of the names only"}
    out = [notes[reply.remote]] if reply.remote in notes else []
    if reply.cut:
        out.append("the server holds more models and layouts than one explain looks through")
    return "; ".join(out)


def _cause(asked: Asked, row: dict[str, Any], probes: Sequence[Probe],
           reply: Any) -> tuple[str | None, str]:
    """The nearest mismatch: ``(cause, one line)`` (no cause: held as asked, yet not counted)."""
    by_probe: dict[int, list[Any]] = {}
    for holder in reply.holders:
        by_probe.setdefault(holder.probe, []).append(holder)
    at_size = [i for i, p in enumerate(probes) if p.chunk_size == asked.chunk_size]
    other_size = [i for i, p in enumerate(probes) if p.chunk_size != asked.chunk_size]
    as_asked = [h for i in at_size if probes[i].asked_seed for h in by_probe.get(i, [])]
    if as_asked:
        return _held_elsewhere(asked, row, as_asked, reply)
    if row["hit_chunks"]:  # its head matched as asked: chunk size, seed and naming are right
        return "not_stored", _not_stored(asked, row, reply)
    unsalted = [h for i in at_size if not probes[i].asked_seed for h in by_probe.get(i, [])]
    if unsalted:
        h = _nearest(asked, unsalted)
        return "tenant", (f"held without {_seed_words(asked)} ({_where(h)}): the engine sent "
                          f"none: look up without {_seed_flags(asked)}")
    sized = sorted((h for i in other_size for h in by_probe.get(i, [])),
                   key=lambda h: (not probes[h.probe].asked_seed, _distance(asked, h)))
    if sized:
        h = sized[0]
        size = probes[h.probe].chunk_size
        salt = "" if probes[h.probe].asked_seed else f", without {_seed_words(asked)}"
        return "chunk_size", (f"held at chunk size {size}{salt} ({_where(h)}), but this server "
                              f"hashes at {asked.chunk_size}: a server with chunk_size: {size} "
                              f"stored them (a disk or Redis tier kept across a config change): "
                              f"serve with chunk_size {size} to hit them")
    modes = reply.hash_modes
    holds = reply.pieces or reply.layouts
    if holds and modes.get("vllm") and not sum(n for mode, n in modes.items() if mode != "vllm"):
        return "hash_mode", (f"model {asked.model!r} was stored in vLLM's hash mode ("
                             f"{modes['vllm']} store(s) named by vLLM's block hashes, as vLLM's "
                             "LMCacheMPConnector sends them, none by token ids): token ids never "
                             "make those names, so a tokens file cannot hit them; their hits show "
                             "in the engine's own lookups")
    tenant = _tenant(asked, reply)
    if tenant:
        return "tenant", tenant
    return "not_stored", _not_stored(asked, row, reply)


def _held_elsewhere(asked: Asked, row: dict[str, Any], held: list[Any],
                    reply: Any) -> tuple[str | None, str]:
    """The prompt's own hash is held: under this model in a layout the lookup tried, by too few
    ranks; under this model in another layout; or under another model."""
    same = [h for h in held if h.model_name == asked.model]
    if not same:
        h = _nearest(asked, held)
        return "model_name", (f"held under model {h.model_name!r} ({h.layout}, {h.tier}), not "
                              f"{asked.model!r} (typical: a path against a Hugging Face id): name "
                              f"the model as the engine that stored it does (--model "
                              f"{h.model_name}), or serve both under one name")
    groups = row.get("groups")
    counted = set(groups) if groups else {asked.layout}
    tried = counted if groups or asked.exact else {
        asked.layout, *reply.layouts, *(shape.layout for shape in reply.registered)}
    for layout in sorted({h.layout for h in same if h.layout in tried}):
        detail = _world_detail(asked, [h for h in same if h.layout == layout])
        if detail is not None:
            return "world_size", detail
    other = [h for h in same if h.layout not in counted]
    if other:
        return "layout", _layout_detail(asked, _nearest(asked, other), groups)
    tiers = ", ".join(sorted({h.tier for h in same}))
    what = "every KV-cache group" if groups else "every rank's heads"
    return None, f"held for {what} ({tiers}), yet the lookup did not count it"


def _world_detail(asked: Asked, exact: list[Any]) -> str | None:
    """What the asked world size lacks of the pieces held in one layout (None: nothing)."""
    from lmcache_core.keys import layout_heads, world_heads
    from lmcache_core.protocol.messages import MAX_WORLD_SIZE

    layout = exact[0].layout
    ranges = sorted({(lo, hi) for h in exact if h.layout == layout for lo, hi in h.heads})
    heads = layout_heads(layout)
    held = ", ".join(f"{lo}-{hi}" for lo, hi in ranges)
    fits = [w for w in range(1, min(heads, MAX_WORLD_SIZE) + 1)
            if heads % w == 0 and all(_covered(ranges, r) for r in world_heads(layout, w))]
    fit = (f"they fit world size {', '.join(map(str, fits))} (--world-size {fits[0]})" if fits
           else "they fit no world size: the other ranks' pieces were never stored, or were "
                "evicted")
    try:
        need = world_heads(layout, asked.world_size)
    except ValueError:
        return (f"held as heads {held} of {layout}, whose {heads} KV heads do not divide among "
                f"world size {asked.world_size}: {fit}")
    missing = ", ".join(f"{lo}-{hi}" for r in need for lo, hi in _gaps(ranges, r))
    if not missing:
        return None
    return (f"held as heads {held} of {heads} ({layout}); world size {asked.world_size} needs "
            f"heads {missing} too: {fit}")


def _covered(ranges: Sequence[tuple[int, int]], need: tuple[int, int]) -> bool:
    """Whether ``ranges`` together hold every head of ``need``."""
    return not _gaps(ranges, need)


def _gaps(ranges: Sequence[tuple[int, int]], need: tuple[int, int]) -> list[tuple[int, int]]:
    """The heads of ``need`` that none of ``ranges`` holds, as ranges."""
    gaps: list[tuple[int, int]] = []
    at, end = need
    for lo, hi in sorted(ranges):
        if hi <= at or lo >= end:
            continue
        if lo > at:
            gaps.append((at, lo))
        at = max(at, hi)
    return gaps + ([(at, end)] if at < end else [])


def _layout_detail(asked: Asked, held: Any, groups: list[str] | None) -> str:
    asked_name = ", ".join(groups) if groups else asked.layout or "?"
    differs = layout_difference(groups[0] if groups else asked.layout, held.layout)
    return (f"held under {held.layout} ({held.tier}), asked {asked_name}: {differs}: the engine "
            f"that stored it has another KV shape; look up with --layout {held.layout} if that "
            f"is the engine you mean")


def layout_difference(asked: str, held: str) -> str:
    """What differs between two layout fingerprints, in words: dtype, layers, KV heads, head
    size, MLA, CPU block order, hybrid group (held first, then asked)."""
    from lmcache_core.keys import layout_fields

    a, h = layout_fields(asked), layout_fields(held)
    if a is None or h is None:
        return "an opaque layout (an in-process engine's) against a KV shape"
    out: list[str] = []
    for name, mine, theirs in (("dtype", a.dtype, h.dtype), ("layers", a.layers, h.layers),
                               ("KV heads", a.heads, h.heads),
                               ("head size", a.head_size, h.head_size)):
        if mine != theirs and (name != "KV heads" or not (a.mla or h.mla)):
            out.append(f"{name} {theirs} vs {mine}")
    if a.mla != h.mla:
        out.append("MLA vs not" if h.mla else "not MLA vs MLA")
    if a.state != h.state:
        out.append("Mamba state vs attention" if h.state else "attention vs Mamba state")
    if a.block_tokens != h.block_tokens:
        out.append(f"CPU block order {_order(h.block_tokens)} vs {_order(a.block_tokens)}")
    if a.group != h.group:
        out.append(f"hybrid group set {_group(held)} vs {_group(asked)}")
    return ", ".join(out) or "the same fields"


def _order(block_tokens: int) -> str:
    return f"b{block_tokens}" if block_tokens else "token order"


def _group(layout: str) -> str:
    return f"+{layout.split('+', 1)[1]}" if "+" in layout else "none"


def _tenant(asked: Asked, reply: Any) -> str:
    """Why the prompt may be another tenant's: without --salt, when every piece of the model in
    memory carries a tenant tag (unsalted prompts have none there); with one, when other tenants
    hold the model's pieces and this salt's none. "" otherwise."""
    from lmcache_core.keys import tenant_tag

    tags = {row.tenant: row.pieces for row in reply.tenants}
    mine = tenant_tag(asked.salt)
    others = {tag: n for tag, n in tags.items() if tag != mine}
    tagged = sum(tags.values())
    if not others or mine in tags or (not asked.salt and tagged < reply.pieces):
        return ""
    if not asked.salt:
        return (f"{len(others)} tenant(s) hold all {reply.pieces} piece(s) of model "
                f"{asked.model!r} in memory, none is unsalted: prompts sent with a cache_salt are "
                "hashed from it: look up with --salt SALT")
    return (f"model {asked.model!r}'s chunks belong to {len(others)} other tenant(s) ({tagged} of "
            f"its {reply.pieces} piece(s) in memory), none to this salt's (tag {mine}): check the "
            "salt, or leave --salt out if the engine sends none")


def _not_stored(asked: Asked, row: dict[str, Any], reply: Any) -> str:
    if not row["full_chunks"]:
        return (f"shorter than one chunk of {asked.chunk_size} tokens: only whole chunks are "
                "stored, so there is nothing to look up")
    if row["hit_chunks"]:
        return (f"chunk {row['hit_chunks'] + 1} is held nowhere: never stored (the prompt goes "
                "on differently from the stored ones), or evicted")
    line = ("the prompt is held under no model, layout, chunk size or salt this server knows: "
            "never stored, or evicted")
    if reply.layouts:
        line += f"; model {asked.model!r} holds {reply.pieces} piece(s) in memory, layouts " \
                f"{', '.join(reply.layouts)}"
    if reply.hash_modes.get("vllm"):
        line += f"; {reply.hash_modes['vllm']} of its stores came in vLLM's hash mode"
    tagged = sum(row.pieces for row in reply.tenants)
    if tagged and not asked.seeded:
        line += (f"; {len(reply.tenants)} tenant(s) hold {tagged} of its pieces (--salt SALT if "
                 "the engine sent a cache_salt)")
    if not asked.seeded and (reply.pieces or reply.layouts):
        line += "; a LoRA adapter seeds the chain too (--lora NAME#ID)"
    return line


def _nearest(asked: Asked, holders: list[Any]) -> Any:
    """The holder nearest the asked names: the asked model first, then the asked layout, then
    the fastest tier."""
    return min(holders, key=lambda h: _distance(asked, h))


def _distance(asked: Asked, holder: Any) -> tuple[bool, bool, int]:
    order = {"memory": 0, "disk": 1, "remote": 2}
    return (holder.model_name != asked.model, holder.layout != asked.layout,
            order.get(holder.tier, 3))


def _where(holder: Any) -> str:
    return f"model {holder.model_name!r}, {holder.layout}, {holder.tier}"


def _seed_words(asked: Asked) -> str:
    """What seeds the asked chain besides LMCache's seed: "the salt", "the LoRA", or both."""
    return " and ".join(what for what, value in (("the salt", asked.salt),
                                                  ("the LoRA", asked.lora)) if value)


def _seed_flags(asked: Asked) -> str:
    return " and ".join(flag for flag, value in (("--salt", asked.salt), ("--lora", asked.lora))
                        if value)


def render(rows: list[dict[str, Any]]) -> None:
    """One line per prompt under the lookup table: green for a hit, yellow for a partial one,
    red for a miss, with its cause."""
    from rich.markup import escape

    from lmcache_cli.common import console

    for row in rows:
        found = row["explain"]
        style = {"hit": "green", "partial": "yellow", "miss": "red"}[found["verdict"]]
        cause = f" · {CAUSES[found['cause']]}" if found["cause"] else ""
        console.print(f"[{style}]prompt {row['prompt']}: {found['verdict']}{cause}:[/] "
                      f"{escape(found['detail'])}", highlight=False)
