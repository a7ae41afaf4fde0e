"""The engines' state across steps, saved and restored with a checkpoint.

Under Top-K (``LIGHT_TOPK_ALLREDUCE=1``) the engines keep, per gradient
bucket, what later steps compute with: the error-feedback residual, with
the momentum correction (``TIACC_TRAINING_TOPK_MOMENTUM``) the velocity and
the last averaged sum, and the bucket's count of sparse allreduces, which
the warm-up (``TIACC_TRAINING_TOPK_WARMUP_STEPS``) reads. :func:`state_dict`
returns it for this rank's engines of the default group (the CPU engine,
which also carries CUDA buckets staged through the host, and the device
engine of CUDA buckets over NCCL) as a plain dict of ints, strings and CPU
tensors that ``torch.save`` writes beside the model's checkpoint;
:func:`load_state_dict` puts it back, into the engines now, or into each
engine when it is built (the first DDP model after a restart builds it).

The form (``format`` 1)::

    {"format": 1, "rank": int, "world_size": int,
     "engines": {"cpu" | "cuda": {
         "settings": {name: str},       # what the state depends on
         "buckets": {index: {"steps": int,
                             "residual": float32 tensor,    # when kept
                             "velocity": float32 tensor,    # momentum correction
                             "previous_sum": float32 tensor}}}}}
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from . import _launch
from ._state import state

FORMAT = 1
# The engines of the default group a state covers.
KINDS = ("cpu", "cuda")
# A bucket's buffers, as the engines name them.
BUFFERS = ("residual", "velocity", "previous_sum")

# The size in bytes of each bucket a loaded state holds buffers for (flat
# algorithm only), until the DDP hook first carries that bucket: a bucket of
# another size means DDP's buckets are not the checkpoint's
# (:func:`check_bucket`).
expected_sizes: dict[int, int] = {}
# Engine state loaded by ``load_state_dict`` before its engine was built,
# per kind (``"cpu"``, ``"cuda"``), as the engines' ``load_state`` takes it:
# ``_runtime`` applies it to the engine it builds next (:func:`apply_held`).
# This module's own, not the group's: it outlives the group's engines.
pending: dict[str, Any] = {}


def state_dict() -> dict[str, Any]:
    """This rank's engine state, to save with a checkpoint.

    Read once the work queued before this call is done: call it between
    steps (after ``optimizer.step()``), as for the model's and optimizer's
    state. A state loaded by :func:`load_state_dict` and not yet applied
    (its engine is not built yet) is returned as it was loaded.

    Returns:
        ``{"format", "rank", "world_size", "engines"}`` (see the module
        docs): ints, strings and CPU float32 tensors. ``engines`` is empty
        before any engine was built, or when no engine keeps state (Top-K
        off).

    Raises:
        CommError: an engine failed (its state may be half a step's).
    """
    engines: dict[str, Any] = {}
    exported = {kind: engine.state() for kind, engine in _engines()}
    for kind, entry in exported.items():
        engines[kind] = _to_torch(entry)
    for kind, held in pending.items():
        engines.setdefault(kind, _to_torch(held))
    # The engines know their own rank and world: ask them first.
    rank, world = _place({**pending, **exported})
    return {"format": FORMAT, "rank": rank, "world_size": world, "engines": engines}


def load_state_dict(state_dict: Mapping[str, Any]) -> None:
    """Restores this rank's engine state from :func:`state_dict`'s dict.

    Each engine's state replaces what that engine keeps (an engine the
    state has nothing for starts afresh). An engine not built yet gets its
    state when it is built: the first DDP model (or Horovod optimizer)
    builds it, so this may be called before wrapping the model. Call it on
    every rank with that rank's own state, between steps.

    A resumed run continues bit for bit as the uninterrupted one would only
    where DDP hands the engine the same buckets: DDP's first step in a fresh
    process puts every parameter in one bucket and rebuilds its buckets
    after it, unless the model is built with ``find_unused_parameters=True``
    (see docs/communication.md). A loaded bucket whose size differs from the
    bucket DDP hands over first is reported with one warning.

    Args:
        state_dict: what :func:`state_dict` returned on this rank (through
            ``torch.save`` and ``torch.load``).

    Raises:
        TypeError: ``state_dict`` or one of its entries has the wrong type
            (the message names the key).
        ValueError: a key is missing or unknown, or a value is invalid (the
            message names the key); the state was saved by another rank or
            in a world of another size (the message names both); or it does
            not fit the engine (another Top-K setting, a bucket of another
            size: the message names the setting or bucket and both values).
            Nothing is loaded then. For an engine built later, the rank and
            the fit are checked when it is built (DDP construction raises).
    """
    rank, world, converted = _from_torch(state_dict)
    if dist.is_available() and dist.is_initialized():
        mine = dist.get_rank()
        if rank != mine:
            raise ValueError(
                f"state_dict['rank']: the engine state was saved by rank {rank}; this is "
                f"rank {mine}: load each rank's own state"
            )
        if world != dist.get_world_size():
            raise ValueError(
                f"state_dict['world_size']: the engine state was saved in a world of {world} "
                f"ranks; this one has {dist.get_world_size()}"
            )
    live = dict(_engines())
    for kind, engine in live.items():
        entry = converted.get(kind, _empty(rank, world))
        _apply(kind, engine if kind == "cpu" else state.cuda, entry)
    pending.clear()
    pending.update({k: v for k, v in converted.items() if k not in live})
    expected_sizes.clear()
    for entry in converted.values():
        watch_sizes(entry)


def apply_held(kind: str, carrier: Any) -> None:
    """Applies the state held for ``kind`` to the engine just built.

    Called by ``_runtime`` once it has built and installed the engine.

    Args:
        kind: ``"cpu"`` or ``"cuda"``.
        carrier: the CPU engine (``"cpu"``), or the CUDA path (``"cuda"``:
            only NCCL channels have an engine of their own; host staging's
            state is the CPU engine's, so a state held for it stays held).
    """
    if kind == "cuda" and not hasattr(carrier, "load_engine_state"):
        return
    held = pending.pop(kind, None)
    if held is not None:
        _apply(kind, carrier, held)


def watch_sizes(entry: dict[str, Any]) -> None:
    """Expects the buckets of a loaded engine state at their saved sizes.

    Only under the flat algorithm, where a bucket's buffers are as long as
    the bucket (2D keeps each rank's shard).
    """
    if entry["settings"].get("two_d", "off") != "off":
        return
    for index, bucket in entry["buckets"].items():
        if bucket["residual"] is not None:
            expected_sizes[index] = len(bucket["residual"])


def check_bucket(index: int, nbytes: int) -> None:
    """Warns once when the first bucket of an index differs from the loaded one.

    The engine then drops the loaded Top-K state of that bucket's channel
    (it does whenever a bucket's size changes), so the resumed run does not
    continue exactly as the uninterrupted one.

    Args:
        index: the bucket's index.
        nbytes: its size in bytes.
    """
    expected = expected_sizes.pop(index, None)
    if expected is None or expected == nbytes:
        return
    expected_sizes.clear()
    warnings.warn(
        f"tiacc_training: gradient bucket {index} has {nbytes} bytes, but the engine state "
        f"loaded for it was saved from a bucket of {expected} bytes: DDP's buckets are not "
        "the checkpoint's, so the engine drops the loaded Top-K state of that bucket's channel "
        "and the resumed run does not continue exactly as the uninterrupted one would. A fresh "
        "DDP model puts every parameter in one bucket in its first step and rebuilds its "
        "buckets after it; build it with find_unused_parameters=True to keep one layout from "
        "the first step (see docs/communication.md)",
        RuntimeWarning,
        stacklevel=3,
    )


def _engines() -> list[tuple[str, Any]]:
    """The connected engines of the default group, by kind."""
    out = []
    cpu = state.engine
    if cpu is not None and getattr(cpu, "connected", False):
        out.append(("cpu", cpu))
    device = getattr(state.cuda, "engine", None)
    if device is not None and device is not cpu and getattr(device, "connected", False):
        out.append(("cuda", device))
    return out


def _apply(kind: str, carrier: Any, entry: dict[str, Any]) -> None:
    """Loads ``entry`` into the CPU engine or the NCCL channels ``carrier``."""
    if kind == "cpu":
        carrier.load_state(entry)
    else:
        carrier.load_engine_state(entry)


def _empty(rank: int, world: int) -> dict[str, Any]:
    """A state that keeps nothing (an engine starts afresh with it)."""
    return {"rank": rank, "world_size": world, "settings": {}, "buckets": {}}


def _place(known: dict[str, Any]) -> tuple[int, int]:
    """This rank and the world size, without creating the default group.

    From an engine's state (``known``: exported or held) where there is
    one, else the default group, else the launcher.
    """
    for entry in known.values():
        return int(entry["rank"]), int(entry["world_size"])
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    launch = state.launch or _launch.launch_env()
    return int(launch["rank"]), int(launch["world_size"])


def _to_torch(entry: Mapping[str, Any]) -> dict[str, Any]:
    """An engine's state (bytes buffers) as tensors, without rank and size."""
    buckets = {}
    for index, bucket in entry["buckets"].items():
        out: dict[str, Any] = {"steps": int(bucket["steps"])}
        for name in BUFFERS:
            data = bucket.get(name)
            if data is not None:
                out[name] = torch.frombuffer(bytearray(data), dtype=torch.float32)
        buckets[int(index)] = out
    return {"settings": dict(entry["settings"]), "buckets": buckets}


def _from_torch(saved: Mapping[str, Any]) -> tuple[int, int, dict[str, dict[str, Any]]]:
    """Checks :func:`state_dict`'s form; the engines' entries as they take them.

    Returns:
        The rank and world size the state was saved in, and per kind the
        engine's dict (bytes buffers, with that rank and size).
    """
    where = "state_dict"
    _mapping(saved, where)
    _keys(saved, where, {"format", "rank", "world_size", "engines"})
    if saved["format"] != FORMAT:
        raise ValueError(f"{where}['format'] is {saved['format']!r}: this version reads {FORMAT}")
    rank = _int(saved["rank"], f"{where}['rank']", 0)
    world = _int(saved["world_size"], f"{where}['world_size']", 1)
    if rank >= world:
        raise ValueError(f"{where}['rank'] {rank} is not a rank of a world of {world}")
    engines = saved["engines"]
    _mapping(engines, f"{where}['engines']")
    out: dict[str, dict[str, Any]] = {}
    for kind, entry in engines.items():
        at = f"{where}['engines'][{kind!r}]"
        if kind not in KINDS:
            raise ValueError(f"{at}: unknown engine {kind!r} (expected one of {', '.join(KINDS)})")
        _mapping(entry, at)
        _keys(entry, at, {"settings", "buckets"})
        settings = entry["settings"]
        _mapping(settings, f"{at}['settings']")
        for name, value in settings.items():
            if not isinstance(name, str) or not isinstance(value, str):
                raise TypeError(f"{at}['settings'][{name!r}] must map a str to a str")
        _mapping(entry["buckets"], f"{at}['buckets']")
        buckets = {}
        for index, bucket in entry["buckets"].items():
            here = f"{at}['buckets'][{index!r}]"
            index = _int(index, f"{at}['buckets'] key {index!r}", 0)
            buckets[index] = _bucket(bucket, here)
        out[kind] = {
            "rank": rank,
            "world_size": world,
            "settings": dict(settings),
            "buckets": buckets,
        }
    return rank, world, out


def _bucket(bucket: Any, at: str) -> dict[str, Any]:
    """One bucket's entry: its step count and buffers (bytes, or ``None``)."""
    _mapping(bucket, at)
    unknown = set(bucket) - {"steps", *BUFFERS}
    if unknown:
        raise ValueError(f"{at}: unknown key(s) {sorted(map(str, unknown))}")
    if "steps" not in bucket:
        raise ValueError(f"{at}: no 'steps'")
    out: dict[str, Any] = {"steps": _int(bucket["steps"], f"{at}['steps']", 0)}
    for name in BUFFERS:
        tensor = bucket.get(name)
        if tensor is None:
            out[name] = None
            continue
        key = f"{at}[{name!r}]"
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{key} must be a tensor, not {type(tensor).__name__}")
        if tensor.dtype != torch.float32 or tensor.dim() != 1:
            raise ValueError(
                f"{key} must be a 1-D float32 tensor, not {tensor.dim()}-D {tensor.dtype}"
            )
        out[name] = tensor.detach().to("cpu").contiguous().numpy().tobytes()
    return out


def _mapping(value: Any, at: str) -> None:
    if not isinstance(value, Mapping):
        raise TypeError(f"{at} must be a dict, not {type(value).__name__}")


def _keys(value: Mapping[str, Any], at: str, expected: set[str]) -> None:
    missing = expected - set(value)
    if missing:
        raise ValueError(f"{at}: missing key(s) {sorted(missing)}")
    unknown = set(value) - expected
    if unknown:
        raise ValueError(f"{at}: unknown key(s) {sorted(map(str, unknown))}")


def _int(value: Any, at: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{at} must be an int, not {type(value).__name__}")
    if value < least:
        raise ValueError(f"{at} must be at least {least}, not {value}")
    return value
