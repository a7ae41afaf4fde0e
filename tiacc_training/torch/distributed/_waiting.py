"""How long each step waited for communication, and the bytes each link carried.

**The exposed communication** of a DDP step: from the moment DDP hands its
last gradient bucket to the comm hook (backward has computed every
gradient) until the last bucket's reduced result is there (what DDP, and so
``loss.backward()``, waits for before the optimizer can step). Whatever
communication the backward pass hid costs nothing here; the rest is the
step's wait. The DDP hook (the engine's, and a timing hook on torch's own
allreduce when the engine is switched off) calls :meth:`StepClock.handed`
for each bucket and chains :meth:`StepClock.done` to its future.

For CUDA buckets the times are the host's: when the result's future
completed, not when the GPU finished with it.

**The links**: the bytes each network interface of this host sent and
received (``/proc/net/dev``, every process of the host together) from the
first measured step on, per measured step.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

_lock = threading.Lock()
NET_DEV = "/proc/net/dev"


@dataclass
class Waits:
    """The process's steps and what they waited (``stats()["waiting"]``)."""

    steps: int = 0
    total_s: float = 0.0
    last_s: float = 0.0
    max_s: float = 0.0
    # The interfaces' byte counters when the first measured step began.
    links_at_start: dict[str, int] = field(default_factory=dict)
    started: bool = False

    def add(self, waited: float) -> None:
        self.steps += 1
        self.total_s += waited
        self.last_s = waited
        self.max_s = max(self.max_s, waited)


waits = Waits()


def link_counters(path: str = NET_DEV) -> dict[str, int]:
    """Bytes received plus sent so far per network interface of this host.

    Empty where the file cannot be read (not Linux).
    """
    counters: dict[str, int] = {}
    try:
        with open(path, encoding="ascii") as f:
            lines = f.read().splitlines()[2:]
    except OSError:
        return counters
    for line in lines:
        name, _, values = line.partition(":")
        fields = values.split()
        if len(fields) >= 9:
            counters[name.strip()] = int(fields[0]) + int(fields[8])
    return counters


class StepClock:
    """The buckets of one DDP model's current step, timed."""

    def __init__(self) -> None:
        self.pending = 0
        self.last_handed: float | None = None
        self.latest_done = 0.0

    def handed(self, last: bool) -> None:
        """A bucket went to the hook (``last``: DDP's last bucket of the step)."""
        with _lock:
            if not waits.started:
                waits.started = True
                waits.links_at_start = link_counters()
            self.pending += 1
            if last:
                self.last_handed = time.perf_counter()

    def done(self, future: torch.futures.Future) -> Any:
        """A bucket's result is there; the step is counted with its last one.

        Chained to the bucket's future (``future.then(clock.done)``): returns
        the value DDP gets.
        """
        now = time.perf_counter()
        with _lock:
            self.pending -= 1
            self.latest_done = max(self.latest_done, now)
            if self.pending == 0 and self.last_handed is not None:
                waits.add(max(0.0, self.latest_done - self.last_handed))
                self.last_handed = None
                self.latest_done = 0.0
        return future.value()


def timed(clock: StepClock, last: bool, future: torch.futures.Future) -> torch.futures.Future:
    """``future`` with ``clock`` told when it was handed over and when it completes."""
    clock.handed(last)
    return future.then(clock.done)


def report() -> dict[str, Any]:
    """``stats()["waiting"]``: the measured steps, their waits, the links' bytes per step."""
    with _lock:
        steps = waits.steps
        result: dict[str, Any] = {
            "steps": steps,
            "exposed_ms_per_step": round(waits.total_s / steps * 1000, 3) if steps else None,
            "last_step_ms": round(waits.last_s * 1000, 3) if steps else None,
            "max_step_ms": round(waits.max_s * 1000, 3) if steps else None,
            "link_bytes_per_step": {},
        }
        start = dict(waits.links_at_start)
    if steps and start:
        now = link_counters()
        result["link_bytes_per_step"] = {
            name: round((now[name] - start[name]) / steps)
            for name in sorted(now)
            if name in start and now[name] > start[name]
        }
    return result


def describe() -> str:
    """The summary's words for :func:`report`, or ``""`` before any measured step."""
    measured = report()
    if not measured["steps"]:
        return ""
    links = ", ".join(
        f"{name} {value / 1e6:.2f} MB" for name, value in measured["link_bytes_per_step"].items()
    )
    return (
        f"waited for communication after backward: {measured['exposed_ms_per_step']:.1f} ms "
        f"a step (mean of {measured['steps']}; last {measured['last_step_ms']:.1f} ms, "
        f"most {measured['max_step_ms']:.1f} ms); this host's links a step: {links or 'nothing'}"
    )


def reset() -> None:
    """Forgets every measured step (tests)."""
    global waits
    with _lock:
        waits = Waits()
