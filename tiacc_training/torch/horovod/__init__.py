"""Horovod's PyTorch API on the tiacc engine.

A Horovod script moves over by changing one import line::

    import tiacc_training.torch.horovod as hvd

CPU tensors go through the engine's collectives (shared memory or TCP),
CUDA tensors through the group's CUDA backend (NCCL); ``DistributedOptimizer`` hands its fused
gradient buckets to the same engine as the DDP hook, with its settings
(``TIACC_TRAINING_*``, ``LIGHT_*``) and algorithms.
"""

from __future__ import annotations

# -- init and shutdown (_init.py); what init() found and the build (_basics.py);
#    collectives (_ops.py gathering the collectives' modules: every name in its
#    __all__) and process sets (_process_sets.py) --
from ._basics import (  # noqa: F401
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    size,
)
from ._exceptions import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401
from ._init import init, shutdown  # noqa: F401
from ._ops import *  # noqa: F403
from ._process_sets import ProcessSet, global_process_set, remove_process_set  # noqa: F401
from ._set_changes import add_process_set  # noqa: F401

# -- training: DistributedOptimizer and friends (_optimizer.py, _broadcast_state.py,
#    _compression.py, _sync_batch_norm.py) --
# isort: split
from ._broadcast_state import broadcast_optimizer_state, broadcast_parameters  # noqa: F401
from ._compression import Compression  # noqa: F401
from ._optimizer import DistributedOptimizer  # noqa: F401
from ._sync_batch_norm import SyncBatchNorm  # noqa: F401

# -- timeline (_timeline.py) --
# isort: split
from ._timeline import start_timeline, stop_timeline  # noqa: F401

# -- elastic training: hvd.elastic (elastic.py, over the driver's rounds in _rounds.py) --
# isort: split
from . import elastic  # noqa: F401
