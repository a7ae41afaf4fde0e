"""The process's summary: what went through the engine, and what did not.

Rank 0 says it when the default group is destroyed (``_runtime`` calls
:func:`report` before the group's engines stop) and at exit, once per
change; :func:`engine_counters` is also ``tdist.engine_counters()``.
"""

from __future__ import annotations

from typing import Any

from . import _backend, _collectives, _device_collectives, _hook, _startup, _waiting
from ._state import add_counters, engine_counters_of, logger, state

# The lines said last (a destroyed group's, not said again at exit).
_said: list[str] = []


def engine_counters() -> dict[tuple[str, str], dict[str, Any]]:
    """What the engines of the default group counted themselves.

    The CPU engine (CPU buckets, and CUDA buckets staged through the host)
    and the device engine of the CUDA path (NCCL), each counting where its
    transports send (see docs/communication.md, "The engine's counters").

    Returns:
        Per ``(path, codec)`` (path ``"ring"``, ``"topk"``, ``"2d"``,
        ``"2d+topk"`` or ``"collective"``; codec ``"none"``, ``"fp16"`` or
        ``"bf16"``): ``buckets``, ``bytes_in`` (as handed to the engine),
        ``wire_bytes`` (what this rank sent) and ``wire`` (the same per
        group: ``"world"``, ``"intra"``, ``"inter"``), summed over the
        engines in use now and those stopped or replaced before. Empty
        before the first engine connects.
    """
    total: dict[tuple[str, str], dict[str, Any]] = {}
    add_counters(total, state.retired_counters)
    engines = [state.engine]
    cuda = state.cuda
    if cuda is not None and getattr(cuda, "engine", None) is not state.engine:
        engines.append(cuda.engine)
    for engine in engines:
        if engine is not None:
            add_counters(total, engine_counters_of(engine))
    return total


def describe_counters(counters: dict[tuple[str, str], dict[str, Any]]) -> str:
    """The counters as the summary line says them.

    ``ring/fp16: 120 buckets, 48.0 MiB in, 24.1 MiB on the wire`` per path
    and codec, with the split by group where 2D sent on two.
    """
    parts = []
    for (path, codec), row in sorted(counters.items()):
        groups = [f"{g} {n / 2**20:.1f}" for g, n in row["wire"].items() if n and g != "world"]
        split = f" (MiB: {', '.join(groups)})" if len(groups) > 1 else ""
        parts.append(
            f"{path}/{codec}: {row['buckets']} buckets, {row['bytes_in'] / 2**20:.1f} MiB in, "
            f"{row['wire_bytes'] / 2**20:.1f} MiB on the wire{split}"
        )
    return "; ".join(parts)


def report() -> None:
    """Rank 0's last line: what went through the engine, and what did not.

    Said when the default group is destroyed (before its engines stop:
    Ray's workers, for one, end without running exit handlers) and at
    exit; a line already said is not said again.
    """
    lines = _lines()
    if lines and lines != _said:
        _said[:] = lines
        for line in lines:
            logger.info("%s", line)


def _lines() -> list[str]:
    """The summary's lines as they stand now (none when there is nothing to say)."""
    served = sum(_backend.served_in_process.values())
    forwarded = sum(_backend.forwarded_in_process.values())
    cuda = sum(_device_collectives.served_in_process.values()) + sum(
        _device_collectives.forwarded_in_process.values()
    )
    totals = _hook.totals
    waited = _waiting.describe()
    if waited and state.logged and not (totals.steps or totals.native):
        return [f"summary (the engine is off): {waited}"]  # native DDP, timed
    if not state.logged or not (totals.steps or totals.native or served or forwarded or cuda):
        return []
    carried = ", ".join(
        f"{n} {path} bucket(s) ({totals.carried_bytes[path] / 2**20:.1f} MiB)"
        for path, n in sorted(totals.carried.items())
    )
    native = sum(totals.native.values())
    counted = describe_counters(engine_counters())
    attempt = _startup.attempt_text()
    lines = [
        f"summary: {totals.steps} backward pass(es); through the engine: "
        f"{carried or 'nothing'}; left to torch: {native}"
        + (f" ({'; '.join(sorted(totals.native))})" if native else "")
        + (f"; the engine counted: {counted}" if counted else "")
        + f"; {describe_collectives(served, forwarded)}"
        + (f"; {waited}" if waited else "")
        + (f"; {attempt}" if attempt else "")
    ]
    if cuda:
        lines.append(f"  {describe_cuda_collectives()}")
    return lines


def describe_collectives(served: int, forwarded: int) -> str:
    """The CPU collectives as the summary line says them.

    ``CPU collectives: 12 served by the engine (allreduce 10, barrier 2),
    1 forwarded to gloo (gather: an op the engine does not run 1)``.
    """
    text = f"CPU collectives: {served} served by the engine"
    if served:
        rows = sorted(_backend.served_in_process.items())
        text += f" ({', '.join(f'{op} {n}' for op, n in rows)})"
    text += f", {forwarded} forwarded to gloo"
    if forwarded:
        pairs = sorted(_backend.forwarded_in_process.items())
        text += f" ({'; '.join(f'{op}: {why} {n}' for (op, why), n in pairs)})"
    counted = describe_counters(_collectives.counters_in_process())
    if counted:
        text += f"; their engines counted: {counted}"
    return text


def describe_cuda_collectives() -> str:
    """The CUDA collectives "tiacc" served, as the summary's second line says them."""
    served = _device_collectives.served_in_process
    forwarded = _device_collectives.forwarded_in_process
    text = f"CUDA collectives: {sum(served.values())} served by the device engine"
    if served:
        text += f" ({', '.join(f'{op} {n}' for op, n in sorted(served.items()))})"
    text += f", {sum(forwarded.values())} forwarded to NCCL"
    if forwarded:
        pairs = sorted(forwarded.items())
        text += f" ({'; '.join(f'{op}: {why} {n}' for (op, why), n in pairs)})"
    counted = describe_counters(_collectives.counters_in_process("cuda"))
    if counted:
        text += f"; their engines counted: {counted}"
    return text
