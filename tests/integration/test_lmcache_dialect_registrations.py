"""LMCache 0.5.6's registrations on a real in-process server, from raw DEALER frames: the dialect's
own record of them follows the server's registry (an instance it dropped is mapped again by the
client's heartbeat re-register, and is not kept), and a failing re-map answers in-band."""

from __future__ import annotations

from typing import Any

from tests.integration.dialect import call, dealer, enc, key


def register(instance_id: int, descs: list[Any], world_size: int = 1) -> list[bytes]:
    return [enc(1), enc(instance_id), enc(descs), enc("tiny"), enc(world_size), enc("vllm"),
            enc({}), enc([])]


def store(instance_id: int, request_id: str, worker_id: int = 0) -> list[bytes]:
    return [enc(6), enc(key(request_id, worker_id=worker_id)), enc(instance_id),
            enc([list(range(8))]), enc(b"")]


def test_a_heartbeat_re_register_maps_an_instance_the_registry_dropped(kv_server
                                                                        ) -> None:
    srv, _, descs = kv_server
    sock = dealer(srv.url)
    try:
        assert call(sock, [enc(1), *register(7, descs)]) == [enc(1), enc(1)]
        assert call(sock, [enc(2), *store(7, "s")]) == [enc(2), enc(6), enc([b"", True])]
        assert srv.registry.unregister(7)  # as a reap does: the registry alone drops it
        # LMCache's heartbeat: the same tensors again. Acked, and mapped again for real (it was
        # only touched, which the registry refused: the next store failed).
        assert call(sock, [enc(3), *register(7, descs)]) == [enc(3), enc(1)]
        assert len(srv.registry) == 1
        assert call(sock, [enc(4), *store(7, "t")]) == [enc(4), enc(6), enc([b"", True])]
        # While the registry has it, a heartbeat is only a touch: not mapped again.
        with srv.registry.lease(7) as before:
            pass
        assert call(sock, [enc(5), *register(7, descs)]) == [enc(5), enc(1)]
        with srv.registry.lease(7) as after:
            pass
        assert after is before
    finally:
        sock.close(0)


def test_instances_the_registry_dropped_are_not_kept(kv_server) -> None:
    srv, _, descs = kv_server
    registrations = srv.lmcache.registrations
    sock = dealer(srv.url)
    try:
        assert call(sock, [enc(1), *register(7, descs)]) == [enc(1), enc(1)]
        assert srv.registry.unregister(7)  # reaped: LMCache's instance 7 never comes back
        assert 7 in registrations
        assert call(sock, [enc(2), *register(8, descs)]) == [enc(2), enc(1)]
        assert 7 not in registrations and 8 in registrations and len(registrations) == 1
        # Found out on use too: a store for a dropped instance fails in-band and forgets it.
        assert srv.registry.unregister(8)
        assert call(sock, [enc(3), *store(8, "s")]) == [enc(3), enc(6), enc([b"", False])]
        assert len(registrations) == 0
    finally:
        sock.close(0)


def test_a_failing_re_map_for_another_rank_answers_in_band(kv_server, monkeypatch) -> None:
    from lmcache_core.errors import IncompatibleError

    srv, _, descs = kv_server
    sock = dealer(srv.url)

    def refused(*_args: Any, **_kwargs: Any) -> None:
        raise IncompatibleError("this rank's KV cache cannot be mapped")

    try:
        assert call(sock, [enc(1), *register(7, descs, world_size=2)]) == [enc(1), enc(1)]
        monkeypatch.setattr(srv.handlers, "register_kv_cache", refused)
        # Rank 1's first store maps the instance again under rank 1, which fails: answered
        # (b"", False) at once, as the store and retrieve document, not with silence.
        assert call(sock, [enc(2), *store(7, "s", worker_id=1)], timeout_ms=3000) == \
            [enc(2), enc(6), enc([b"", False])]
        retrieve = [enc(7), enc(key("r", worker_id=1)), enc(7), enc([list(range(8))]), enc(b""),
                    enc(0)]
        assert call(sock, [enc(3), *retrieve], timeout_ms=3000) == \
            [enc(3), enc(7), enc([b"", False])]
    finally:
        sock.close(0)
