"""A hybrid model's KV-cache groups as the worker adapter registers and moves them.

vLLM's hybrid KV cache manager splits a model's layers into groups (``kv_cache_config.
kv_cache_groups``), each with its own spec (full attention, sliding window, chunked-local attention,
Mamba state) and block size, and gives block ids as one list per group. The adapter registers each
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
request.

Part of :mod:`.vllm_multi_process_adapter`, which re-exports ``KVCacheGroupSpec``.
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
