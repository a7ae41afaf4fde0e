"""Horovod's PyTorch API on the tiacc engine.

A Horovod script moves over by changing one import line::

    import tiacc_training.torch.horovod as hvd

CPU tensors go through the engine's collectives (shared memory or TCP),
CUDA tensors through NCCL; ``DistributedOptimizer`` hands its fused
gradient buckets to the same engine as the DDP hook, with its settings
(``TIACC_TRAINING_*``, ``LIGHT_*``) and algorithms.
"""

from __future__ import annotations

# -- basics, collectives and process sets (_basics.py, _ops.py, _process_sets.py) --
# -- training: DistributedOptimizer and friends (_optimizer.py, _compression.py,
#    _sync_batch_norm.py) --
# -- timeline (_timeline.py) --
from ._timeline import start_timeline, stop_timeline  # noqa: F401
