"""The backend strings ``init_process_group`` takes, and the "tiacc" backend's place in them.

torch parses ``"cpu:gloo,cuda:nccl"`` (a backend per device), or, on
torch 2.0.0, takes one name for every device. :func:`choose` turns the
string a script asks for into the one to create, given whether the
"tiacc" backend serves the CPU and CUDA collectives (``_backend`` decides
that); :func:`spelled` writes a device map as this torch takes it, and
:func:`other_devices` says which backends a group created under the one
name serves its other devices with.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

# The backend's name, as ``init_process_group`` takes it.
NAME = "tiacc"


def choose(requested: str | None, use: bool, serves_cuda: Callable[[], bool]) -> str | None:
    """The backend string to hand to ``init_process_group`` (``_backend.cpu_backend``).

    Args:
        requested: what the script passed.
        use: whether "tiacc" serves the CPU collectives a script asks gloo for.
        serves_cuda: whether NCCL's CUDA collectives go to "tiacc" (asked
            only once a string was chosen).
    """
    chosen = _for_cpu(requested, use)
    if chosen is None or not serves_cuda():
        return chosen
    if ":" not in chosen:
        return spelled({"cuda": NAME}) if chosen.strip().lower() == "nccl" else chosen
    devices = device_map(chosen, chosen)
    if devices.get("cuda", "").lower() != "nccl":
        return chosen
    devices["cuda"] = NAME
    return spelled(devices)


def _for_cpu(requested: str | None, use: bool) -> str | None:
    """:func:`choose` before the CUDA choice."""
    if requested is not None and not isinstance(requested, str):
        requested = str(requested)  # a ``dist.Backend`` value
    if requested is None or requested.strip() == "" or requested.strip().lower() == "undefined":
        devices = {"cpu": NAME if use else "gloo"}
        if torch.cuda.is_available():
            devices["cuda"] = "nccl"
        return spelled(devices) if use else ("gloo" if len(devices) == 1 else spelled(devices))
    text = requested.strip()
    if ":" not in text:
        name = text.lower()
        if name == "gloo" and use:
            # gloo also serves CUDA tensors: keep it there.
            devices = {"cpu": NAME}
            if torch.cuda.is_available():
                devices["cuda"] = "gloo"
            return spelled(devices)
        return requested
    devices = device_map(text, requested)
    if use and devices.get("cpu", "").lower() == "gloo":
        devices["cpu"] = NAME
        return spelled(devices)
    return requested


def takes_device_strings() -> bool:
    """Whether this torch parses backend strings per device (``"cpu:gloo,cuda:nccl"``).

    torch 2.0.0 takes one backend name for every device only. Probed once,
    by parsing one.
    """
    global _device_strings
    if _device_strings is None:
        try:
            dist.distributed_c10d.BackendConfig("cpu:gloo,cuda:nccl")
        except Exception:
            _device_strings = False
        else:
            _device_strings = True
    return _device_strings


_device_strings: bool | None = None
# On a torch that takes one backend name only: the backends a group created
# under the name "tiacc" serves its other devices' tensors with.
_single_name_devices: dict[str, str] = {}


def spelled(devices: dict[str, str]) -> str | None:
    """``devices`` as the backend string this torch takes (``None``: torch's default).

    Where torch parses strings per device, ``"cpu:tiacc,cuda:nccl"``.
    Where it takes one name only: that name when every device has the same
    backend, ``"tiacc"`` for a CPU on "tiacc" (the other devices' backends
    are kept for the group it creates, which then serves those devices
    too), and ``None`` for torch's own default (gloo for CPU tensors, NCCL
    for CUDA tensors).
    """
    global _single_name_devices
    if takes_device_strings():
        return join(devices)
    if devices.get("cpu") == NAME:
        _single_name_devices = {d: b for d, b in devices.items() if d != "cpu"}
        return NAME
    if len(set(devices.values())) == 1:
        return next(iter(devices.values()))
    return None


def device_map(text: str, requested: str) -> dict[str, str]:
    """``"cpu:gloo,cuda:nccl"`` as ``{"cpu": "gloo", "cuda": "nccl"}``."""
    devices = {}
    for part in text.split(","):
        device, sep, backend = part.partition(":")
        if not sep or not device.strip() or not backend.strip():
            raise ValueError(
                f"init_process_group(backend={requested!r}): {part!r} is not 'device:backend'"
            )
        devices[device.strip().lower()] = backend.strip()
    return devices


def join(devices: dict[str, str]) -> str:
    """``{"cpu": "gloo", "cuda": "nccl"}`` as ``"cpu:gloo,cuda:nccl"``."""
    return ",".join(f"{device}:{backend}" for device, backend in devices.items())


def other_devices(devices: dict[str, str]) -> dict[str, str]:
    """The backends the group being created asked for on devices other than the CPU.

    torch builds a group's backends device by device and, once one of
    them is a ``ProcessGroup``, uses it as the whole group: the
    ``ProcessGroup`` form must serve the other devices itself. One name
    for every device ("tiacc" on a torch that takes one name only) means
    the backends the script's call asked for there.
    """
    found = {d: b for d, b in devices.items() if d != "cpu"}
    if _single_name_devices and set(found.values()) <= {NAME}:
        return {d: _single_name_devices[d] for d in found if _single_name_devices.get(d)}
    return found
