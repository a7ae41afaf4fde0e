"""Horovod's collectives, one module per family, gathered under one roof.

Each operation runs on its process set's group: CPU tensors on the "tiacc"
backend (the engine over shared memory or TCP; what it does not run goes to
gloo underneath), CUDA tensors on the group's CUDA backend. Where each
part lives:

* :mod:`._common`: the reductions (``Average``, ``Sum``, ...), the dtypes
  the ranks exchange, the argument checks every family shares;
* :mod:`._handles`: operations in flight, their handles, :func:`synchronize`
  and :func:`poll`, the duplicate-name rule, the timeline's marks;
* :mod:`._negotiation`: the header exchange every operation starts with,
  so that a mismatch raises the same error on every rank and the job stays
  in step: the headers in :mod:`._headers`, the verdicts in
  :mod:`._verdicts`, the queues and cycles (and the zeros a rank reduces
  in an allreduce others issued) in :mod:`._cycles`;
* :mod:`._reduce`: an allreduce's data path, its fused buffers reduced and
  scaled (under both :mod:`._allreduce` and those zeros);
* :mod:`._allreduce`, :mod:`._allgather` (with the sparse allreduce and
  ``allgather_object``), :mod:`._broadcast` (with ``broadcast_object``),
  :mod:`._alltoall`, :mod:`._reducescatter`: the families of operations
  and their autograd functions;
* :mod:`._join`: ``barrier`` and ``join``.

Gradients flow through ``allreduce``, ``allgather``, ``broadcast``,
``alltoall``, ``reducescatter`` and the grouped forms of allreduce,
allgather and reducescatter, with Horovod's conventions (allgather's
gradient averaged over the ranks, reducescatter's gathered and scaled by
the size for ``Sum``); not through the in-place or asynchronous forms.
A collective that fails because a peer left or timed out raises
:class:`~._exceptions.HorovodInternalError`, its cause the engine's
``CommError``.
"""

from __future__ import annotations

from . import _cycles, _handles
from ._allgather import (
    allgather,
    allgather_async,
    allgather_object,
    grouped_allgather,
    grouped_allgather_async,
    sparse_allreduce_async,
)
from ._allreduce import (
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
)
from ._alltoall import alltoall, alltoall_async
from ._broadcast import broadcast, broadcast_, broadcast_async, broadcast_async_, broadcast_object
from ._common import Adasum, Average, Max, Min, Product, Sum
from ._handles import poll, synchronize
from ._join import barrier, join
from ._reducescatter import (
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
)

__all__ = [
    "Adasum",
    "Average",
    "Max",
    "Min",
    "Product",
    "Sum",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "join",
    "poll",
    "reducescatter",
    "reducescatter_async",
    "sparse_allreduce_async",
    "synchronize",
]


def forget_handles() -> None:
    """``shutdown()``: drops the handles, the names in flight and the headers agreed on."""
    _handles.forget()
    _cycles.forget()
