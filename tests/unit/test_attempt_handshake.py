"""The attempt handshake (``_rendezvous.attempt_prefix``) on a real store.

Ranks are threads, each with a client of its own of one ``TCPStore``, as
the workers of successive torchrun attempts share the agent's store. What
a dead attempt left there (its nonces, rosters, acknowledgements) must
never complete a new attempt's handshake.
"""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist
from _launch import free_port

from tiacc_training.errors import CommTimeoutError
from tiacc_training.torch.distributed._rendezvous import ATTEMPTS, attempt_prefix


@pytest.fixture()
def server() -> dist.TCPStore:
    timeout = datetime.timedelta(seconds=30)
    return dist.TCPStore(
        "127.0.0.1", free_port(), is_master=True, timeout=timeout, wait_for_workers=False
    )


def _client(server: dist.TCPStore) -> dist.TCPStore:
    timeout = datetime.timedelta(seconds=30)
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout)


def _attempt(
    server: dist.TCPStore,
    world: int,
    timeout: float = 10.0,
    delays: dict[int, float] | None = None,
    absent: tuple[int, ...] = (),
) -> list[object]:
    """Runs the handshake on ``world`` thread ranks; each result or exception."""
    results: list[object] = [None] * world

    def rank(r: int) -> None:
        time.sleep((delays or {}).get(r, 0.0))
        try:
            results[r] = attempt_prefix(_client(server), r, world, timeout)
        except Exception as err:  # noqa: BLE001 - the test reads it
            results[r] = err

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world) if r not in absent]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_every_rank_agrees_on_a_new_prefix_each_attempt(server: dist.TCPStore) -> None:
    first = _attempt(server, 3)
    assert len(set(first)) == 1 and str(first[0]).startswith(f"{ATTEMPTS}/"), first
    second = _attempt(server, 3)
    assert len(set(second)) == 1 and second[0] != first[0], (first, second)


def test_a_dead_attempts_leftovers_do_not_complete_a_new_one(server: dist.TCPStore) -> None:
    """A dead attempt's rank 0 left a roster, a 'latest' and a go naming
    ranks 1 and 2's old nonces; the new ranks 1 and 2 start before the new
    rank 0, rank 2 late: they wait for a roster with their own nonces."""
    old = _attempt(server, 3)
    store = _client(server)
    # Ranks of the dead attempt that got as far as saying hello again.
    store.set(f"{ATTEMPTS}/hello/1", "dead-attempt")
    new = _attempt(server, 3, delays={0: 0.5, 2: 1.0})
    assert all(isinstance(p, str) for p in new), new
    assert len(set(new)) == 1 and new[0] != old[0], (old, new)


def test_a_rank_that_never_arrives_is_named_within_the_timeout(server: dist.TCPStore) -> None:
    _attempt(server, 3)  # rank 2's hello from an earlier attempt stays in the store
    began = time.monotonic()
    results = _attempt(server, 3, timeout=1.5, absent=(2,))
    took = time.monotonic() - began
    assert isinstance(results[0], CommTimeoutError), results
    assert "rank 2 did not start this attempt's rendezvous" in str(results[0]), results[0]
    # Rank 1 was on rank 0's roster: it fails with rank 0's message.
    assert isinstance(results[1], CommTimeoutError), results
    assert "rank 2" in str(results[1]), results[1]
    assert took < 10, took


def test_a_rank_without_its_rank_0_names_rank_0(server: dist.TCPStore) -> None:
    results = _attempt(server, 2, timeout=1.0, absent=(0,))
    assert isinstance(results[1], CommTimeoutError), results
    assert "rank 0 did not confirm this rank's arrival" in str(results[1]), results[1]
