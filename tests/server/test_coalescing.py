"""Coalescing clients against a real server: concurrent small lookups of one group reach it as one call and each
caller gets exactly its own rows; lookups of other models' versions, labels, precisions, tables or metadata are never
merged; a merged call carries the earliest deadline and a caller whose own deadline is still ahead is answered; one
caller's bad input or cancellation leaves the others answered; threads of HPSClient coalesce while calls are in
flight."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from hps_client import AsyncHPSClient, DeadlineExceededError, HPSClient, InvalidArgumentError, NotFoundError
from hps_client.aio_coalescing import AsyncCoalescingTransport
from hps_service.serve.process import HPSServer
from tests.server.conftest import AUTH, ITEM_DIM, USER_DIM, HeldLookups, base_url, running, server_config, target

KEYS = np.arange(1, 1001, dtype=np.int64)


def rows(keys: np.ndarray, version: int = 0, dim: int = ITEM_DIM) -> np.ndarray:
    """The rows the fixture stores: key k of version v is ``k * 10 + v`` in every column."""
    return np.repeat((np.asarray(keys, dtype=np.float32) * 10 + version)[:, None], dim, axis=1)


def _lookups(srv: HPSServer) -> float:
    assert srv.metrics is not None
    return srv.metrics.requests_served("Lookup")


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HPSServer]:
    """Versions 0 (as configured), 1 and 2 of ``demo``, ``canary`` naming 1; one handler thread, so that a held
    lookup holds every other."""
    with running(server_config(tmp_path_factory.mktemp("coalesce"), workers=0, grpc_workers=1)) as s, \
            httpx.Client(base_url=base_url(s), headers=AUTH, timeout=30) as http:
        for version in (1, 2):
            assert http.post("/v1/models/demo/versions", json={"version": version}).status_code == 201
        for version in (0, 1, 2):
            for table, dim in (("item", ITEM_DIM), ("user", USER_DIM)):
                r = http.put(f"/v1/models/demo/tables/{table}/embeddings", params={"model_version": version},
                             json={"keys": KEYS.tolist(), "vectors": rows(KEYS, version, dim).tolist(), "version": 1})
                assert r.status_code == 200, r.text
        assert http.put("/v1/models/demo/labels/canary", json={"version": 1}).status_code == 200
        yield s


def test_200_concurrent_2_key_lookups_are_one_call_and_each_gets_its_own_rows(srv: HPSServer) -> None:
    async def main() -> list[np.ndarray]:
        async with AsyncHPSClient(target(srv), timeout=30) as client:
            await client.wait_ready()
            before = _lookups(srv)
            got = await asyncio.gather(*(client.lookup("demo", "item", [k, k + 500]) for k in range(1, 201)))
            assert _lookups(srv) - before <= 20
            assert _lookups(srv) - before == 1  # 400 keys: within the default budget of 1,024
            return got

    for k, answer in zip(range(1, 201), asyncio.run(main())):
        np.testing.assert_array_equal(answer, rows([k, k + 500]))


def test_callers_own_out_buffers_and_sources_come_back_theirs(srv: HPSServer) -> None:
    outs = [np.full((2, ITEM_DIM), -1, dtype=np.float32) for _ in range(20)]

    async def main() -> tuple[list[np.ndarray], list]:
        async with AsyncHPSClient(target(srv), timeout=30) as client:
            await client.wait_ready()
            before = _lookups(srv)
            got = await asyncio.gather(*(client.lookup("demo", "item", [k, 5000 + k], out=out)
                                         for k, out in zip(range(1, 21), outs)))
            sources = await asyncio.gather(*(client.lookup_with_sources("demo", "item", [k, 5000 + k])
                                             for k in range(1, 21)))
            assert _lookups(srv) - before == 2
            return got, sources

    got, sources = asyncio.run(main())
    for k, out, answer, with_sources in zip(range(1, 21), outs, got, sources):
        assert answer is out
        np.testing.assert_array_equal(out[0], rows([k])[0])
        assert out[1].tolist() == [0.0] * ITEM_DIM and with_sources.sources.tolist()[1] == 4  # 5000 + k: default
        assert with_sources.sources[0] != 4


def test_a_hedged_client_coalesces_too(srv: HPSServer) -> None:
    """Thirty lookups at once from a hedging client, the server's only handler thread held past the hedging delay:
    one merged call answers them all, hedged as a whole (its second copy served or cancelled: one or two calls)."""
    with HeldLookups(srv, "user") as held:
        async def main() -> list[np.ndarray]:
            async with AsyncHPSClient(target(srv), timeout=30,
                                      hedging={"maxAttempts": 2, "hedgingDelay": "0.1s"}) as client:
                await client.wait_ready()
                before = _lookups(srv)
                tasks = [asyncio.ensure_future(client.lookup("demo", "user", [k])) for k in range(1, 31)]
                await asyncio.sleep(0.5)
                held.release()
                got = await asyncio.gather(*tasks)
                assert _lookups(srv) - before <= 2
                return got

        for k, answer in zip(range(1, 31), asyncio.run(main())):
            np.testing.assert_array_equal(answer, rows([k], 0, USER_DIM))


def test_the_key_budget_splits_a_burst(srv: HPSServer) -> None:
    async def main() -> float:
        async with AsyncHPSClient(target(srv), timeout=30, coalesce_max_keys=64) as client:
            await client.wait_ready()
            before = _lookups(srv)
            got = await asyncio.gather(*(client.lookup("demo", "item", [k, k + 1]) for k in range(1, 161)))
            for k, answer in zip(range(1, 161), got):
                np.testing.assert_array_equal(answer, rows([k, k + 1]))
            return _lookups(srv) - before

    assert asyncio.run(main()) == 5  # 320 keys, 64 a call


def test_other_groups_are_never_merged(srv: HPSServer) -> None:
    """Ten callers of each of seven groups at once: seven calls, each caller answered from its own group."""

    async def main() -> float:
        async with AsyncHPSClient(target(srv), timeout=30) as client:
            await client.wait_ready()
            before = _lookups(srv)
            keys = [np.array([k, 2 * k]) for k in range(1, 11)]
            asks = {
                "configured": [client.lookup("demo", "item", k) for k in keys],
                "v2": [client.lookup("demo", "item", k, version=2) for k in keys],
                "canary": [client.lookup("demo", "item", k, label="canary") for k in keys],
                "stored": [client.lookup_stored("demo", "item", k) for k in keys],
                "user": [client.lookup("demo", "user", k) for k in keys],
                "both": [client.lookup_many("demo", {"item": k, "user": k[::-1]}) for k in keys],
                "metadata": [client.lookup("demo", "item", k, metadata=[("x-caller", "b")]) for k in keys],
            }
            got = dict(zip(asks, await asyncio.gather(*(asyncio.gather(*a) for a in asks.values()))))
            for k, configured, v2, canary, stored, user, both, meta in zip(keys, *got.values()):
                np.testing.assert_array_equal(configured, rows(k))
                np.testing.assert_array_equal(v2, rows(k, 2))
                np.testing.assert_array_equal(canary, rows(k, 1))
                np.testing.assert_array_equal(stored.rows.to_float32(), rows(k))
                np.testing.assert_array_equal(user, rows(k, 0, USER_DIM))
                np.testing.assert_array_equal(both["item"].vectors, rows(k))
                np.testing.assert_array_equal(both["user"].vectors, rows(k[::-1], 0, USER_DIM))
                np.testing.assert_array_equal(meta, rows(k))
            return _lookups(srv) - before

    assert asyncio.run(main()) == 7


def test_pooled_lookups_go_out_alone_and_each_gets_its_bags(srv: HPSServer) -> None:
    """A pooled lookup answers a row per bag: it never joins a batch of plain lookups (nor of other pooled ones)."""
    from hps_client import Bags

    assert srv.metrics is not None
    metrics = srv.metrics

    async def main() -> tuple[list[np.ndarray], list[dict], tuple[float, float]]:
        async with AsyncHPSClient(target(srv), timeout=30) as client:
            await client.wait_ready()
            before = _lookups(srv), metrics.requests_served("LookupBags")
            plain = [client.lookup("demo", "item", [k, 2 * k]) for k in range(1, 11)]
            pooled = [client.lookup_bags_many("demo", {"item": Bags(np.array([k, 2 * k, 3 * k]), [0, 2], "sum")})
                      for k in range(1, 11)]
            got = await asyncio.gather(*plain, *pooled)
            return got[:10], got[10:], (_lookups(srv) - before[0], metrics.requests_served("LookupBags") - before[1])

    plain, pooled, calls = asyncio.run(main())
    assert calls == (1, 10)  # the plain ones as one call, each pooled one alone
    for k, rows_of_keys, bags in zip(range(1, 11), plain, pooled):
        np.testing.assert_array_equal(rows_of_keys, rows([k, 2 * k]))
        np.testing.assert_array_equal(bags["item"].vectors, rows([3 * k, 3 * k]))  # (10k + 20k) and 30k


def test_one_callers_bad_input_fails_only_that_caller(srv: HPSServer) -> None:
    async def main() -> None:
        async with AsyncHPSClient(target(srv), timeout=30) as client:
            await client.wait_ready()
            before = _lookups(srv)
            got = await asyncio.gather(
                client.lookup("demo", "item", [1, 2]), client.lookup("demo", "item", [1.5]),
                client.lookup("demo", "item", [[3]]), client.lookup("demo", "nope", [3]),
                client.lookup("demo", "item", [4, 5]), return_exceptions=True)
            assert isinstance(got[1], InvalidArgumentError) and isinstance(got[2], InvalidArgumentError)
            assert isinstance(got[3], NotFoundError) and "nope" in str(got[3])
            np.testing.assert_array_equal(got[0], rows([1, 2]))
            np.testing.assert_array_equal(got[4], rows([4, 5]))
            assert _lookups(srv) - before == 1  # the good ones merged; the missing table alone (not counted as OK)

    asyncio.run(main())


def test_a_merged_call_has_the_earliest_deadline_and_a_later_caller_is_answered(srv: HPSServer) -> None:
    """Held on the server, the merged call runs out at the short caller's deadline; the other caller, whose own
    deadline is ahead, gets its lookup sent again alone and answered."""
    with HeldLookups(srv, "user") as held:
        async def main() -> None:
            async with AsyncHPSClient(target(srv), timeout=30) as client:
                await client.wait_ready()
                short = asyncio.ensure_future(client.lookup("demo", "user", [1, 2], timeout=0.5))
                patient = asyncio.ensure_future(client.lookup("demo", "user", [3, 4]))
                with pytest.raises(DeadlineExceededError):
                    await short
                assert not patient.done()
                held.wait_entered()
                assert not held._entered.acquire(timeout=0.2), "the two lookups went out as two calls"
                held.release()
                np.testing.assert_array_equal(await patient, rows([3, 4], 0, USER_DIM))

        asyncio.run(main())


def test_a_cancelled_caller_leaves_the_others_answered(srv: HPSServer) -> None:
    """Callers cancelled after their merged call went out (its leader among them), and before (a batch waiting for
    the call in flight, its leader among them): the others get their rows."""
    with HeldLookups(srv, "user") as held:
        async def main() -> None:
            async with AsyncHPSClient(target(srv), timeout=30, coalesce_window_s=30) as client:
                await client.wait_ready()
                before = _lookups(srv)
                first = [asyncio.ensure_future(client.lookup("demo", "user", [k, k + 1])) for k in range(1, 6)]
                await asyncio.sleep(0.2)
                held.wait_entered()  # the five went out as one call, held on the server's only thread
                second = [asyncio.ensure_future(client.lookup("demo", "user", [k, k + 1])) for k in range(6, 11)]
                await asyncio.sleep(0.01)  # the five wait for the call in flight, to go out as one
                for task in (first[0], first[3], second[0], second[2]):
                    task.cancel()
                held.release()
                got = await asyncio.gather(*first, *second, return_exceptions=True)
                for i, (k, answer) in enumerate(zip(range(1, 11), got)):
                    if i in (0, 3, 5, 7):
                        assert isinstance(answer, asyncio.CancelledError), (k, answer)
                    else:
                        np.testing.assert_array_equal(answer, rows([k, k + 1], 0, USER_DIM))
                assert _lookups(srv) - before == 2

        asyncio.run(main())


def test_a_leader_cancelled_before_the_call_hands_it_to_the_others(srv: HPSServer) -> None:
    async def main() -> None:
        async with AsyncHPSClient(target(srv), timeout=30) as client:
            await client.wait_ready()
            tasks = [asyncio.ensure_future(client.lookup("demo", "item", [k])) for k in range(1, 5)]
            await asyncio.sleep(0)  # each has joined; the leader yields once before sending
            tasks[0].cancel()
            got = await asyncio.gather(*tasks, return_exceptions=True)
            assert isinstance(got[0], asyncio.CancelledError)
            for k, answer in zip(range(2, 5), got[1:]):
                np.testing.assert_array_equal(answer, rows([k]))

    asyncio.run(main())


def test_threads_coalesce_while_a_call_is_in_flight(srv: HPSServer) -> None:
    """HPSClient with a window: a first lookup goes out at once and is held; thirty threads that look up meanwhile
    wait for it, then go out as one call."""
    results: dict[int, np.ndarray] = {}
    with HPSClient(target(srv), timeout=30, coalesce_window_s=30.0) as client, HeldLookups(srv, "item") as held:
        client.wait_ready()
        before = _lookups(srv)
        first = threading.Thread(target=lambda: results.__setitem__(0, client.lookup("demo", "item", [7])))
        first.start()
        held.wait_entered()

        def ask(k: int) -> None:
            results[k] = client.lookup("demo", "item", [k, k + 100])

        threads = [threading.Thread(target=ask, args=(k,)) for k in range(1, 31)]
        for t in threads:
            t.start()
        while sum(len(b.members) for b in client.transport._pending.values()) < 30:
            threading.Event().wait(0.01)
        held.release()
        for t in [first, *threads]:
            t.join(30)
        assert _lookups(srv) - before == 2
    np.testing.assert_array_equal(results[0], rows([7]))
    for k in range(1, 31):
        np.testing.assert_array_equal(results[k], rows([k, k + 100]))


def test_a_zero_window_turns_it_off(srv: HPSServer) -> None:
    off = AsyncHPSClient(target(srv), coalesce_window_s=0)
    on = AsyncHPSClient(target(srv))
    assert not isinstance(off.transport, AsyncCoalescingTransport)
    assert isinstance(on.transport, AsyncCoalescingTransport) and on.transport.window_s == 200e-6
    with pytest.raises(ValueError, match="coalesce_window_s"):
        AsyncHPSClient(target(srv), coalesce_window_s=-1)

    async def close() -> None:
        await off.close()
        await on.close()

    asyncio.run(close())
