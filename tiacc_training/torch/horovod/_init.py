"""``hvd.init()`` and ``hvd.shutdown()``: the job found, its group made and ended.

``init()`` finds the job from its launcher's environment (our ``tiaccrun``,
torchrun, Open MPI's, MPICH's or a PMIx ``mpirun``, SLURM, horovodrun-style
``HOROVOD_*`` variables, or nothing: a world of one), sets up the engine as
``tdist.init_tiacc_training()`` does (its settings: ``TIACC_TRAINING_*``,
``LIGHT_*``, ``HOROVOD_FUSION_THRESHOLD``, ``HOROVOD_CYCLE_TIME``), and
creates torch's default process group from the launcher, CPU tensors on
the "tiacc" backend and, where CUDA is available, CUDA tensors on NCCL. A
default group the script created itself is used as it is. What it found
(ranks, sizes, the layout) goes into :data:`._basics.job`, which the
getters read.

The local and cross layout (``local_rank``, ``cross_rank``, ...) comes from
the launcher where it says (``HOROVOD_LOCAL_RANK``, ``LOCAL_RANK``, ...),
otherwise from the host names the ranks exchange at ``init()``.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from tiacc_training import _engine
from tiacc_training.torch import distributed as tdist
from tiacc_training.torch.distributed import _runtime
from tiacc_training.torch.distributed._engines import job_launch

from . import _ops, _process_sets, _rounds, _set_changes, _timeline
from ._basics import job

__all__ = ["elastic_membership", "export_launcher_env", "init", "shutdown"]


@dataclass
class _Groups:
    """The groups ``init()`` made in this process, and the elastic job's rounds."""

    # Whether init() created the default group (then shutdown() destroys it).
    created_group: bool = False
    # Default groups init() made in this process (keeps their keys apart).
    groups_made: int = 0
    # The store of the first default group init() made, kept after shutdown()
    # so that init() again rendezvouses on it instead of opening a new port.
    store: Any = None
    # In an elastic job (tiaccrun --host-discovery-script): this worker's
    # place in the rounds; looked up at the first init().
    elastic: _rounds.Membership | None = None
    elastic_checked: bool = False


_groups = _Groups()


def _env_int(name: str) -> int | None:
    """An integer environment variable, ``None`` when unset or empty.

    Raises:
        ValueError: it is set to something that is not a non-negative integer.
    """
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None
    if number < 0:
        raise ValueError(f"{name}={value!r} is negative")
    return number


# Launchers whose variables are also written as torchrun's (see
# export_launcher_env); the engine recognises every launcher itself.
_EXPORTED = ("horovodrun", "mpich", "pmix")


def export_launcher_env() -> str | None:
    """Writes torchrun's variables for horovodrun, MPICH and PMIx jobs.

    The engine recognises every launcher (``_engine.launch_env()``: torchrun,
    Open MPI, SLURM, horovodrun, MPICH's Hydra, PMIx; the one place that
    knows their variables). For horovodrun, Hydra and PMIx, this writes
    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (when
    known) and horovodrun's rendezvous as ``MASTER_ADDR`` and
    ``MASTER_PORT`` (when unset), so the group forms as under torchrun.

    Returns:
        The launcher whose variables were exported, or ``None``.

    Raises:
        ConfigError: a launcher variable is not a rank below the size, or a
            rank is set without its size (naming both).
    """
    launch = _engine.launch_env()
    if launch is None or launch["launcher"] not in _EXPORTED:
        return None
    os.environ["RANK"] = str(launch["rank"])
    os.environ["WORLD_SIZE"] = str(launch["world_size"])
    os.environ.setdefault("LOCAL_RANK", str(launch["local_rank"]))
    if launch["local_size"] is not None:
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(launch["local_size"]))
    if launch["master_addr"]:
        os.environ.setdefault("MASTER_ADDR", launch["master_addr"])
    if launch["master_port"]:
        os.environ.setdefault("MASTER_PORT", str(launch["master_port"]))
    return launch["launcher"]


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Starts Horovod on this process: the job's group and the engine.

    Every rank calls it once at the start. A second call while initialised
    does nothing; after :func:`shutdown` it starts again.

    Args:
        comm: Horovod takes an MPI communicator or a list of ranks here. We
            have no MPI; ``None`` or the list of every rank (the whole job)
            is accepted, anything else raises ``ValueError``.
        process_sets: process sets to register at once (a list of
            :class:`ProcessSet`), or ``"dynamic"`` (accepted; sets can be
            added and removed at any time here). Every rank passes the same.

    Raises:
        ValueError: ``comm`` is a subset of the ranks or an MPI
            communicator, or a launcher variable is invalid.
        ConfigError: an engine setting is invalid or differs across ranks.
    """
    with job.lock:
        if job.initialized:
            return
        round_launch = _join_round() if not dist.is_initialized() else None
        export_launcher_env()
        tdist.init_tiacc_training()
        created = False
        if not dist.is_initialized():
            _create_group(round_launch)
            created = True
        world = dist.get_world_size()
        if comm is not None and not _is_whole_world(comm, world):
            raise ValueError(
                f"hvd.init(comm={comm!r}): only the whole job is supported (comm=None or "
                f"the list of all {world} ranks); use process sets for subsets"
            )
        job.rank, job.size = dist.get_rank(), world
        _groups.created_group = created
        _find_layout(job_launch())
        job.initialized = True
        job.worlds += 1
        _process_sets.reset_global(list(range(world)))
    if process_sets is not None and process_sets != "dynamic":
        for process_set in process_sets:
            _set_changes.add_process_set(process_set)
    _timeline.start_from_env()


def elastic_membership() -> _rounds.Membership | None:
    """This worker's membership in an elastic job's rounds, or ``None`` outside one."""
    if not _groups.elastic_checked:
        _groups.elastic = _rounds.Membership.from_env(_connect)
        _groups.elastic_checked = True
    return _groups.elastic


def _connect(host: str, port: int, timeout: float) -> Any:
    """A client of the elastic driver's store."""
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))


def _join_round() -> tuple[Any, dict[str, Any]] | None:
    """In an elastic job: waits for this worker's next round and takes its variables.

    Returns:
        The round's store (the driver's, under the round's prefix) and the
        launch it describes; ``None`` outside an elastic job.

    Raises:
        SystemExit: (code 0) the driver left this worker out of the new
            round: its host was removed from the job.
    """
    membership = elastic_membership()
    if membership is None:
        return None
    joined = _rounds.join(membership)
    if joined is None:
        print(
            f"tiacc_training: elastic worker {membership.key} is not in the job's new round "
            "(its host was removed); this worker ends",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(0)
    number, env = joined
    os.environ.update(env)
    store = dist.PrefixStore(f"{_rounds.PREFIX}round.{number}/", membership.store)
    return store, _engine.launch_env()


def _create_group(round_launch: tuple[Any, dict[str, Any]] | None = None) -> None:
    """The default group from the launcher, made where ``tdist`` makes it on first use.

    After a :func:`shutdown` the group rendezvouses on the store of the
    first group, which :func:`shutdown` kept (under a prefix of its own for
    each group): binding ``MASTER_PORT`` again could fail while the
    previous server socket lingers, and a nearby port could be taken.

    Args:
        round_launch: in an elastic job, the round's store and launch.
    """
    if round_launch is not None:
        _runtime.create_group(round_launch[0], launch=round_launch[1])
        return
    store = None
    if _groups.store is not None:
        store = dist.PrefixStore(
            f"tiacc_training/horovod/init.{_groups.groups_made}", _groups.store
        )
    _runtime.create_group(store)
    if _groups.store is None:
        _groups.store = dist.distributed_c10d._get_default_store()
    _groups.groups_made += 1


def _is_whole_world(comm: Any, world: int) -> bool:
    if isinstance(comm, (list, tuple)):
        return sorted(int(r) for r in comm) == list(range(world))
    return False


def _find_layout(launch: dict[str, Any]) -> None:
    """Local and cross rank and size: from the launcher, or by host names."""
    local_rank_env = _env_int("HOROVOD_LOCAL_RANK")
    local_size_env = _env_int("HOROVOD_LOCAL_SIZE")
    if local_rank_env is None:
        local_rank_env = launch.get("local_rank")
        local_size_env = launch.get("local_size")
    host = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
    mine = (host, -1 if local_rank_env is None else int(local_rank_env), local_size_env or -1)
    layout: list[Any] = [None] * job.size
    if job.size > 1:
        dist.all_gather_object(layout, mine)
    else:
        layout = [mine]
    hosts = [entry[0] for entry in layout]
    if any(entry[1] < 0 or entry[2] < 0 for entry in layout):
        # The launcher did not say: ranks on one host, in rank order.
        layout = [(h, hosts[:r].count(h), hosts.count(h)) for r, h in enumerate(hosts)]
    job.layout = [tuple(entry) for entry in layout]
    job.local_rank, job.local_size = layout[job.rank][1], layout[job.rank][2]
    peers = [r for r, entry in enumerate(layout) if entry[1] == job.local_rank]
    job.cross_rank, job.cross_size = peers.index(job.rank), len(peers)
    if os.environ.get("HOROVOD_CROSS_RANK") and os.environ.get("HOROVOD_CROSS_SIZE"):
        job.cross_rank = _env_int("HOROVOD_CROSS_RANK") or 0
        job.cross_size = _env_int("HOROVOD_CROSS_SIZE") or 1
    job.homogeneous = len({entry[2] for entry in layout}) == 1


def shutdown() -> None:
    """Stops Horovod: the timeline, the process sets, the group ``init()`` made.

    A running timeline is closed (its file complete), as Horovod's is. A
    default group the script created itself stays. ``init()`` may be called
    again afterwards. Does nothing when not initialised.
    """
    with job.lock:
        if not job.initialized:
            return
        _timeline.close()  # as Horovod's shutdown: the file is complete
        _ops.forget_handles()
        _process_sets.remove_all()
        job.initialized = False
        if _groups.created_group and dist.is_initialized():
            dist.destroy_process_group()
        _groups.created_group = False
