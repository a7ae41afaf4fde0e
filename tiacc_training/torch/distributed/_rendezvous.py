"""Everything ranks exchange through the default group's c10d store.

TCP addresses and the job token, NCCL unique ids, where every rank runs
(for the one-GPU-per-rank check), and the job's failure board; the 2D node
layout is agreed by the engines' constructors (the core's rendezvous).
DDP construction is collective, so every rank reaches these exchanges in
the same order; ``prefix`` keeps successive ones apart.
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import socket
import time
from typing import Any

import torch.distributed as dist

from tiacc_training import _engine
from tiacc_training.errors import CommTimeoutError


def default_store() -> Any:
    """The default process group's store."""
    return dist.distributed_c10d._get_default_store()


def exchange(
    store: Any, prefix: str, rank: int, world: int, value: str, timeout: float
) -> list[str]:
    """Every rank's ``value``, in rank order.

    Args:
        store: a c10d store shared by the ranks.
        prefix: key prefix of this exchange.
        rank: this rank.
        world: number of ranks.
        value: what this rank publishes.
        timeout: seconds to wait for the others.

    Returns:
        The values of ranks ``0 .. world - 1``.
    """
    store.set(f"{prefix}/{rank}", value)
    keys = [f"{prefix}/{r}" for r in range(world)]
    wait_for(store, keys, list(range(world)), timeout, rank, prefix)
    return [store.get(k).decode() for k in keys]


def wait_for(
    store: Any, keys: list[str], owners: list[int], timeout: float, rank: int, what: str
) -> None:
    """Waits for ``keys`` (``owners[i]`` publishes ``keys[i]``), naming who never did.

    A rank that died or stopped during start-up never publishes its key:
    the store's own timeout says only that a key is missing, so this one
    names the ranks (the engine's rule, ``tiacc_core::comm::store``, which
    the engines' own exchanges follow too).

    Raises:
        CommTimeoutError: a key is still missing after ``timeout`` seconds;
            the message names its ranks, this rank and the exchange.
    """
    _engine.wait_for(store, keys, owners, timeout, rank, what)


def _has(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:  # the store itself is gone: treat as missing
        return False


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


# Where every attempt of a job under torchrun agrees on keys of its own.
ATTEMPTS = "tiacc_training/attempts"
# Seconds between polls of the store while the attempt handshake waits.
_POLL = (0.005, 0.1)
# Seconds the other ranks wait beyond the timeout, so that rank 0's verdict
# (which rank never came) reaches them before their own.
_GRACE = 2.0


def elastic_agent_store() -> tuple[str, int] | None:
    """The torchelastic agent's store that ``env://`` would join, if any.

    torchrun's agent keeps one store for every attempt (restart) of its
    workers, and on some torch releases the workers' keys carry nothing
    of the attempt: a new attempt then reads what a dead one left (peers'
    addresses, ids). ``None`` where the workers' store is not the agent's.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    return host, int(port)


def attempt_prefix(store: Any, rank: int, world: int, timeout: float) -> str:
    """A key prefix that only this attempt's ranks use, agreed through ``store``.

    Every rank publishes a fresh random nonce. Rank 0 takes a new
    generation number (an atomic counter that never repeats), publishes the
    nonces it read as that generation's roster, and waits until every rank
    has acknowledged a roster holding its own nonce; a roster that held a
    dead attempt's nonce is replaced by a newer one. Rank 0 then says go.
    Nothing an earlier attempt left (stale nonces, rosters or
    acknowledgements) can complete this handshake, and the restart counts
    of the launcher's agents need not agree (they differ after membership
    changes).

    Args:
        store: the store shared by every attempt (the agent's).
        rank: this rank.
        world: the number of ranks.
        timeout: seconds every rank has to arrive.

    Returns:
        ``tiacc_training/attempts/<generation>``.

    Raises:
        CommTimeoutError: a rank did not arrive within ``timeout``; rank 0
            names it, and the others fail with rank 0's message (or, where
            rank 0 never saw them, their own, ``_GRACE`` seconds later).
    """
    nonce = secrets.token_hex(8)
    store.set(f"{ATTEMPTS}/hello/{rank}", nonce)
    deadline = time.monotonic() + timeout
    if rank == 0:
        return _lead_attempt(store, world, timeout, deadline)
    return _join_attempt(store, rank, nonce, timeout, deadline + _GRACE)


def _lead_attempt(store: Any, world: int, timeout: float, deadline: float) -> str:
    hellos = [f"{ATTEMPTS}/hello/{r}" for r in range(world)]
    wait_for(store, hellos, list(range(world)), timeout, 0, "attempt handshake")
    while True:
        nonces = _values(store, hellos)
        generation = int(store.add(f"{ATTEMPTS}/generation", 1))
        prefix = f"{ATTEMPTS}/{generation}"
        store.set(f"{ATTEMPTS}/roster/{generation}", json.dumps({"nonces": nonces}))
        store.set(f"{ATTEMPTS}/latest", str(generation))
        acks = [f"{prefix}/ack/{r}" for r in range(1, world)]
        pause = _POLL[0]
        while not store.check(acks):
            if time.monotonic() > deadline:
                missing = [r for r, k in enumerate(acks, start=1) if not _has(store, k)]
                message = (
                    f"rank 0: {_ranks(missing)} did not start this attempt's rendezvous "
                    f"within {timeout:g} s (stopped, killed or still starting; see their own "
                    "output)"
                )
                failure = json.dumps({"nonces": nonces, "failed": message})
                store.set(f"{ATTEMPTS}/roster/{generation}", failure)
                raise CommTimeoutError(message)
            if _values(store, hellos) != nonces:
                break  # a rank of this attempt replaced a dead attempt's nonce
            time.sleep(pause)
            pause = min(pause * 2, _POLL[1])
        else:
            store.set(f"{prefix}/go", "1")
            return prefix


def _join_attempt(store: Any, rank: int, nonce: str, timeout: float, deadline: float) -> str:
    latest, acked = f"{ATTEMPTS}/latest", None
    pause = _POLL[0]
    while time.monotonic() <= deadline:
        generation = store.get(latest).decode() if _has(store, latest) else None
        if generation is not None:
            roster = json.loads(store.get(f"{ATTEMPTS}/roster/{generation}"))
            mine = roster["nonces"][rank] == nonce if len(roster["nonces"]) > rank else False
            if mine and "failed" in roster:
                raise CommTimeoutError(f"rank {rank}: {roster['failed']}")
            prefix = f"{ATTEMPTS}/{generation}"
            if mine and acked != generation:
                store.set(f"{prefix}/ack/{rank}", "1")
                acked = generation
            if mine and _has(store, f"{prefix}/go"):
                return prefix
        time.sleep(pause)
        pause = min(pause * 2, _POLL[1])
    raise CommTimeoutError(
        f"rank {rank}: rank 0 did not confirm this rank's arrival at the attempt's "
        f"rendezvous within {timeout:g} s (rank 0 stopped, killed or still starting; see "
        "its own output)"
    )


def _values(store: Any, keys: list[str]) -> list[str]:
    multi_get = getattr(store, "multi_get", None)
    values = multi_get(keys) if multi_get is not None else [store.get(k) for k in keys]
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values]


def check_same_config(config: Any, store: Any, prefix: str, rank: int, world: int) -> None:
    """Raises ``ConfigError`` on every rank when ranks run with different settings.

    Every rank publishes the settings all ranks must share
    (``CommConfig.shared_fingerprint``) and compares them with the others'.

    Args:
        config: this rank's effective configuration.
        store: the c10d store shared by the ranks.
        prefix: key prefix of this check.
        rank: this rank.
        world: number of ranks.

    Raises:
        ConfigError: a setting differs; names the variable, the values and
            which ranks have which.
    """
    mine = config.shared_fingerprint()
    fingerprints = exchange(store, prefix, rank, world, mine, config.timeout)
    _engine.check_same_config(rank, fingerprints)


# Seconds the failure board waits to learn whether the store can be reached:
# the board is used on the way to an error, which must come within the
# collective timeout plus a few seconds even when the store is out of reach
# (a link that went down). A store operation itself cannot be bounded (the
# client waits for its reply as long as TCP keeps the connection, and some
# operations hold the GIL meanwhile), so the board first checks that the
# store's port answers a new connection within this time.
BOARD_TIMEOUT = 2.0


def board_store(store: Any) -> tuple[Any, tuple[str, int] | None]:
    """A client of the job's store of its own, and the store's address.

    The board's operations then never queue behind the default store's;
    where the store is not a ``TCPStore`` (a test's ``HashStore``), the
    store itself and no address.
    """
    base = store
    while hasattr(base, "underlying_store"):
        base = base.underlying_store
    host, port = getattr(base, "host", None), getattr(base, "port", None)
    if host is None or port is None:
        return store, None
    try:
        client = dist.TCPStore(
            host,
            port,
            is_master=False,
            timeout=datetime.timedelta(seconds=BOARD_TIMEOUT),
            wait_for_workers=False,
        )
    except Exception:  # cannot open another connection: share the default one
        client = store
    return client, (host, int(port))


class FailureBoard:
    """The job's first failure and every rank's progress record, in the store.

    The engine publishes a failure before peers can notice it, and reads the
    board while a collective waits unusually long, so every rank names the
    root cause (the rank that saw a NaN, or died) rather than its symptom.
    Each rank's engine also keeps its position (bucket and step) here, at a
    low rate, so a timeout can say which ranks had not reached the bucket.

    Reads and publishing first check that the store answers (see
    ``BOARD_TIMEOUT``); once that or an operation fails (the store is gone
    with rank 0, or out of reach) the board answers ``None`` at once from
    then on, so a failing rank is never held up by it for long.

    Args:
        store: the store (``board_store``'s client).
        prefix: the engine's key prefix.
        address: the store's ``(host, port)``, to check it answers; ``None``
            skips the check (an in-process store).
    """

    def __init__(self, store: Any, prefix: str, address: tuple[str, int] | None = None) -> None:
        self.store = store
        self.key = f"{prefix}/first_failure"
        self.progress_prefix = f"{prefix}/progress"
        self.address = address
        self.unreachable = False

    def publish(self, message: str) -> str | None:
        """Publishes ``message`` unless a failure is there; returns the first."""
        return self._compare_set(message) if self._answers() else None

    def peek(self) -> str | None:
        """The first failure published, or ``None``."""
        return (self._compare_set("") or None) if self._answers() else None

    def record(self, rank: int, text: str) -> None:
        """Keeps ``text`` as rank ``rank``'s progress record."""
        self._guarded(lambda: self.store.set(f"{self.progress_prefix}/{rank}", text))

    def records(self, size: int) -> list[str | None]:
        """The progress record of every rank (``None`` where absent), without waiting."""

        def read(rank: int) -> str | None:
            key = f"{self.progress_prefix}/{rank}"
            return self.store.get(key).decode() if self.store.check([key]) else None

        if not self._answers():
            return [None] * size
        return [self._guarded(lambda r=rank: read(r)) for rank in range(size)]

    def _answers(self) -> bool:
        """Whether the store's port takes a connection within ``BOARD_TIMEOUT``."""
        if self.unreachable or self.address is None:
            return not self.unreachable
        try:
            socket.create_connection(self.address, timeout=BOARD_TIMEOUT).close()
        except OSError:
            self.unreachable = True
        return not self.unreachable

    def _compare_set(self, desired: str) -> str | None:
        first = self._guarded(lambda: self.store.compare_set(self.key, "", desired))
        if first is None:
            return None
        return first.decode(errors="replace") if isinstance(first, bytes) else str(first)

    def _guarded(self, operation: Any) -> Any:
        if self.unreachable:
            return None
        try:
            return operation()
        except Exception:  # the store may be gone with rank 0, or out of reach
            self.unreachable = True
            return None
