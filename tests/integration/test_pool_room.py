"""A store of a new piece size takes only the room it needs (issue 22's fleet case): one real
server, engines of two models and two TP sizes as real worker processes."""

from __future__ import annotations

from tests.integration.chunks import CHUNK, tokens
from tests.integration.cross_tp import HEADS, load_and_check, lookup, server_info, store
from tests.integration.servers import ServerProcess, WorkerProcess


def test_a_new_piece_size_leaves_the_other_models_chunks_in_place(tmp_path):
    """Pool 128 MiB. Model X at TP=2 and model Y each store 5 chunks of 64 KiB pieces; then X
    at TP=1 stores 5 chunks of 128 KiB pieces. With the pool one 128 MiB slab of the 64 KiB
    class, that store evicted the slab whole: every chunk of Y (and of X) went, and Y's retrieve
    reported its 20 blocks as load errors. Now the new size takes one 2 MiB unit of its own."""
    srv = ServerProcess(tmp_path, {"server": {"pool_size": "128MiB"}}).start()
    workers: list[WorkerProcess] = []
    try:
        x_tp2 = [WorkerProcess(srv.url, rank=r, world_size=2, model="x", heads=HEADS // 2)
                 for r in range(2)]  # 2 layers x K/V x 64 tokens x 4 heads x 32 x fp16: 64 KiB
        y = [WorkerProcess(srv.url, model="y", heads=4)]  # 64 KiB pieces
        x_tp1 = [WorkerProcess(srv.url, model="x", heads=HEADS)]  # 128 KiB pieces
        workers = [*x_tp2, *y, *x_tp1]
        toks_x, toks_y, toks_x1 = tokens(5, 71), tokens(5, 72), tokens(5, 73)
        store(x_tp2, toks_x, 71, 5)
        store(y, toks_y, 72, 5)
        store(x_tp1, toks_x1, 73, 5)
        assert server_info(srv.url).stats  # the server answers; nothing below was evicted
        assert lookup(srv.url, 1, "y", toks_y, model="y") == 5 * CHUNK
        load_and_check(y, "y", toks_y, 72, 5)  # every chunk of Y, byte-exact
        assert lookup(srv.url, 2, "x2", toks_x, model="x") == 5 * CHUNK
        assert lookup(srv.url, 1, "x1", toks_x1, model="x") == 5 * CHUNK
        load_and_check(x_tp1, "x1", toks_x1, 73, 5)
    finally:
        for worker in workers:
            worker.close()
        srv.kill()
