"""What ``hvd.init()`` found, read back: ranks, sizes, the job's layout; and the build.

:data:`job` is written by ``init()`` and ``shutdown()`` (:mod:`._init`);
the getters here only read it, so every other module can import this one
(it imports no other module of the package).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = [
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "gloo_built",
    "gloo_enabled",
    "is_homogeneous",
    "is_initialized",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "rocm_built",
    "size",
]

NOT_INITIALIZED = "Horovod has not been initialized: call hvd.init() first"


@dataclass
class _Job:
    """What ``init()`` found out; one per process."""

    lock: threading.RLock = field(default_factory=threading.RLock)
    initialized: bool = False
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    homogeneous: bool = True
    # Every rank's (host, local rank, local size), in rank order.
    layout: list[tuple[str, int, int]] = field(default_factory=list)
    # How many times init() has started Horovod in this process (each
    # start is a new world: optimizers plan their buckets afresh).
    worlds: int = 0


job = _Job()


def is_initialized() -> bool:
    """Whether ``hvd.init()`` has run (and ``hvd.shutdown()`` has not since)."""
    return job.initialized


def check_initialized() -> None:
    """Raises Horovod's error when ``hvd.init()`` has not run.

    Raises:
        ValueError: ``hvd.init()`` has not been called.
    """
    if not job.initialized:
        raise ValueError(NOT_INITIALIZED)


def size() -> int:
    """The number of processes in the job."""
    check_initialized()
    return job.size


def rank() -> int:
    """This process's rank in the job (0 to ``size() - 1``)."""
    check_initialized()
    return job.rank


def local_size() -> int:
    """The number of processes on this host."""
    check_initialized()
    return job.local_size


def local_rank() -> int:
    """This process's rank among the processes of its host."""
    check_initialized()
    return job.local_rank


def cross_size() -> int:
    """The number of hosts that run a process of this local rank."""
    check_initialized()
    return job.cross_size


def cross_rank() -> int:
    """This process's rank among the processes of its local rank (its host's index)."""
    check_initialized()
    return job.cross_rank


def is_homogeneous() -> bool:
    """Whether every host runs the same number of processes."""
    check_initialized()
    return job.homogeneous


def mpi_threads_supported() -> bool:
    """False: no MPI library is used (``mpirun`` only starts the processes)."""
    check_initialized()
    return False


def mpi_enabled() -> bool:
    """False: collectives never go through MPI here, whatever started the job."""
    return False


def mpi_built() -> bool:
    """False: this package is not linked against an MPI library."""
    return False


def gloo_enabled() -> bool:
    """Whether gloo takes part once initialised.

    True when torch has gloo: the "tiacc" backend forwards the operations
    the engine does not run (uneven all-to-all, ``send``/``recv``, ...) to
    gloo, and ``TIACC_TRAINING_COLLECTIVES=gloo`` hands it all CPU
    collectives.
    """
    return job.initialized and dist.is_gloo_available()


def gloo_built() -> bool:
    """Whether this torch has the gloo backend (which ``gloo_enabled`` uses)."""
    return dist.is_available() and dist.is_gloo_available()


def nccl_built() -> bool:
    """Whether CUDA tensors can use NCCL: this torch has NCCL and a CUDA device is present."""
    return dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()


def ddl_built() -> bool:
    """False: IBM's DDL is not supported."""
    return False


def ccl_built() -> bool:
    """False: Intel's oneCCL is not supported."""
    return False


def cuda_built() -> bool:
    """Whether this torch is built with CUDA (CUDA tensors are then supported)."""
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """Whether this torch is built with ROCm (HIP): its tensors go the CUDA way."""
    return getattr(torch.version, "hip", None) is not None
