"""From the launcher's environment to torch's default process group.

torchrun, Open MPI's mpirun and SLURM are recognised by the engine
(``_engine.launch_env``); a plain ``python train.py`` is a world of one.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from tiacc_training import _engine
from tiacc_training.errors import CommError, ConfigError

from ._nccl import local_gpus_shared, nccl_version

DEFAULT_MASTER_PORT = 29500

# The store of the last world of one that named no port (see _own_port):
# kept until the next one, so that torch's store of the group joins its
# server instead of binding the port again.
_held_store: Any = None


def launch_env() -> dict[str, Any]:
    """How this process was launched (a world of one without a launcher)."""
    launch = _engine.launch_env()
    if launch is not None:
        return dict(launch)
    return {
        "launcher": "none",
        "rank": 0,
        "world_size": 1,
        "local_rank": 0,
        "local_size": 1,
        "master_addr": None,
        "master_port": None,
    }


def default_backend(config: Any, launch: dict[str, Any]) -> str:
    """The backends of the default group.

    gloo for CPU tensors (DDP of a CPU model needs it even where CUDA is
    present), and for CUDA tensors NCCL, unless ranks share GPUs that this
    NCCL cannot share (then gloo, which moves CUDA tensors through the host).
    """
    if not torch.cuda.is_available():
        return "gloo"
    if local_gpus_shared(launch):
        try:
            allowed = config.nccl_allows_shared_gpu(nccl_version(config.nccl_library))
        except CommError:
            allowed = False
        if not allowed:
            return "cpu:gloo,cuda:gloo"
    return "cpu:gloo,cuda:nccl"


def group_arguments(
    backend: str | None, config: Any, launch: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """How to create the default group from the launcher's environment.

    Sets the usual variables (``RANK``, ``MASTER_ADDR``, ...) where the
    launcher left them unset, so code that reads them finds them. A world
    of one without ``MASTER_PORT`` gets a store bound here on a port the
    kernel picks (:func:`_own_port`), which the group's store then shares.

    Returns:
        ``launch`` with the rendezvous address and port filled in, and the
        keyword arguments of ``init_process_group``.

    Raises:
        ConfigError: the job spans nodes and ``MASTER_ADDR`` is not set.
    """
    addr = launch["master_addr"]
    if addr is None:
        local_size = launch["local_size"]
        if launch["world_size"] == 1 or local_size == launch["world_size"]:
            addr = "127.0.0.1"
        else:
            raise ConfigError(
                f"MASTER_ADDR is not set and the {launch['launcher']} job spans several "
                "nodes: set it to rank 0's host (with mpirun: -x MASTER_ADDR=<host>)"
            )
    port = launch["master_port"]
    timeout = datetime.timedelta(seconds=max(config.timeout, 60.0))
    if port is None:
        port = _own_port(addr, timeout) if launch["world_size"] == 1 else DEFAULT_MASTER_PORT
    launch = {**launch, "master_addr": addr, "master_port": port}
    # Launchers other than torchrun leave these unset; code that reads them
    # after init (user scripts, libraries) then finds the usual names.
    os.environ.setdefault("RANK", str(launch["rank"]))
    os.environ.setdefault("WORLD_SIZE", str(launch["world_size"]))
    os.environ.setdefault("LOCAL_RANK", str(launch["local_rank"]))
    if launch["local_size"] is not None:
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(launch["local_size"]))
    os.environ.setdefault("MASTER_ADDR", addr)
    os.environ.setdefault("MASTER_PORT", str(port))

    host = f"[{addr}]" if ":" in addr else addr
    arguments = {
        "backend": backend or default_backend(config, launch),
        "init_method": f"tcp://{host}:{port}",
        "rank": launch["rank"],
        "world_size": launch["world_size"],
        "timeout": timeout,
    }
    return launch, arguments


def _own_port(addr: str, timeout: datetime.timedelta) -> int:
    """The port of a store bound here on port 0, for a world of one.

    The store is multi-tenant and kept (``_held_store``) until the next
    call: torch's ``tcp://`` rendezvous opens its own store multi-tenant
    too, so in this process it finds this one's server on the port and
    shares it instead of binding the port again. The port is bound from the
    kernel's pick on, so no other process can take it between a pick and a
    bind, as it could a port probed and released.

    Args:
        addr: the rendezvous address (``MASTER_ADDR``, or 127.0.0.1).
        timeout: the group's timeout, for the store's own requests.
    """
    global _held_store
    _held_store = dist.TCPStore(
        addr, 0, 1, True, timeout=timeout, wait_for_workers=False, multi_tenant=True
    )
    return int(_held_store.port)
