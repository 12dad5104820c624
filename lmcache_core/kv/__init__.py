"""KV-cache sharing (POSIX shared memory, CUDA IPC) and block <-> chunk copies.

Modules, one job each (nothing here is imported by this ``__init__``, so importing a torch-free
module such as :mod:`lmcache_core.kv.layout` does not pull in torch):

- :mod:`~lmcache_core.kv.tensors`: dtype names on the wire, strided-memory arithmetic.
- :mod:`~lmcache_core.kv.layout`: vLLM per-layer KV layouts and the canonical chunk order.
- :mod:`~lmcache_core.kv.shm`: :class:`SharedSegment`, a ``/dev/shm`` file mapped with ``mmap``.
- :mod:`~lmcache_core.kv.copy`: :class:`BlockCopier`, gather/scatter of blocks into chunk slots.
- :mod:`~lmcache_core.kv.cuda_ipc`: export/open CUDA IPC handles of tensor storages.
- :mod:`~lmcache_core.kv.share`: worker side, allocate and describe shareable KV caches.
- :mod:`~lmcache_core.kv.mapped`: server side, :class:`MappedKVCache` over a worker's descriptors.
- :mod:`~lmcache_core.kv.cuda_events`: interprocess CUDA events and the server's copy stream.
"""
