"""The slow-rank check (``TIACC_TRAINING_PERF_CHECK_N_STEPS``).

Every N steps, just before a step's first bucket, each rank takes its
engine's compute and communication times of those N steps and writes them
to the store (one small key); rank 0 reads every rank's and logs each rank
that the engine finds clearly slower than the median (the rule and its
thresholds: ``tiacc_core::comm::progress::slow_ranks``). Nothing is
exchanged while the check is off.
"""

from __future__ import annotations

import datetime
import json
import socket
from typing import Any

import torch

from tiacc_training import _engine

from ._rendezvous import default_store
from ._state import logger

# The slow-rank check of the current group (``None`` while it is off).
_check: PerfCheck | None = None


def active() -> PerfCheck | None:
    """The slow-rank check of the current group (``None`` while it is off)."""
    return _check


def start(config: Any, rank: int, world: int) -> None:
    """Turns the check on for a new group, or off (the group's settings say which)."""
    global _check
    _check = None
    if config.enabled and config.perf_check_n_steps > 0 and world > 1:
        _check = PerfCheck(config.perf_check_n_steps, rank, world, config.timeout)


class PerfCheck:
    """One process's slow-rank check.

    Args:
        every: steps between two checks.
        rank: this rank.
        world: the number of ranks.
        timeout: seconds rank 0 waits for the others' times.
    """

    def __init__(self, every: int, rank: int, world: int, timeout: float) -> None:
        self.every = every
        self.rank = rank
        self.world = world
        self.timeout = timeout
        self.begun = 0
        self.host = socket.gethostname()

    def before_step(self, engine: Any, device: torch.device) -> None:
        """Called before a step's first bucket is submitted to ``engine``."""
        if self.begun > 0 and self.begun % self.every == 0:
            self._exchange(engine, device, self.begun // self.every)
        self.begun += 1

    def _exchange(self, engine: Any, device: torch.device, round_: int) -> None:
        steps, compute, comm = engine.step_times()
        gpu = None
        if device.type == "cuda":
            gpu = f"{device} ({torch.cuda.get_device_name(device)})"
        store = default_store()
        prefix = f"tiacc_training/perf/{round_}"
        mine = json.dumps([self.rank, self.host, gpu, steps, compute, comm])
        store.set(f"{prefix}/{self.rank}", mine)
        if self.rank != 0:
            return
        keys = [f"{prefix}/{r}" for r in range(self.world)]
        try:
            store.wait(keys, datetime.timedelta(seconds=self.timeout))
            samples = [tuple(json.loads(store.get(k).decode())) for k in keys]
            for key in keys:
                store.delete_key(key)
        except Exception as exc:  # a rank that is gone fails elsewhere, loudly
            logger.warning("slow-rank check %d skipped: %s", round_, exc)
            return
        for line in _engine.slow_ranks(samples):
            logger.warning("slow rank: %s", line)
