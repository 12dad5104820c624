"""The clients of ``lmcache serve`` that an engine runs: one in its scheduler, one in each worker.

- :mod:`.connection`: what both hold: the ZMQ client of one server, the model's identity, the
  server's chunk size and the block arithmetic, the default timeouts;
- :mod:`.scheduler`: ``LMCacheMPSchedulerAdapter``, one prefix lookup per request, polled without
  blocking; :mod:`.lookups`: the record it keeps of each request's lookup, and its state table;
- :mod:`.worker`: ``LMCacheMPWorkerAdapter``, which shares the worker's KV caches with the server
  once, then batches stores and retrieves and reports which requests finished;
- :mod:`.transfers`: what a store or retrieve carries (``LoadStoreOp``) and the worker's stores
  and retrieves in flight, with the reading of their outcome;
- :mod:`.groups`: a hybrid model's KV-cache groups, as the worker registers and moves them.

Nothing here imports vLLM, and nothing imports torch when imported (only registering tensors
does): the vLLM connector (:mod:`lmcache_core.integration.vllm`) and ``lmcache store-bench`` are
built on these clients. Their names and signatures are those of LMCache's
``vllm_multi_process_adapter`` (the API contract), which
:mod:`lmcache_core.integration.vllm.vllm_multi_process_adapter` re-exports under LMCache's path.
"""
