"""A rank's loop over the cases of one launch, shared by the matrix workers.

The GPU suite starts its ranks once per world size and runs many cases in
them (``--cases FILE``, a JSON list of ``{"id", "env", ...}``):
``tests/gpu/_nccl_worker.py`` (DDP training) and
``tests/distributed/device_engine_worker.py`` (the device engine against the
host engine). Both loop here:

* each case's variables replace the previous case's, and everything it
  prints starts with ``CASE <id> ``;
* a case that raises prints ``CASE <id> FAILED <type>: <first line>`` (its
  traceback goes to stderr), and the ranks then agree through the default
  group's store that every one of them is done with the case before the
  next begins. A failed case so costs only itself: the cases after it run
  and report on their own. A rank that does not reach the agreement within
  ``timeout`` (stuck in a collective its peers left) ends the run.

A worker keeps its collectives in step with its peers' inside a case (a
rank that finds a wrong result records it and raises at the end of the
case, see :class:`Findings`), so that a failed check does not leave the
peers waiting.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

import torch.distributed as dist

from tiacc_training.torch.distributed._rendezvous import default_store, exchange
from tiacc_training.torch.distributed._state import state

# Settings of the algorithm variants the matrices share: the GPU suite's
# (tests/gpu/test_nccl_algorithms.py), its CPU stand-in
# (tests/distributed/test_device_engine.py) and the loop's own test
# (tests/distributed/test_worker_cases.py). Flat is forced where auto would
# time flat against 2D on each engine of its own and could pick either.
FLAT = {"TIACC_TRAINING_ALGORITHM": "flat"}
# Top-K 5% on every bucket (no size threshold), flat.
TOP_K = {
    **FLAT,
    "LIGHT_TOPK_ALLREDUCE": "1",
    "LIGHT_TOPK_RATIO": "0.05",
    "LIGHT_TOPK_THRESHOLD": "0",
}
# Top-K with the momentum correction, a 2-step warm-up and clipping.
TOP_K_DGC = {
    **TOP_K,
    "TIACC_TRAINING_TOPK_MOMENTUM": "0.9",
    "TIACC_TRAINING_TOPK_WARMUP_STEPS": "2",
    "TIACC_TRAINING_TOPK_CLIP_NORM": "20",
}


class Findings:
    """What one case's checks found wrong, raised together at its end.

    ``expect`` records instead of raising, so a rank whose result is wrong
    still issues the case's remaining collectives with its peers.
    """

    def __init__(self) -> None:
        self.problems: list[str] = []

    def expect(self, ok: bool, message: object) -> None:
        """Records ``message`` unless ``ok``."""
        if not ok:
            self.problems.append(str(message))

    def call(self, check: Callable[[], object]) -> None:
        """Runs ``check`` and records the ``AssertionError`` it raises, if any."""
        try:
            check()
        except AssertionError as exc:
            self.problems.append((str(exc).strip().splitlines() or [""])[0])

    def raise_any(self) -> None:
        """Raises ``AssertionError`` naming the first problem and how many there were."""
        if self.problems:
            more = f" (and {len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
            raise AssertionError(self.problems[0] + more)


def run_cases(cases: list[dict], run_one: Callable[[dict], None], timeout: float) -> list[str]:
    """Runs every case in turn (see the module docstring).

    Args:
        cases: the cases, each with ``"id"`` and ``"env"`` (variables to set).
        run_one: runs one case; it prints its own ``CASE <id> DONE ...`` line.
        timeout: seconds a rank waits at the end of a case for the others.

    Returns:
        The ids of the cases that failed on some rank, in order.

    Raises:
        RuntimeError: a rank did not finish a case within ``timeout``;
            names the case and the ranks that had.
    """
    # The launch's variables: a worker may start its default group in its
    # first case.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    previous: dict[str, str] = {}
    failed: list[str] = []
    for index, case in enumerate(cases):
        for name in previous:
            os.environ.pop(name, None)
        os.environ.update(case["env"])
        previous = case["env"]
        prefix = f"CASE {case['id']} "
        outcome = "ok"
        try:
            run_one(case)
        except Exception as exc:
            traceback.print_exc()
            sys.stderr.flush()
            line = (str(exc).strip().splitlines() or [""])[0]
            print(f"{prefix}FAILED {type(exc).__name__}: {line}", flush=True)
            outcome = "failed"
        key = f"tests/cases/{index}"
        if not dist.is_initialized():
            raise RuntimeError(f"case {case['id']}: no default group to agree through")
        store = default_store()
        try:
            answers = exchange(store, key, rank, world, f"{outcome} {state.generation}", timeout)
        except Exception as exc:
            done = [r for r in range(world) if store.check([f"{key}/{r}"])]
            raise RuntimeError(
                f"case {case['id']}: only ranks {done} of {world} finished it "
                f"within {timeout:.0f} s ({type(exc).__name__})"
            ) from exc
        # The counter the engines' rendezvous keys are named by goes on from
        # the highest rank's: a rank that failed early built fewer engines.
        state.generation = max(int(a.split()[1]) for a in answers)
        bad = [r for r, a in enumerate(answers) if a.split()[0] != "ok"]
        if bad:
            print(f"{prefix}FAILED_ON ranks {bad}", flush=True)
            failed.append(case["id"])
    for name in previous:
        os.environ.pop(name, None)
    return failed
