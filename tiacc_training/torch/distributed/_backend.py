"""torch.distributed's "tiacc" backend: CPU collectives through the engine.

Registered under the name ``"tiacc"`` for CPU tensors. The collectives
themselves are ``_collectives.CpuCollectives`` (the engine, gloo
underneath for the rest); this module hands them to torch in the form the
running torch can take, found by constructing one (never by its version):

* ``"backend"``: a subclass of torch's c10d ``Backend``, which the group
  uses for its CPU tensors next to the other devices' backends. Only a
  torch whose ``Backend`` has a Python trampoline can construct one.
* ``"process-group"``: a subclass of torch's ``ProcessGroup``, which
  Python has been able to subclass on every torch 2.x. torch then uses it
  as the whole group, so it also hands the tensors of the group's other
  devices (``"cpu:tiacc,cuda:nccl"``) to the backend asked for there, and
  registers gloo and those backends under it for the calls torch makes in
  C++ without asking Python.
* ``"gloo"``: neither can be constructed; gloo serves the CPU collectives
  and the start-up line says why.

``TIACC_TRAINING_COLLECTIVES=tiacc-process-group`` takes the second form
even where the first works; ``=gloo`` keeps gloo and constructs nothing.

``register()`` registers the name once per process (importing
``tiacc_training.torch.distributed`` calls it); ``cpu_backend()`` turns the
backend string a script asks for into the one to create (the strings
themselves are ``_backend_strings``'), and ``describe_cpu_collectives()``
says which serves the CPU collectives. ``_backend_methods`` maps torch's
method names of both forms onto the collectives.
"""

from __future__ import annotations

import datetime
import functools
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from tiacc_training import _engine

from . import _backend_methods as _methods
from . import _backend_strings, _collectives
from ._backend_strings import NAME, takes_device_strings
from ._collectives import CpuCollectives, GroupArgs, GroupCollectives
from ._device_collectives import DeviceCollectives
from ._dynamo import eager
from ._state import state

# The forms, newest first.
BACKEND, PROCESS_GROUP, GLOO = "backend", "process-group", "gloo"

# Kept here too: what ``stats()`` and the tests read.
served_in_process = _collectives.served_in_process
forwarded_in_process = _collectives.forwarded_in_process

_lock = threading.Lock()
_registered: bool | None = None
_reason: str | None = None
# Which forms this torch constructs, and why not the others (the probe).
_forms: dict[str, str | None] | None = None

try:  # torch builds without distributed support lack these
    from torch._C import _distributed_c10d as _c10d
    from torch._C._distributed_c10d import Backend as _C10dBackend
    from torch._C._distributed_c10d import ProcessGroup as _C10dProcessGroup
except ImportError as error:  # pragma: no cover - depends on the torch build
    _C10dBackend = object  # type: ignore[assignment,misc]
    _C10dProcessGroup = object  # type: ignore[assignment,misc]
    _c10d = None  # type: ignore[assignment]
    _import_error: str | None = f"this torch has no c10d classes ({error})"
else:
    _import_error = None


def _torch() -> str:
    return f"torch {torch.__version__}"


def forms() -> dict[str, str | None]:
    """Which forms of the backend this torch can construct (probed once).

    Returns:
        ``{"backend": None | why not, "process-group": None | why not}``:
        ``None`` where a bare subclass of that torch class was constructed.
    """
    global _forms
    if _forms is not None:
        return _forms
    found: dict[str, str | None] = {}
    for form, base in ((BACKEND, _C10dBackend), (PROCESS_GROUP, _C10dProcessGroup)):
        if _import_error is not None:
            found[form] = _import_error
            continue
        try:
            probe = type("_Probe", (base,), {})
            probe(0, 1)
        except Exception as error:
            found[form] = f"{_torch()} cannot construct a Python {base.__name__} ({error})"
        else:
            found[form] = None
    _forms = found
    return found


def cpp_waits_on_python_work() -> bool:
    """Whether torch's C++ code, waiting on work a Python group returned, reaches its ``wait``.

    Probed once: a bare ``ProcessGroup`` subclass's ``allreduce`` returns a
    Python ``Work`` through torch's C++ ``allreduce``, and the work that
    comes back is waited on for 50 ms. Where torch kept the Python side
    alive (2.7 and later), the Python ``wait`` answers; where it did not
    (2.0 to 2.6), C++ waits on a bare ``Work`` that nothing completes and
    times out.
    """
    global _cpp_waits
    if _cpp_waits is None:
        _cpp_waits = False
        if _import_error is None:
            reached = []

            class _Work(_c10d.Work):  # type: ignore[misc,name-defined]
                def wait(self, timeout: Any = None) -> bool:
                    reached.append(True)
                    return True

            class _Group(_C10dProcessGroup):  # type: ignore[misc,valid-type]
                def allreduce(self, tensors: Any, opts: Any) -> Any:
                    return _Work()

            try:
                work = _C10dProcessGroup.allreduce(
                    _Group(0, 1), [torch.zeros(1)], _c10d.AllreduceOptions()
                )
                work.wait(datetime.timedelta(milliseconds=50))
            except Exception:  # noqa: S110 - timed out: C++ waited on its own
                pass
            _cpp_waits = bool(reached)
    return _cpp_waits


_cpp_waits: bool | None = None


def path(config: Any = None) -> str:
    """The form that serves CPU collectives: ``"backend"``, ``"process-group"`` or ``"gloo"``.

    Args:
        config: the engine configuration (``CommConfig``), or ``None`` for
            the environment's.
    """
    if config is None:
        config = _engine.CommConfig.from_env()
    if config.collectives == GLOO or not register():
        return GLOO
    return _form_for(config.collectives)


def _form_for(choice: str) -> str:
    """The form to construct for ``TIACC_TRAINING_COLLECTIVES=choice``."""
    found = forms()
    if choice != "tiacc-process-group" and found[BACKEND] is None:
        return BACKEND
    return PROCESS_GROUP if found[PROCESS_GROUP] is None else GLOO


def register() -> bool:
    """Registers the "tiacc" backend with torch.distributed (once per process).

    It claims success only after the probe constructed one of the forms.

    Returns:
        Whether "tiacc" can be used; when not, ``unavailable_reason()`` says why.
    """
    global _registered, _reason
    with _lock:
        if _registered is not None:
            return _registered
        _registered, _reason = _register()
        return _registered


def _register() -> tuple[bool, str | None]:
    if _import_error is not None:
        return False, _import_error
    if not dist.is_available() or not dist.is_gloo_available():
        return False, "this torch has no gloo backend to forward collectives to"
    found = forms()
    if all(why is not None for why in found.values()):
        return False, "; ".join(why for why in found.values() if why)
    plugins = getattr(dist.Backend, "_plugins", {})
    if NAME.upper() in plugins:
        return True, None
    try:
        dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    except TypeError:  # a torch whose register_backend takes no devices
        try:
            dist.Backend.register_backend(NAME, _create, extended_api=True)
        except Exception as error:
            return False, f"{_torch()} refused to register a Python backend ({error})"
    except Exception as error:
        return False, f"{_torch()} refused to register a Python backend ({error})"
    _route_monitored_barrier()
    return True, None


def _route_monitored_barrier() -> None:
    """``dist.monitored_barrier`` of a "tiacc" group runs on its gloo backend.

    torch sends it to the group's CPU backend's own implementation, which
    only gloo has; a Python backend cannot provide it.
    """
    original = distributed_c10d.monitored_barrier

    @functools.wraps(original)
    def monitored_barrier(
        group: Any = distributed_c10d.GroupMember.WORLD,
        timeout: datetime.timedelta | float | None = None,
        wait_all_ranks: bool = False,
    ) -> Any:
        collectives = cpu_backend_of(group)
        if collectives is None:
            return original(group, timeout, wait_all_ranks)
        if timeout is None:
            timeout = collectives.timeout
        elif not isinstance(timeout, datetime.timedelta):
            timeout = datetime.timedelta(seconds=float(timeout))
        return collectives.gloo.monitored_barrier(timeout, wait_all_ranks)

    for module in (dist, distributed_c10d):
        module.monitored_barrier = monitored_barrier  # type: ignore[assignment]


def unavailable_reason() -> str | None:
    """Why "tiacc" cannot be used in this process, or ``None`` when it can."""
    register()
    return _reason


def serves(config: Any) -> bool:
    """Whether "tiacc" serves the CPU collectives a script asks gloo for.

    Args:
        config: the engine configuration (``CommConfig``), or ``None`` for
            the environment's.

    Returns:
        False where ``TIACC_TRAINING_COLLECTIVES=gloo`` or no form of the
        backend can be constructed on this torch.
    """
    return path(config) != GLOO


def cpu_backend(requested: str | None, config: Any) -> str | None:
    """The backend string to hand to ``init_process_group``.

    CPU tensors go to "tiacc" where the script asked for gloo, or for
    nothing (torch's default is gloo for CPU tensors), unless
    ``TIACC_TRAINING_COLLECTIVES=gloo`` or this torch cannot construct the
    backend. Every other device keeps what the script asked for; ``None``
    means torch's default there too (NCCL for CUDA tensors where CUDA is
    available). An explicit "tiacc" is kept as asked.

    Args:
        requested: what the script passed (``None``, ``"gloo"``, ``"nccl"``,
            ``"cpu:gloo,cuda:nccl"``, ``"tiacc"``, ...).
        config: the engine configuration, or ``None`` for the environment's.

    Returns:
        For example ``"cpu:tiacc,cuda:nccl"`` for ``None`` on a CUDA
        machine, ``"cpu:tiacc"`` for ``"gloo"`` without CUDA, ``"nccl"`` for
        ``"nccl"``; on a torch that takes one backend name only (2.0.0),
        ``"tiacc"`` for the first two (see :func:`_backend_strings.spelled`). Under
        ``TIACC_TRAINING_CUDA_COLLECTIVES=tiacc`` NCCL's place goes to
        "tiacc" (``"cpu:tiacc,cuda:tiacc"``, ``"cuda:tiacc"``).
    """
    return _backend_strings.choose(requested, serves(config), lambda: _serves_cuda(config))


def _serves_cuda(config: Any) -> bool:
    """Whether NCCL's CUDA collectives go to "tiacc" (opted in, and it can)."""
    if config is None:
        config = _engine.CommConfig.from_env()
    return (
        config.cuda_collectives == NAME
        and torch.cuda.is_available()
        and takes_device_strings()
        and register()
    )


def cpu_backend_of(group: Any = None) -> CpuCollectives | None:
    """The "tiacc" collectives serving ``group``'s CPU tensors (default group), or ``None``."""
    backend = _tiacc_of(group)
    return None if backend is None else backend.collectives


def form_of(group: Any = None) -> str | None:
    """The form serving ``group``'s CPU collectives, or ``None``.

    Returns:
        ``"backend"``, ``"process-group"``, or ``None`` where "tiacc" does not serve them.
    """
    collectives = cpu_backend_of(group)
    return None if collectives is None else collectives.form


def describe_cpu_collectives(
    config: Any = None, group: Any = None, made_before: bool = False
) -> str:
    """One start-up line: what serves the default group's CPU collectives.

    Args:
        config: the engine configuration, or ``None`` for the environment's.
        group: the group (default: the default group).
        made_before: the group was made before ``init_tiacc_training`` (its
            backend was chosen without us).

    Returns:
        For example ``"CPU collectives: tiacc (the engine over shared
        memory, as a c10d Backend; other ops forwarded to gloo)"`` or
        ``"CPU collectives: gloo (TIACC_TRAINING_COLLECTIVES=gloo)"``.
    """
    collectives = cpu_backend_of(group)
    if collectives is not None:
        medium = collectives.transport
        where = f"the engine over {medium}" if medium else "the engine"
        if collectives.form == BACKEND:
            form = "as a c10d Backend"
        else:
            why = forms()[BACKEND]
            form = "as a ProcessGroup" + (
                f": {why}" if why else " (TIACC_TRAINING_COLLECTIVES=tiacc-process-group)"
            )
        return f"CPU collectives: {NAME} ({where}, {form}; other ops forwarded to gloo)"
    if config is None:
        config = _engine.CommConfig.from_env()
    if config.collectives == GLOO:
        why = "TIACC_TRAINING_COLLECTIVES=gloo"
    elif not register():
        why = f"the {NAME} backend is unavailable: {_reason}"
    elif made_before:
        why = (
            "the group was made before init_tiacc_training(), and torch cannot change an "
            "existing group's backend: call it before the group is made (under Ray Train, "
            "in ray.init's worker_process_setup_hook; see docs/frameworks.md)"
        )
    else:
        why = "as the script's init_process_group asked"
    name = "none" if dist.is_initialized() and not _has_cpu(group) else "gloo"
    return f"CPU collectives: {name} ({why})"


def describe_cuda_collectives(group: Any = None) -> str | None:
    """One start-up line when "tiacc" serves the default group's CUDA collectives, else ``None``.

    For example ``"CUDA collectives: tiacc (the device engine over NCCL,
    built on the first; other ops forwarded to NCCL)"``.
    """
    collectives = cuda_collectives_of(group)
    if collectives is None:
        return None
    return (
        f"CUDA collectives: {NAME} (the device engine over NCCL, built on the group's "
        "first CUDA collective; other ops forwarded to NCCL)"
    )


def _has_cpu(group: Any) -> bool:
    group = group or dist.distributed_c10d._get_default_group()
    return torch.device("cpu") in getattr(group, "_device_types", [torch.device("cpu")])


def forget_generations() -> None:
    """Counts the groups of each name from 0 again (their store is new to every rank)."""
    _collectives.forget_generations()


def stop(group: Any = None) -> None:
    """Stops the engine of ``group``'s "tiacc" collectives (all groups' for the world).

    ``destroy_process_group`` runs it first: torch shuts a c10d
    ``Backend`` down itself, but not every torch tells a Python
    ``ProcessGroup`` it is being destroyed.
    """
    if group is None or group is dist.GroupMember.WORLD:
        _collectives.stop_all()
        return
    backend = _tiacc_of(group)
    if backend is not None:
        backend.shutdown()


def _tiacc_of(group: Any) -> Any:
    """The "tiacc" backend object of ``group`` (default group; either form), or ``None``."""
    if not dist.is_initialized():
        return None
    if group is None or group is dist.GroupMember.WORLD:
        group = dist.distributed_c10d._get_default_group()
    if isinstance(group, TiaccProcessGroup):
        return group
    for device in ("cpu", "cuda"):
        try:
            backend = group._get_backend(torch.device(device))
        except Exception:  # no backend for that device in this group
            continue
        if isinstance(backend, TiaccBackend):
            return backend
    return None


def cuda_collectives_of(group: Any = None) -> Any:
    """The "tiacc" collectives serving ``group``'s CUDA tensors (default group), or ``None``."""
    backend = _tiacc_of(group)
    found = None if backend is None else backend._devices.get("cuda")
    return found if isinstance(found, GroupCollectives) else None


def _create(options: Any, backend_options: Any = None) -> Any:
    """The factory torch calls (extended API): one backend per group, in this torch's form."""
    config = state.config if state.config is not None else _engine.CommConfig.from_env()
    # An explicit "tiacc" is kept even under TIACC_TRAINING_COLLECTIVES=gloo.
    form = _form_for(config.collectives)
    group = GroupArgs(
        options.store,
        options.group_rank,
        options.group_size,
        options.timeout,
        str(getattr(options, "group_id", "") or "group"),
    )
    device, devices = _creating()
    if form == BACKEND:
        # torch builds one backend for every device when they all ask for
        # "tiacc", else one per device.
        served = devices if len(set(devices.values())) == 1 else {device: NAME}
        return TiaccBackend(group, devices=list(served) or ["cpu"])
    if form == PROCESS_GROUP:
        return TiaccProcessGroup(group, devices=_backend_strings.other_devices(devices))
    raise RuntimeError(f"the {NAME} backend cannot be constructed: {_reason}")


def _creating() -> tuple[str, dict[str, str]]:
    """The device torch is building a backend for, and the group's device map.

    Both are in the locals of torch's group builder, the caller of the
    factory; without one (a torch that builds groups otherwise), the CPU
    alone.
    """
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != "_new_process_group_helper":
        frame = frame.f_back
    if frame is None:
        return "cpu", {"cpu": NAME}
    config = frame.f_locals.get("backend_config")
    devices = getattr(config, "get_device_backend_map", None)
    found = {str(d): str(b).lower() for d, b in devices().items()} if callable(devices) else {}
    return str(frame.f_locals.get("device", "cpu")), found or {"cpu": NAME}


# -- the two forms ----------------------------------------------------------
#
# Both take torch's method names to the collectives of the call's device
# (``_backend_methods``).


class _Form:
    """What both forms answer torch the same way (a mixin before torch's class).

    ``collectives`` serves the CPU tensors (``None`` in a backend torch
    built for the CUDA tensors alone); ``_devices`` what serves each other
    device's: the device engine's collectives where the group asked for
    "tiacc" there, else the backend it asked for.
    """

    collectives: CpuCollectives | None
    _devices: dict[str, Any]

    def device_backend(self, device: str) -> Any:
        """What serves ``device``'s tensors.

        Raises:
            RuntimeError: the group was not created with a backend for ``device``.
        """
        backend = self._devices.get(device)
        if backend is None:
            serves = (["CPU"] if self.collectives is not None else []) + list(self._devices)
            raise RuntimeError(
                f"this {NAME} group serves {' and '.join(serves)} tensors, not {device} "
                f"tensors: ask for one in init_process_group's backend (e.g. "
                f"'cpu:{NAME},{device}:nccl')"
            )
        return backend

    def collectives_for(self, args: Any) -> GroupCollectives:
        """The collectives serving a call's tensors (the CPU's when it has none)."""
        device = _methods.device_of(args)
        if device is None or device == "cpu":
            if self.collectives is None:
                raise RuntimeError(
                    f"this {NAME} group serves {' and '.join(self._devices)} tensors, not "
                    "CPU tensors: ask for one in init_process_group's backend "
                    f"(e.g. 'cpu:{NAME},cuda:{NAME}')"
                )
            return self.collectives
        return self.device_backend(device)

    def _device_collectives(self, group: GroupArgs, device: str) -> DeviceCollectives:
        if device != "cuda":
            raise ValueError(f"the {NAME} backend serves CPU and CUDA tensors, not {device}")
        fallback = _nccl(group)
        return DeviceCollectives(group.under("device/"), fallback)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """The name torch reports."""
        return NAME

    def abort(self) -> None:
        """Stops at once (torch's abort)."""
        self.shutdown()  # type: ignore[attr-defined]

    @eager
    def barrier(self, opts: Any = None) -> Any:
        """``barrier``: returns once every rank has entered it."""
        if self.collectives is None:
            return next(iter(self._devices.values())).barrier(opts)
        return self.collectives.barrier(opts)


class TiaccBackend(_Form, _C10dBackend):  # type: ignore[misc,valid-type]
    """The "backend" form: a c10d ``Backend`` for one group's CPU and/or CUDA tensors.

    Args:
        group: the group, as torch handed it to the backend.
        devices: the device types torch registers it for (``["cpu"]``,
            ``["cpu", "cuda"]``, ``["cuda"]``).

    Attributes:
        collectives: the group's CPU collectives (counts, gloo, transport),
            or ``None`` without the CPU.
    """

    def __init__(self, group: GroupArgs, devices: list[str] | None = None) -> None:
        super().__init__(group.rank, group.size)
        devices = devices or ["cpu"]
        self.collectives = None
        if "cpu" in devices:
            self.collectives = CpuCollectives(group, BACKEND)
        # torch maps a bare "tiacc" to every device it was registered
        # for; without CUDA there are no CUDA tensors to serve.
        self._devices = {
            device: self._device_collectives(group, device)
            for device in devices
            if device != "cpu" and (device != "cuda" or torch.cuda.is_available())
        }

    def shutdown(self) -> None:
        """Stops the engines (torch calls it on ``destroy_process_group``)."""
        if self.collectives is not None:
            self.collectives.shutdown()
        for collectives in self._devices.values():
            collectives.shutdown()


for _name, _ours in _methods.SERVED_BACKEND.items():
    setattr(TiaccBackend, _name, eager(_methods.served(_name, _ours, _c10d)))
for _name, (_op, _gloo) in _methods.GLOO_BACKEND.items():
    setattr(TiaccBackend, _name, eager(_methods.forwarded(_name, _op, _gloo)))


class TiaccProcessGroup(_Form, _C10dProcessGroup):  # type: ignore[misc,valid-type]
    """The "process-group" form: the whole group, for a torch that cannot subclass ``Backend``.

    CPU tensors go to the group's :class:`CpuCollectives`; the tensors of
    another device to the backend the group asked for there (``nccl``, or
    gloo). gloo and those backends are also registered under the group,
    for the calls torch makes in C++ without asking Python.

    Args:
        group: the group, as torch handed it to the backend.
        devices: the backend asked for on each other device (``{"cuda": "nccl"}``).

    Attributes:
        collectives: the group's CPU collectives (counts, gloo, transport).
    """

    def __init__(self, group: GroupArgs, devices: dict[str, str] | None = None) -> None:
        super().__init__(group.rank, group.size)
        # torch's C++ code waits on this form's work too (DDP's parameter
        # check): where it cannot wait on work written in Python, each
        # collective finishes in the call (_collectives._finished).
        self.collectives = CpuCollectives(
            group, PROCESS_GROUP, synchronous=not cpp_waits_on_python_work()
        )
        types = _C10dProcessGroup.BackendType
        self._register_backend(torch.device("cpu"), types.GLOO, self.collectives.gloo)
        default = getattr(self, "_set_default_backend", None)
        if default is not None:  # what torch's own hooks on a group look up
            default(types.GLOO)
        self._devices: dict[str, Any] = {}
        for device, backend in (devices or {}).items():
            name = backend.lower()
            if name == GLOO:
                made, kind = self.collectives.gloo, types.GLOO
            elif name == "nccl":
                made, kind = _nccl(group), types.NCCL
            elif name == NAME and device == "cuda" and not torch.cuda.is_available():
                continue
            elif name == NAME:
                made = self._device_collectives(group, device)
                self._devices[device] = made
                # torch's C++ calls (none for CUDA tensors of a Python
                # ProcessGroup: it asks Python) may use NCCL underneath.
                self._register_backend(torch.device(device), types.NCCL, made.fallback)
                continue
            else:
                raise ValueError(
                    f"the {NAME} backend (as a ProcessGroup, {_torch()}) serves {device} "
                    f"tensors through gloo or nccl, not {backend!r}"
                )
            self._devices[device] = made
            self._register_backend(torch.device(device), kind, made)

    def shutdown(self) -> None:
        """Stops the engine's channel and the backends underneath."""
        self.collectives.shutdown()
        for backend in self._devices.values():
            if isinstance(backend, GroupCollectives):
                backend.shutdown()
                continue
            stop = getattr(backend, "shutdown", None) or getattr(backend, "_shutdown", None)
            if stop is not None and backend is not self.collectives.gloo:
                stop()


for _name, _ours in _methods.SERVED_GROUP.items():
    _method = _methods.by_device(_name, _methods.served(_name, _ours, _c10d))
    setattr(TiaccProcessGroup, _name, eager(_method))
for _name, (_op, _gloo) in _methods.GLOO_GROUP.items():
    _method = _methods.by_device(_name, _methods.forwarded(_name, _op, _gloo))
    setattr(TiaccProcessGroup, _name, eager(_method))


def _nccl(group: GroupArgs) -> Any:
    """An NCCL backend for ``group``'s CUDA tensors."""
    if not dist.is_nccl_available():
        raise RuntimeError(f"{_torch()} has no NCCL backend for the group's CUDA tensors")
    options = dist.ProcessGroupNCCL.Options()
    for name, value in (
        ("_timeout", group.timeout),
        ("is_high_priority_stream", False),
        ("group_name", group.name),
    ):
        if hasattr(options, name):
            setattr(options, name, value)
    store = dist.PrefixStore("cuda/", group.store)
    return dist.ProcessGroupNCCL(store, group.rank, group.size, options)
