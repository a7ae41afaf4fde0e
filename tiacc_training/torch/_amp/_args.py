"""The argument checks of the mixed-precision policy.

The two spellings of a parameter (the TI-ACC code's and the documents'
table names), counters and numbers as Python values, the model to protect,
and the constructor's parameters as the engine's arguments.
"""

from __future__ import annotations

import numbers
import operator
from typing import Any, Optional, Union

import torch


class _Unset:
    """Marks an argument the caller did not pass."""

    def __repr__(self) -> str:
        return "<unset>"


_UNSET = _Unset()

_Count = Union[int, None, _Unset]


def _pick(doc_name: str, doc_value: _Count, table_name: str, table_value: _Count) -> _Count:
    """The value of a parameter that has two spellings, or ``_UNSET``."""
    if not isinstance(doc_value, _Unset) and not isinstance(table_value, _Unset):
        raise TypeError(
            f"{table_name} and {doc_name} are two names of one parameter; pass only one of them"
        )
    return table_value if isinstance(doc_value, _Unset) else doc_value


def _count(name: str, value: Any, minimum: int = 0) -> Optional[int]:
    """``value`` as a non-negative int (None stays None)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got a bool")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if number < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {number}")
    return number


def _scalar(name: str, value: Any) -> Optional[float]:
    """A number or a one-element tensor as a float (None stays None)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{name} must be a number or a one-element tensor, got shape {tuple(value.shape)}"
            )
        return float(value.detach().reshape(()).item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


def _check_model(model: Any) -> None:
    """Raises TypeError unless ``model`` is None or a ``torch.nn.Module``."""
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def _policy_number(policy: Any) -> int:
    """The policy number, 0, 1 or 2."""
    if isinstance(policy, bool) or not isinstance(policy, numbers.Integral):
        raise TypeError(f"policy must be an int (0, 1 or 2), got {type(policy).__name__}")
    number = int(policy)
    if number not in (0, 1, 2):
        raise ValueError(
            f"policy must be 0 (time), 1 (time + learning rate) or 2 (loss), got {number}"
        )
    return number


def _engine_args(
    number: int,
    start: _Count,
    hold: _Count,
    end: _Count,
    interval: _Count,
    interval_hold: _Count,
    cooldown: Any,
) -> tuple[int, int, Optional[int], Optional[int], int, int, int]:
    """The constructor's parameters, checked, as ``_engine.AmpPolicy``'s arguments.

    Args:
        number: The policy number (see :func:`_policy_number`).
        start: ``start_time``, or ``_UNSET`` (default 10).
        hold: ``hold_time``, or ``_UNSET`` (none).
        end: ``end_time``, or ``_UNSET`` (no end).
        interval: ``interval_time``, or ``_UNSET`` (default 1000).
        interval_hold: ``interval_hold_time``, or ``_UNSET`` (default 100).
        cooldown: The scaler guard's base cool-down.

    Returns:
        ``(policy, start, end, hold, interval, interval_hold, cooldown)``.

    Raises:
        TypeError: A non-int.
        ValueError: A parameter the policy needs that is missing (named in
            the message), or an out-of-range value.
    """
    start = _count("start_time", 10 if isinstance(start, _Unset) else start)
    hold = _count("hold_time", None if isinstance(hold, _Unset) else hold, minimum=1)
    end = _count("end_time", None if isinstance(end, _Unset) else end)
    interval = _count(
        "interval_time", 1000 if isinstance(interval, _Unset) else interval, minimum=1
    )
    interval_hold = _count(
        "interval_hold_time",
        100 if isinstance(interval_hold, _Unset) else interval_hold,
        minimum=1,
    )
    cooldown_units = _count("cooldown", cooldown)
    if cooldown_units is None:
        raise TypeError("cooldown must be an int, got None")

    missing = []
    if number in (0, 1) and start is None:
        missing.append("start_time (start_step)")
    if number == 1 and hold is None:
        missing.append("hold_time (hold_step)")
    if number == 2 and interval is None:
        missing.append("interval_time (test_interval)")
    if number == 2 and interval_hold is None:
        missing.append("interval_hold_time (test_step)")
    if missing:
        raise ValueError(f"policy {number} requires {', '.join(missing)}")
    if number in (0, 1) and end is not None and start is not None and end <= start:
        raise ValueError(f"end_time ({end}) must be greater than start_time ({start})")
    if (
        number == 2
        and interval is not None
        and interval_hold is not None
        and interval_hold >= interval
    ):
        raise ValueError(
            f"interval_hold_time ({interval_hold}) must be less than interval_time ({interval})"
        )
    return (
        number,
        start if start is not None else 0,
        end,
        hold,
        interval if interval is not None else 1000,
        interval_hold if interval_hold is not None else 100,
        cooldown_units,
    )
