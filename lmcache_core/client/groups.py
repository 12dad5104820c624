"""A hybrid model's KV-cache groups as the worker client registers and moves them.

vLLM's hybrid KV cache manager splits a model's layers into groups (``kv_cache_config.
kv_cache_groups``), each with its own spec (full attention, sliding window, chunked-local attention,
Mamba state) and block size, and gives block ids as one list per group. The worker registers each
group as its own KV cache (its layers, its block size, a ``KVGroup`` descriptor) and picks, per
chunk, the blocks each group's piece holds (``keys.group_piece``): every block of the chunk for full
and chunked-local attention, the chunk's last ``piece_blocks`` for a sliding window. Block id 0 is
vLLM's null block (blocks that left the window, or lie before the attention chunk being computed):
a group's chunk naming it is not stored. A load reads only the pieces resuming needs
(``GroupPiece.first_needed``: a sliding window's last chunks, a chunked-local group's from the
start of the attention chunk the load ends in) and leaves out the null blocks at the start of the
oldest one when resuming does not need them (``load_skip``: a window wider than a chunk but not a
whole number of chunks, or an attention chunk that starts inside a chunk, needs only that piece's
last blocks, and vLLM allocates only those); a null block where resuming needs KV fails the
request. A load's per-group parts are cut and packed into a few retrieve requests
(``split_parts``, ``bundle_parts``) that the server's copy threads share evenly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmcache_core.errors import IncompatibleError
from lmcache_core.keys import GroupKind, GroupPiece, group_piece
from lmcache_core.protocol import messages as m

if TYPE_CHECKING:
    import torch

#: vLLM's null block: what a block table holds where a block was freed (out of the window).
NULL_BLOCK = 0
#: What one store or retrieve request of one registration carries: instance id, chunks, blocks.
Part = tuple[int, list[bytes], list[int]]


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One of vLLM's ``kv_cache_groups[g]`` as the worker registers it.

    ``layer_names``: the group's layers, in one order on every rank (vLLM's ``layer_names``);
    ``block_size``: tokens per block of the tensors registered for it (the kernel block size of
    the views given); ``window_tokens``: a sliding window's ``sliding_window``, a chunked-local
    group's ``attention_chunk_size`` (0 otherwise)."""

    layer_names: list[str]
    kind: GroupKind
    block_size: int
    window_tokens: int = 0

    def descriptor(self, index: int, count: int) -> m.KVGroup:
        return m.KVGroup(index=index, count=count, kind=self.kind, block_size=self.block_size,
                         window_tokens=self.window_tokens)


def group_caches(kv_caches: Mapping[str, torch.Tensor | list[torch.Tensor]],
                 groups: Sequence[KVCacheGroupSpec]) -> list[dict[str, torch.Tensor]]:
    """Each group's layers (its tensors, in its order; a Mamba group's as ``state_rows``);
    IncompatibleError for a layer that was not given, or given as a list of tensors where one
    is needed."""
    out: list[dict[str, torch.Tensor]] = []
    for index, group in enumerate(groups):
        missing = [name for name in group.layer_names if name not in kv_caches]
        if missing or not group.layer_names:
            raise IncompatibleError(f"KV cache group {index} names layers not given to "
                                    f"register_kv_caches: {missing[:4] or 'none at all'}")
        layers: dict[str, Any] = {name: kv_caches[name] for name in group.layer_names}
        if group.kind == "mamba":
            layers = {name: state_rows(index, t) for name, t in layers.items()}
        elif any(isinstance(t, list | tuple) for t in layers.values()):
            raise IncompatibleError(f"KV cache group {index} ({group.kind}) has a layer given as "
                                    f"a list of tensors: attention layers are one tensor each")
        out.append(layers)
    return out


def state_rows(index: int, state: Any) -> torch.Tensor:
    """A Mamba layer's state as ``[num_blocks, 1, bytes]`` rows (one state block a row, shared
    as an MLA-shaped view: the server copies whole rows). vLLM 0.32 gives one tensor per layer
    (the padded page of conv and ssm state); a list of several (conv, ssm of other widths) is
    refused: one tensor per layer is what a row view can take."""
    if isinstance(state, list | tuple):
        if len(state) != 1:
            raise IncompatibleError(
                f"KV cache group {index} (mamba) gives a layer as {len(state)} tensors (conv and "
                f"ssm state apart): lmcache stores Mamba state given as one tensor per layer")
        state = state[0]
    try:
        return state.view(state.shape[0], 1, -1)
    except RuntimeError as exc:  # a block's state is not contiguous
        raise IncompatibleError(f"KV cache group {index} (mamba): a block's state of shape "
                                f"{list(state.shape)} is not one contiguous row: {exc}") from None


def group_pieces(chunk_size: int, groups: Sequence[KVCacheGroupSpec]) -> list[GroupPiece]:
    """Each group's ``GroupPiece``; IncompatibleError naming every group's block size when the
    chunk size is no multiple of one of them, or naming the sizes of a chunked-local group whose
    attention chunk is no multiple of its block size."""
    bad = [g for g in groups if g.block_size <= 0 or chunk_size % g.block_size]
    if bad:
        sizes = ", ".join(f"group {i} ({g.kind}) {g.block_size}" for i, g in enumerate(groups))
        raise IncompatibleError(f"the lmcache chunk size {chunk_size} is not a multiple of every "
                                f"KV cache group's block size: {sizes}")
    try:
        return [group_piece(chunk_size, g.block_size, g.kind, g.window_tokens) for g in groups]
    except ValueError as exc:
        raise IncompatibleError(f"lmcache cannot store this model's KV cache groups: {exc}") \
            from None


def piece_blocks(block_ids: Sequence[int], n_chunks: int, piece: GroupPiece, *,
                 retrieve: bool, first_chunk: int = 0) -> tuple[list[int], list[int]]:
    """The chunks (positions among the op's first ``n_chunks``) a group moves and their blocks:
    for a store every chunk, for a retrieve those resuming after them needs
    (``GroupPiece.first_needed`` of the request's chunk ``first_chunk + n_chunks``, the op's
    first being its chunk ``first_chunk``): every chunk of full attention, the last
    ``window_chunks`` of a sliding window, a chunked-local group's from the one its attention
    chunk starts in (none at an attention chunk's start); each chunk's last ``piece_blocks``
    ids. A store leaves out chunks whose blocks include the null block (vLLM freed them); a
    retrieve keeps them (``load_skip`` tells which it may leave out)."""
    bpc, per_piece = piece.blocks_per_chunk, piece.piece_blocks
    first = (max(0, piece.first_needed(first_chunk + n_chunks) - first_chunk)
             if retrieve else 0)
    chunks: list[int] = []
    blocks: list[int] = []
    for chunk in range(first, n_chunks):  # one slice per chunk, not per block
        ids = block_ids[(chunk + 1) * bpc - per_piece:(chunk + 1) * bpc]
        if not retrieve and NULL_BLOCK in ids:
            continue
        chunks.append(chunk)
        blocks += ids
    return chunks, blocks


def load_skip(blocks: Sequence[int], piece: GroupPiece, end: int) -> int | None:
    """How many leading ids of a group's retrieve (``piece_blocks(..., retrieve=True)``, ending
    at the request's chunk ``end``) stay unwritten (``RetrieveRequest.skip_blocks``): the null
    blocks vLLM put where the oldest piece reaches back past the blocks resuming needs
    (``GroupPiece.needed_blocks``: a sliding window's last ``window_blocks``, a chunked-local
    group's from its attention chunk's start). None when a block resuming needs is null: that
    load cannot be made (never a partial one). Real ids are always written, needed or not: vLLM
    may cache them by their hashes."""
    need = min(len(blocks), piece.needed_blocks(end))
    spare = len(blocks) - need  # fewer than a piece's blocks (first_needed rounds down)
    skip = 0
    while skip < spare and blocks[skip] == NULL_BLOCK:
        skip += 1
    return None if NULL_BLOCK in blocks[skip:] else skip


def split_parts(parts: list[Part], skips: list[int]) -> list[tuple[Part, int]]:
    """A hybrid load's per-group parts (each with its leading blocks to skip, of its first
    chunk) cut into pieces of at most ``ceil(chunks / 3)`` of all their chunks (never fewer
    than 2 a piece), a group's in pieces that differ by one chunk at most, so that
    ``bundle_parts`` can pack them into requests the server's copy threads share evenly: a
    Gemma-3-like hit loads 8 chunks of its full-attention group and 2 of each sliding one, and
    its one request of 8 kept one copy thread busy long after the others were done. A chunk is
    in exactly one piece (whose request releases its lock); the skip stays with the first;
    all-or-nothing stays per vLLM request (each of its requests must succeed). Stores are not
    cut: a request costs ~3 ms of fixed work on a 2-core host, and 6 requests instead of 3 for
    a hybrid store of 3 groups measured no faster."""
    total = sum(len(hashes) for _, hashes, _ in parts)
    most = max(2, -(-total // 3))
    out: list[tuple[Part, int]] = []
    for (instance_id, hashes, blocks), skip in zip(parts, skips, strict=True):
        n = len(hashes)
        if n <= most:
            out.append(((instance_id, hashes, blocks), skip))
            continue
        per_chunk = len(blocks) // n
        start = 0
        for size in equal_sizes(n, -(-n // most)):
            out.append(((instance_id, hashes[start:start + size],
                         blocks[start * per_chunk:(start + size) * per_chunk]),
                        skip if start == 0 else 0))
            start += size
    return out


#: How many retrieve requests a hybrid load is sent as (``bundle_parts``): the server's default
#: copy workers (``server.workers``), so both copy at once.
RETRIEVE_REQUESTS = 2


def bundle_parts(cut: list[tuple[Part, int]], n: int = RETRIEVE_REQUESTS
                 ) -> list[list[tuple[Part, int]]]:
    """``split_parts``'s pieces packed into at most ``n`` requests of about as many chunks
    each (the largest piece first, into the request with the fewest so far): a request's first
    piece goes in its own fields, the others in ``RetrieveRequest.more``. Each request costs
    the server's loop a dispatch and a reply and a copy worker its setup: a Gemma-3-like hit
    sent as 2 requests instead of 4 took about 15 % less of the server's CPU, for the same time
    to first token (docs/benchmarks-log.md, "A hybrid load as two requests")."""
    bundles: list[list[tuple[Part, int]]] = [[] for _ in range(min(n, len(cut)))]
    sizes = [0] * len(bundles)
    for piece in sorted(cut, key=lambda p: len(p[0][1]), reverse=True):
        smallest = sizes.index(min(sizes))
        bundles[smallest].append(piece)
        sizes[smallest] += len(piece[0][1])
    return bundles


def equal_sizes(n: int, k: int) -> list[int]:
    """``n`` cut into ``k`` sizes that differ by at most one, the larger first."""
    return [n // k + (1 if i < n % k else 0) for i in range(k)]
