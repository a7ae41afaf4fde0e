"""The default process group: the script's own, or ours on first use.

A native DDP script calls ``dist.init_process_group(...)`` itself, after the
two lines at its top (and, under ``mp.spawn`` or Lightning, in processes
that import the script again). So ``init_tiacc_training`` never creates the
group ahead of the script: it wraps three torch.distributed functions and
finishes its set-up when the group appears:

* ``init_process_group``: the script's call runs with the script's own
  arguments (rank, world size, init method, store, timeout, device), CPU
  collectives served by the "tiacc" backend, then the set-up finishes.
* ``destroy_process_group``: the engines of the group stop first; a later
  ``init_process_group`` sets them up again (scripts that run trials).
* ``distributed_c10d._get_default_group``: a script that never calls
  ``init_process_group`` (written for ``init_tiacc_training`` alone) gets
  the group from its launcher on first use, as a DDP model or any
  collective needs it. ``dist.is_initialized()`` stays ``False`` until then,
  which is what Lightning and Accelerate check before their own init.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import os
import warnings
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed import distributed_c10d

from tiacc_training import _engine
from tiacc_training.errors import ConfigError

from . import _backend, _launch
from ._state import state

_original_init = distributed_c10d.init_process_group
_original_destroy = distributed_c10d.destroy_process_group
_original_default_group = distributed_c10d._get_default_group
_init_signature = inspect.signature(_original_init)

# Set up the group once it exists: ``finish(launch, device_id_given)``,
# provided by the package's ``__init__`` (it owns the start-up sequence).
_finish: Callable[[dict[str, Any], bool], None] | None = None


def install(finish: Callable[[dict[str, Any], bool], None]) -> None:
    """Wraps the three functions (once per process)."""
    global _finish
    _finish = finish
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
        if not state.finished and state.config is not None and _finish is not None:
            # Created through a reference to torch's own function taken
            # before the wrap (``from torch.distributed import ...``).
            _finish(user_launch(), False)
        return
    if not state.create_on_use:
        return
    state.create_on_use = False
    launch, arguments = _launch.group_arguments(
        state.backend_arg, state.config, state.launch or _launch.launch_env()
    )
    state.pending_launch = launch
    _init_process_group(**arguments)


def _default_group() -> Any:
    if not distributed_c10d.is_initialized():
        ensure_group()
    return _original_default_group()


@functools.wraps(_original_init)
def _init_process_group(*args: Any, **kwargs: Any) -> None:
    if state.config is None or _finish is None:  # init_tiacc_training has not run
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
    requested = arguments.get("backend")
    if not ours and state.backend_arg is not None and requested is not None:
        if str(requested) != state.backend_arg:
            _later_warn(
                f"init_process_group(backend={str(requested)!r}) and "
                f"init_tiacc_training(backend={state.backend_arg!r}) differ: the script's "
                f"{str(requested)!r} is used"
            )
    arguments["backend"] = _backend.cpu_backend(
        None if requested is None else str(requested), state.config
    )
    if not ours:
        _adopt_timeout(arguments.get("timeout"))
    _original_init(*bound.args, **bound.kwargs)
    _finish(launch, arguments.get("device_id") is not None)


@functools.wraps(_original_destroy)
def _destroy_process_group(group: Any = None) -> None:
    if group is None or group is distributed_c10d.GroupMember.WORLD:
        from ._engines import close_all

        close_all()
        state.create_on_use = False
        state.finished = False
    _backend.stop(group)
    _original_destroy(group)


def user_launch() -> dict[str, Any]:
    """The launcher's view of a group the script created before our call."""
    return _script_launch({})


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
            _later_warn(
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
        _later_warn(
            f"init_process_group(timeout={seconds:g} s) and TIACC_TRAINING_TIMEOUT={variable} "
            f"differ: the engine's collectives wait {seconds:g} s, the script's value"
        )
    state.config = state.config.with_overrides({"timeout": seconds})


def _later_warn(message: str) -> None:
    """Queues a warning for rank 0 to give once the group exists."""
    if message not in state.conflicts:
        state.conflicts.append(message)


def give_warnings(rank: int) -> None:
    """Rank 0 warns once per job about each conflict the script's call met."""
    messages, state.conflicts = state.conflicts, []
    if rank != 0:
        return
    for message in messages:
        if message not in state.warned:
            state.warned.add(message)
            warnings.warn(f"tiacc_training: {message}", RuntimeWarning, stacklevel=2)
