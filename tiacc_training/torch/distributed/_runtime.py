"""The process's runtime: torch's default process group and its engines.

The one owner of what a training process sets up once: the default group
(the script's own, or ours from the launcher) and the engines that carry
its gradient buckets. ``_hook`` (DDP), ``_backend`` (the "tiacc" backend)
and the Horovod package use what this module builds and build nothing
themselves.

The group. A native DDP script calls ``dist.init_process_group(...)`` itself,
after the two lines at its top (and, under ``mp.spawn`` or Lightning, in
processes that import the script again). So ``init_tiacc_training`` never
creates the group ahead of the script: it wraps three torch.distributed
functions and finishes its set-up when the group appears:

* ``init_process_group``: the script's call runs with the script's own
  arguments (rank, world size, init method, store, timeout, device), CPU
  collectives served by the "tiacc" backend, then the set-up finishes.
* ``destroy_process_group``: the engines of the group stop first; a later
  ``init_process_group`` sets them up again (scripts that run trials).
* ``distributed_c10d._get_default_group``: a script that never calls
  ``init_process_group`` (written for ``init_tiacc_training`` alone) gets
  the group from its launcher on first use (:func:`create_group`, which
  ``hvd.init()`` calls too), as a DDP model or any collective needs it.
  ``dist.is_initialized()`` stays ``False`` until then, which is what
  Lightning and Accelerate check before their own init.

The one writer of the group state (``_state.state``): every other module
reads it, or calls a function here that writes it.

The engines, built on first use. DDP construction is collective, so every
rank reaches :func:`world_engine` and :func:`cuda_path` in the same order
and their rendezvous pair up. An engine is kept while the configuration
stays the same and rebuilt when it changes.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import os
import urllib.parse
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from tiacc_training import _engine
from tiacc_training.errors import ConfigError

from . import _backend, _engine_state, _launch, _perf, _startup
from ._addresses import advertised_host, loopback_hint
from ._cuda import HostStaging, NcclChannels
from ._engines import engine_arguments, nccl_engine
from ._nccl import check_gpu_placement, resolve_cuda_transport
from ._rendezvous import attempt_prefix, check_same_config, default_store, elastic_agent_store
from ._startup import later_warn
from ._state import logger, state

# -- the set-up ---------------------------------------------------------------


def configure(config: Any, backend: str | None) -> None:
    """``init_tiacc_training``'s set-up (under ``state.lock``).

    With a group already there the set-up finishes at once; otherwise the
    script (or Lightning, Accelerate, mp.spawn's children) creates the
    group later, and a bad launcher variable or a transport that cannot
    work is an error now, before any group exists. The wraps are installed
    either way.
    """
    state.config = config
    state.backend_arg = backend
    if dist.is_initialized():
        launch = state.launch if state.finished else user_launch()
        finish(launch, device_given=False)
    else:
        launch = _launch.launch_env()
        state.cuda_transport, state.cuda_reason = resolve_cuda_transport(config, launch)
        state.launch = launch
        state.create_on_use = not state.finished
    install()


def mark_initialized() -> None:
    """``init_tiacc_training`` has run in this process."""
    state.initialized = True


def finish(launch: dict[str, Any], device_given: bool, check_round: bool = True) -> None:
    """The set-up that needs the group: agreement, device, report.

    Args:
        launch: how the job was launched (``launch_env``'s dict, or the
            script's own call's view).
        device_given: the script chose the CUDA device (``device_id=``).
        check_round: compare the settings every rank must share (every
            rank finishes the same number of times, so the rounds pair up).
    """
    config = state.config
    state.cuda_transport, state.cuda_reason = resolve_cuda_transport(config, launch)
    state.launch = launch
    rank, world = dist.get_rank(), dist.get_world_size()
    if world > 1 and check_round:
        # Every rank takes part in every call, so the rounds pair up.
        state.config_round += 1
        prefix = f"tiacc_training/config{state.config_round}"
        check_same_config(config, default_store(), prefix, rank, world)
    _perf.start(config, rank, world)
    local_rank = launch.get("local_rank")
    if torch.cuda.is_available() and local_rank is not None and not device_given:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    state.finished = True
    _startup.give_warnings(rank)
    if not state.logged and rank == 0:
        state.logged = True
        _startup.report(config, world, launch)


def next_prefix(kind: str) -> str:
    """A store key prefix of the default group's next rendezvous of ``kind``."""
    state.generation += 1
    return f"tiacc_training/{kind}{state.generation}"


# -- the default group ---------------------------------------------------------

# Called (rank 0's summary) before the default group's engines stop.
before_world_destroyed: list[Callable[[], None]] = []

_original_init = distributed_c10d.init_process_group
_original_destroy = distributed_c10d.destroy_process_group
_original_default_group = distributed_c10d._get_default_group
_init_signature = inspect.signature(_original_init)


def install() -> None:
    """Wraps the three functions (once per process).

    Called by ``init_tiacc_training`` once its configuration is in
    ``state``: from then on, the group's appearance finishes the set-up
    (:func:`finish`).
    """
    if state.group_patched:
        return
    for module in (dist, distributed_c10d):
        module.init_process_group = _init_process_group  # type: ignore[assignment]
        module.destroy_process_group = _destroy_process_group  # type: ignore[assignment]
    distributed_c10d._get_default_group = _default_group  # type: ignore[assignment]
    state.group_patched = True


def ensure_group() -> None:
    """Creates the group from the launcher when the script has not.

    Only while the script has not called ``init_process_group`` or
    ``destroy_process_group`` itself: after either, the group is the
    script's business, as in stock PyTorch.
    """
    if distributed_c10d.is_initialized():
        if not state.finished and state.config is not None:
            # Created through a reference to torch's own function taken
            # before the wrap (``from torch.distributed import ...``).
            finish(user_launch(), device_given=False)
        return
    if state.create_on_use:
        create_group()


def create_group(store: Any = None, launch: dict[str, Any] | None = None) -> None:
    """Creates the default group from the launcher: the one place that does.

    ``init_process_group`` with the arguments ``_launch.group_arguments``
    finds (``init_tiacc_training``'s ``backend``, the launcher's rank, size
    and rendezvous), through the wrap, so the set-up finishes as for the
    script's own call.

    Args:
        store: a store to rendezvous on instead of the launcher's address
            (``hvd.init()`` after ``hvd.shutdown()`` reuses its first group's).
        launch: the launch to use instead of the launcher's environment (a
            round of an elastic job: each round has its own ranks). With
            it, ``store`` must be new to every rank (a round's): the counts
            that keep successive groups' keys apart start again, so that a
            rank new to the job and ranks that were in earlier rounds agree.

    Raises:
        ConfigError: the job spans nodes and ``MASTER_ADDR`` is not set.
    """
    state.create_on_use = False
    given = launch
    launch, arguments = _launch.group_arguments(
        state.backend_arg, state.config, given or state.launch or _launch.launch_env()
    )
    if store is not None:
        del arguments["init_method"]
        arguments["store"] = store
    if given is not None:
        state.generation = state.placement_round = state.config_round = 0
        _backend.forget_generations()
    state.pending_launch = launch
    _init_process_group(**arguments)


def _default_group() -> Any:
    if not distributed_c10d.is_initialized():
        ensure_group()
    return _original_default_group()


@functools.wraps(_original_init)
def _init_process_group(*args: Any, **kwargs: Any) -> None:
    if state.config is None:  # init_tiacc_training has not run
        _original_init(*args, **kwargs)
        return
    bound = _init_signature.bind(*args, **kwargs)
    arguments = bound.arguments
    state.create_on_use = False
    launch = state.pending_launch
    state.pending_launch = None
    ours = launch is not None
    if launch is None:  # the script's own call
        launch = _script_launch(arguments)
        caller = "Ray Train" if launch.get("launcher") == "ray" else "the script or a framework"
        launch = {**launch, "group": f"made by init_process_group (called by {caller})"}
    else:
        launch = {
            **launch,
            "group": f"made by tiacc_training from the {launch['launcher']} launcher's variables",
        }
    requested = arguments.get("backend")
    if not ours and state.backend_arg is not None and requested is not None:
        if str(requested) != state.backend_arg:
            later_warn(
                f"init_process_group(backend={str(requested)!r}) and "
                f"init_tiacc_training(backend={state.backend_arg!r}) differ: the script's "
                f"{str(requested)!r} is used"
            )
    arguments["backend"] = _backend.cpu_backend(
        None if requested is None else str(requested), state.config
    )
    if not ours:
        _adopt_timeout(arguments.get("timeout"))
    _own_attempt_store(arguments)
    backend = arguments.get("backend")
    # torch builds a gloo group of its own for this backend: on a host whose
    # name maps to loopback it cannot reach the other hosts (say so now, as
    # gloo may take its whole timeout to give up, and again in its error).
    hint = loopback_hint(launch) if backend is None or "gloo" in str(backend) else None
    if hint is not None:
        logger.warning("  init_process_group(backend=%r): %s", str(backend), hint)
    try:
        _original_init(*bound.args, **bound.kwargs)
    except Exception as err:
        if hint is None:
            raise
        raise RuntimeError(
            f"init_process_group(backend={str(backend)!r}) failed: {err}\n"
            f"tiacc_training: the likely cause: {hint}"
        ) from err
    finish(launch, device_given=arguments.get("device_id") is not None)


def _own_attempt_store(arguments: dict[str, Any]) -> None:
    """Makes the ``env://`` group's store here, so that its start-up is bounded.

    Under torchrun the workers' ``env://`` rendezvous joins the agent's
    store, which outlives a failed attempt; where torch does not keep the
    attempts' keys apart, a restarted job reads what the dead attempt left
    (gloo's and the engine's peer addresses) and fails or hangs. The group
    is then created on that store under a prefix every rank of this attempt
    agrees on (``attempt_prefix``), so torch's keys and the engine's are
    this attempt's alone. Elsewhere (``mp.spawn``, SLURM and other
    launchers of ``env://``) rank 0 hosts the store as torch would, without
    waiting in its constructor for every rank to connect (torch waits there
    for its whole group timeout, 30 minutes by default): the same handshake
    then makes the others raise within the engine's timeout, naming a rank
    that does not arrive. A script's own store or other rendezvous
    (``tcp://`` to its own host, ``file://``) is left as it is.
    """
    if arguments.get("store") is not None:
        return
    agent = elastic_agent_store()
    method = arguments.get("init_method")
    if method in (None, "env://"):
        address = agent or _env_master()
    elif agent is not None and _tcp_address(str(method)) == agent:
        address = agent  # ours from the launcher (create_group) on torchrun's store
    else:
        return
    rank = _explicit(arguments.get("rank"), "RANK")
    world = _explicit(arguments.get("world_size"), "WORLD_SIZE")
    if address is None or rank is None or world is None or world < 2:
        return  # torch's own rendezvous (or a world of one) as it is
    timeout = arguments.get("timeout")
    if not isinstance(timeout, datetime.timedelta):
        timeout = distributed_c10d.default_pg_timeout
    if agent is not None:
        store = dist.TCPStore(
            address[0], address[1], is_master=False, timeout=timeout, wait_for_workers=False
        )
    else:
        store = _hosted_store(address, rank, world, timeout)
    prefix = attempt_prefix(store, rank, world, state.config.timeout)
    if agent is not None:
        state.attempt = prefix.rsplit("/", 1)[-1]
    arguments.update(
        init_method=None, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world
    )


def _env_master() -> tuple[str, int] | None:
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    return (host, int(port)) if host and port.isdigit() else None


def _tcp_address(method: str) -> tuple[str | None, int | None] | None:
    url = urllib.parse.urlparse(method)
    return (url.hostname, url.port) if url.scheme == "tcp" else None


def _hosted_store(address: tuple[str, int], rank: int, world: int, timeout: Any) -> Any:
    """The ``env://`` store as torch makes it (rank 0 serves), minus the wait for workers."""
    arguments = {"timeout": timeout, "wait_for_workers": False, "multi_tenant": True}
    try:
        return dist.TCPStore(address[0], address[1], world, rank == 0, **arguments)
    except TypeError:  # a torch without multi-tenant stores
        del arguments["multi_tenant"]
        return dist.TCPStore(address[0], address[1], world, rank == 0, **arguments)


def _explicit(value: Any, variable: str) -> int | None:
    """``value`` unless it is torch's "not given" (-1 or None), else ``variable``'s."""
    if value is not None and int(value) != -1:
        return int(value)
    text = os.environ.get(variable)
    return int(text) if text is not None and text.strip().lstrip("-").isdigit() else None


@functools.wraps(_original_destroy)
def _destroy_process_group(group: Any = None) -> None:
    if group is None or group is distributed_c10d.GroupMember.WORLD:
        for callback in before_world_destroyed:
            callback()
        close_all()
        state.create_on_use = False
        state.finished = False
    _backend.stop(group)
    _original_destroy(group)


def user_launch() -> dict[str, Any]:
    """The launcher's view of a group made before ``init_tiacc_training`` (or past its wrap)."""
    launch = _script_launch({})
    maker = "Ray Train" if launch.get("launcher") == "ray" else "the script or its launcher"
    return {**launch, "group": f"made by {maker} before init_tiacc_training()", "before": True}


def _script_launch(arguments: dict[str, Any]) -> dict[str, Any]:
    """The launcher's view when the script calls ``init_process_group`` itself.

    The launcher's local rank and size describe this process only when its
    rank and world size are the ones the script chose; an explicit value
    that disagrees with the launcher's is the script's choice, with one
    warning naming both.
    """
    user = {"launcher": "user", "local_rank": None, "local_size": None}
    try:
        env = _engine.launch_env()
    except ConfigError:  # a launcher variable that does not parse: the script's values rule
        return user
    if env is None:
        return user
    env = dict(env)
    for name in ("rank", "world_size"):
        mine = arguments.get(name, -1)
        if mine is not None and int(mine) != -1 and int(mine) != env[name]:
            later_warn(
                f"init_process_group({name}={mine}) and the {env['launcher']} launcher's "
                f"{name} {env[name]} differ: the script's {name}={mine} is used, and the "
                "launcher's local rank and size are ignored"
            )
            return user
    return env


def _adopt_timeout(timeout: Any) -> None:
    """The engine takes the script's ``timeout=``.

    The script's value is explicit in the code that runs, so it wins over
    ``TIACC_TRAINING_TIMEOUT`` too, with one warning naming both where they
    differ.
    """
    if not isinstance(timeout, datetime.timedelta):
        return
    seconds = timeout.total_seconds()
    variable = os.environ.get("TIACC_TRAINING_TIMEOUT")
    if variable is not None and abs(state.config.timeout - seconds) > 1e-6:
        later_warn(
            f"init_process_group(timeout={seconds:g} s) and TIACC_TRAINING_TIMEOUT={variable} "
            f"differ: the engine's collectives wait {seconds:g} s, the script's value"
        )
    state.config = state.config.with_overrides({"timeout": seconds})


# -- the engines ---------------------------------------------------------------


def world_engine(config: Any) -> Any:
    """The CPU engine (TCP) of the default group, connected on first use."""
    engine = state.engine
    if engine is not None and engine.connected and engine.config.same_settings(config):
        return engine
    if engine is not None:
        engine.shutdown()
    rank, world = dist.get_rank(), dist.get_world_size()
    store, prefix = default_store(), next_prefix("engine")
    host = advertised_host(config)
    shared = engine_arguments(store, prefix)
    engine = _engine.CommEngine(config, rank, world, host, **shared)
    engine.connect_store(store, prefix, config.timeout)
    if rank == 0:
        carried = ", ".join(f"{group} over {how}" for group, how in engine.transports.items())
        logger.info("  CPU buckets connected: %s", carried or "nothing to carry (a world of one)")
        if engine.auto_choice is not None:
            logger.info("%s", engine.auto_choice)
    state.set_engine(engine)
    _engine_state.apply_held("cpu", engine)
    return engine


def cuda_path(config: Any, device: torch.device) -> Any:
    """What carries the CUDA buckets of models on ``device``.

    NCCL channels of the device engine, or host staging over the CPU engine
    (see ``_nccl`` for the choice; ranks that turn out to share a GPU NCCL
    cannot share make ``auto`` fall back to staging here).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if state.cuda_transport == "nccl":
        state.placement_round += 1
        prefix = f"tiacc_training/gpu{state.placement_round}"
        shared = check_gpu_placement(config, device, rank, world, prefix)
        if shared is not None:
            state.cuda_transport, state.cuda_reason = "tcp", shared
    existing = state.cuda
    nccl = state.cuda_transport == "nccl"
    if nccl:
        reusable = isinstance(existing, NcclChannels) and existing.matches(config, device)
    else:
        engine = world_engine(config)
        reusable = isinstance(existing, HostStaging) and existing.matches(engine, device)
    if reusable:
        return existing
    if existing is not None:
        existing.close()
        state.set_cuda(None)
    if nccl:
        engine = nccl_engine(config, device, rank, world, default_store(), next_prefix("nccl"))
        state.set_cuda(NcclChannels(engine, device))
        _engine_state.apply_held("cuda", state.cuda)
    else:
        state.set_cuda(HostStaging(engine, device))
    return state.cuda


def close_all() -> None:
    """Stops every engine (CUDA paths first: staging feeds the CPU engine)."""
    cuda = state.cuda
    state.set_cuda(None)
    if cuda is not None:
        cuda.close()
    engine = state.engine
    state.set_engine(None)
    if engine is not None:
        engine.shutdown()
