"""The rounds of an elastic job: what tiaccrun's driver and the workers say through its store.

An elastic job (``tiaccrun --host-discovery-script ...``) runs in rounds.
Each round is one fixed world: the driver picks its workers (host by host,
up to ``--max-np`` slots), publishes every member's launch variables
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, Horovod's ``HOROVOD_*``, ...)
under ``round.<n>`` and then moves ``round`` to ``n``. A worker is named by
its host and slot (``HOROVOD_HOSTNAME``, ``HOROVOD_LOCAL_RANK`` when it was
started). ``hvd.init()`` in a worker:

- waits for a round newer than the last one it was in, asking the driver
  for one (``request.<n>``) when a collective failed and nothing changed
  that the driver saw;
- in a round that names it: counts itself in (``round.<n>.arrived``) and,
  once every member is in, takes its variables and forms the group on the
  driver's store under the round's prefix (a round's keys are its own, and
  the store outlives any worker);
- in a round that leaves it out, after having been in an earlier one: its
  host was removed; the worker is not needed any more.

Every key lives under :data:`PREFIX`. This module is the protocol's one
place: the driver (``tiacc_training.tools._elastic``) and ``hvd.init()``
both use it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ELASTIC",
    "Membership",
    "RoundTimeout",
    "WORKER_HOST",
    "WORKER_SLOT",
    "join",
    "latest_round",
    "members",
    "publish",
    "requested",
]

# Set to "1" in every worker of an elastic job (Horovod's name).
ELASTIC = "HOROVOD_ELASTIC"
# The driver's store (Horovod's names for its rendezvous server).
STORE_ADDR = "HOROVOD_GLOO_RENDEZVOUS_ADDR"
STORE_PORT = "HOROVOD_GLOO_RENDEZVOUS_PORT"
# How long a worker waits for its next round (Horovod's name, seconds).
TIMEOUT = "HOROVOD_ELASTIC_TIMEOUT"
# The worker's host and slot, as the driver started it.
WORKER_HOST = "HOROVOD_HOSTNAME"
WORKER_SLOT = "HOROVOD_LOCAL_RANK"

PREFIX = "tiacc_training/elastic/"
_POLL = 0.05


class RoundTimeout(RuntimeError):
    """No round that names this worker came within the elastic timeout."""


@dataclass
class Membership:
    """A worker's place in the job: who it is, and the last round it was in."""

    store: Any
    key: str
    round: int = -1
    timeout: float = 600.0

    @classmethod
    def from_env(cls, connect: Any) -> Membership | None:
        """This worker's membership when the process runs in an elastic job.

        Args:
            connect: ``connect(host, port, timeout)`` returning a store client.

        Returns:
            ``None`` outside an elastic job.

        Raises:
            ValueError: a variable of the elastic job is missing or malformed
                (named).
        """
        if os.environ.get(ELASTIC) != "1":
            return None
        values = {}
        for name in (STORE_ADDR, STORE_PORT, WORKER_HOST, WORKER_SLOT):
            value = os.environ.get(name, "").strip()
            if not value:
                raise ValueError(f"{ELASTIC}=1 but {name} is not set (start the job with tiaccrun)")
            values[name] = value
        timeout_text = os.environ.get(TIMEOUT, "600").strip() or "600"
        try:
            port = int(values[STORE_PORT])
            timeout = float(timeout_text)
        except ValueError:
            raise ValueError(
                f"{STORE_PORT}={values[STORE_PORT]!r} / {TIMEOUT}={timeout_text!r}: "
                "expected a port and seconds"
            ) from None
        key = f"{values[WORKER_HOST]}:{values[WORKER_SLOT]}"
        return cls(connect(values[STORE_ADDR], port, timeout), key, -1, timeout)


# -- the driver's side -----------------------------------------------------------


def publish(store: Any, number: int, envs: dict[str, dict[str, str]]) -> None:
    """Publishes round ``number``: each member's variables, then the round itself."""
    store.set(f"{PREFIX}round.{number}", json.dumps(envs))
    store.set(f"{PREFIX}round", str(number))


def requested(store: Any, number: int) -> bool:
    """Whether a worker of round ``number`` asked for a new round."""
    key = f"{PREFIX}request.{number}"
    return bool(store.check([key])) and int(store.add(key, 0)) > 0


# -- both sides ------------------------------------------------------------------


def latest_round(store: Any) -> int:
    """The newest round the driver published (-1 before the first)."""
    key = f"{PREFIX}round"
    if not store.check([key]):
        return -1
    return int(store.get(key))


def members(store: Any, number: int) -> dict[str, dict[str, str]]:
    """Round ``number``'s members and their variables, by worker key."""
    return json.loads(store.get(f"{PREFIX}round.{number}"))


# -- the worker's side -----------------------------------------------------------


def join(membership: Membership) -> tuple[int, dict[str, str]] | None:
    """Waits for this worker's next round and counts it in.

    Returns:
        ``(round, variables)`` once every member of a round that names this
        worker is in, or ``None`` when a newer round leaves out a worker
        that was in an earlier one (its host was removed).

    Raises:
        RoundTimeout: no such round within the membership's timeout; the
            message names the worker and the last round it saw.
    """
    store, key = membership.store, membership.key
    deadline = time.monotonic() + membership.timeout
    asked = False
    seen = -1
    while True:
        latest = latest_round(store)
        seen = max(seen, latest)
        if latest > membership.round:
            envs = members(store, latest)
            if key in envs:
                if _all_in(membership, latest, len(envs), deadline):
                    membership.round = latest
                    return latest, envs[key]
                continue  # a newer round came while its members gathered
            if membership.round >= 0:
                return None
        elif not asked and membership.round >= 0:
            # A collective failed and the driver has published nothing new:
            # ask for a round (it also sees the exit of a worker that died).
            store.add(f"{PREFIX}request.{membership.round}", 1)
            asked = True
        if time.monotonic() > deadline:
            raise RoundTimeout(
                f"elastic worker {key}: no round naming it came within the elastic timeout "
                f"of {membership.timeout:g} s (last round it was in: {membership.round}, "
                f"newest published: {seen})"
            )
        time.sleep(_POLL)


def _all_in(membership: Membership, number: int, size: int, deadline: float) -> bool:
    """Counts this worker into round ``number``; True once all ``size`` are in.

    False when a newer round is published first (then the caller joins
    that one instead).

    Raises:
        RoundTimeout: the round's members did not all come in time.
    """
    store = membership.store
    key = f"{PREFIX}round.{number}.arrived"
    arrived = int(store.add(key, 1))
    while arrived < size:
        if latest_round(store) > number:
            return False
        if time.monotonic() > deadline:
            raise RoundTimeout(
                f"elastic worker {membership.key}: only {arrived} of the {size} members of "
                f"round {number} came within the elastic timeout of {membership.timeout:g} s"
            )
        time.sleep(_POLL)
        arrived = int(store.add(key, 0))
    return True
