"""The remote tier's Redis key names: a ``ChunkKey`` to its key (``redis_key``) and back (``key_of``).

Keys carry the record format version, the model, the layout fingerprint, the head range and the
chunk hash in hex::

    <prefix>:v2:<model>:<layout>:<head_lo>-<head_hi>:<hash hex>

e.g. ``lmcache:v2:org/llama:bfloat16:32x8x128:0-4:9f3a...``, so servers on different machines
(and at different tensor-parallel sizes) that use the same Redis find each other's chunks. The
model and the layout may hold ``:``; the split is still unambiguous because a layout is a
fingerprint (``layout_key``: ``dtype:...``, one ``:``; ``opaque_layout``: ``ranksN``, none), and
``key_of`` only takes back a key that ``redis_key`` would write. Keys of format v1
(``<prefix>:v1:<model>:<world_size>:<kv_rank>:<hash hex>``) are never read.
"""

from __future__ import annotations

from lmcache_core.keys import ChunkKey, layout_heads


def redis_key(prefix: str, key: ChunkKey) -> bytes:
    """``<prefix>:v2:<model>:<layout>:<head_lo>-<head_hi>:<hash hex>`` (UTF-8); ``prefix`` is the
    ``<prefix>:v2:`` part, format version and trailing ``:`` included."""
    return (f"{prefix}{key.model_name}:{key.layout}:{key.head_lo}-{key.head_hi}:"
            f"{key.chunk_hash.hex()}").encode()


def key_of(prefix: str, rkey: bytes) -> ChunkKey | None:
    """The key ``redis_key(prefix, ...)`` made ``rkey`` of; None for anything else (another prefix
    or format version, a malformed key, a layout that is no fingerprint)."""
    try:
        text = rkey.decode()
        if not text.startswith(prefix):
            return None
        rest, heads, hexhash = text[len(prefix):].rsplit(":", 2)
        lo, _, hi = heads.partition("-")
        chunk_hash = bytes.fromhex(hexhash)
        if not chunk_hash:
            return None
        for cut in (1, 2):  # the layout's own ":"s: none (ranksN) or one (dtype:...)
            parts = rest.rsplit(":", cut)
            if len(parts) != cut + 1:
                continue
            layout = ":".join(parts[1:])
            try:
                layout_heads(layout)
            except ValueError:
                continue
            key = ChunkKey(parts[0], layout, int(lo), int(hi), chunk_hash)
            ok = key.head_lo < key.head_hi and redis_key(prefix, key) == rkey
            return key if ok else None
    except ValueError:  # UnicodeDecodeError too
        return None
    return None
