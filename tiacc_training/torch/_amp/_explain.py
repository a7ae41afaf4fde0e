"""The explanations of the mixed-precision policy's decisions.

The rule behind each answer with its numbers, as ``stats()`` reports it
and the change log lines say it: the engine's checks repeated in Python on
the state it held before and after a call (policy 1's events, policy 2's
trend verdicts, the scaler guard's trips) and what a buffer check found.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from tiacc_training import _engine

# The engine's fixed thresholds, quoted in the explanations.
_CONST: dict[str, Any] = dict(_engine.amp_constants())

_SCHEDULES = {0: "time", 1: "time + learning rate", 2: "loss trend"}

_TRIPS = {
    "nonfinite_loss": "a non-finite loss",
    "nonfinite_scale": "a non-finite loss scale",
    "scale_floor": "a loss scale below its floor",
    "scale_collapse": "a collapsed loss scale",
    "overflow": "repeated overflowed steps",
}


def _pct(fraction: float) -> str:
    """A fixed threshold as a percentage: 0.1 -> ``10%``."""
    return f"{fraction * 100:g}%"


def _events_text(
    pre: dict[str, Any], after: dict[str, Any], rate: Optional[float], loss: Optional[float]
) -> Optional[str]:
    """What fired policy 1's hold on this call, with its numbers, or None.

    A learning-rate change, an abnormal loss or both: the engine's checks,
    repeated on the state it held before the call.
    """
    found = []
    ref = pre["ref_lr"]
    if ref is not None and rate is not None and after["ref_lr"] != ref:
        change = abs(rate - ref) / max(abs(rate), abs(ref))
        found.append(
            f"learning rate changed from {ref:g} to {rate:g} "
            f"(by {change:.1%}, more than {_pct(_CONST['LR_TOLERANCE'])})"
        )
    window = pre["losses"]
    if loss is not None and math.isfinite(loss) and len(window) >= _CONST["LOSS_MIN_SAMPLES"]:
        mean = sum(window) / len(window)
        std = math.sqrt(sum((v - mean) * (v - mean) for v in window) / len(window))
        limit = max(_CONST["LOSS_SIGMAS"] * std, _CONST["LOSS_REL_FLOOR"] * abs(mean))
        if abs(loss - mean) > limit:
            found.append(
                f"loss {loss:.4g} is {abs(loss - mean):.4g} from the mean {mean:.4g} of the "
                f"last {len(window)} losses (limit {limit:.4g} = max({_CONST['LOSS_SIGMAS']:g}"
                f" x std {std:.4g}, {_pct(_CONST['LOSS_REL_FLOOR'])} of the mean))"
            )
    return " and ".join(found) if found else None


def _trip_text(
    pre: dict[str, Any], after: dict[str, Any], counter: int, loss: Optional[float], scale: Any
) -> str:
    """What tripped the scaler guard on this call, with its numbers."""
    kind = after["last_trip"]
    rearmed = pre["cool_until"] is not None and counter >= pre["cool_until"]
    if kind == "nonfinite_loss":
        return f"the loss is {loss}"
    if kind == "nonfinite_scale":
        return f"the loss scale is {scale}"
    if kind == "scale_floor":
        return f"the loss scale {scale:g} is below {_CONST['SCALE_FLOOR']:g}"
    if kind == "scale_collapse":
        peak = scale if rearmed or pre["peak_scale"] is None else max(pre["peak_scale"], scale)
        return (
            f"the loss scale {scale:g} is {peak / scale:g}x below its peak {peak:g} "
            f"(limit {_CONST['SCALE_COLLAPSE']:g}x)"
        )
    if kind == "overflow":
        flags = [] if rearmed else list(pre["overflows"])
        flags.append(pre["last_scale"] is not None and scale < pre["last_scale"])
        flags = flags[-_CONST["OVERFLOW_WINDOW"] :]
        return (
            f"the loss scale fell on {sum(flags)} of the last {len(flags)} calls "
            f"(overflowed steps; limit {_CONST['OVERFLOW_LIMIT']})"
        )
    return _TRIPS.get(kind, str(kind))


def _names_text(names: list[str], shown: int = 3) -> str:
    """``a, b, c and 4 more``."""
    text = ", ".join(names[:shown])
    return text + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _when(epoch: Optional[int], via: str) -> str:
    """``at epoch 4``, ``by repair_buffers() after epoch 4``, ``before the first call``."""
    if epoch is None:
        return "before the first call"
    return (
        f"at epoch {epoch}"
        if via == "enable_mixed_precision"
        else f"by repair_buffers() after epoch {epoch}"
    )


def _buffer_text(record: dict[str, Any], where: bool = True) -> str:
    """What a buffer check found and did, for ``stats()`` and the log lines.

    Args:
        record: The check's ``buffer_log`` entry.
        where: Whether to say that :meth:`repair_buffers` found them.
    """
    names = record["buffers"]
    found = f"{len(names)} non-finite model buffer{'s' if len(names) > 1 else ''}"
    found += f" ({_names_text(names)})"
    if where and record["via"] == "repair_buffers":
        found += f" (found {_when(record['epoch'], record['via'])})"
    if record["restored"]:
        taken = _when(record["copy_epoch"], record["copy_via"])
        done = (
            f"restored all {record['watched']} floating-point buffers from the copy taken {taken}"
        )
    else:
        done = "no finite copy of these buffers to restore"
    return f"{found}: {done}"


def _check_text(epoch: Optional[int], via: str) -> str:
    """Where a buffer check's log line says it ran: ``epoch 4``, ``repair_buffers() after ...``."""
    if via == "repair_buffers":
        return "repair_buffers() " + (
            "before the first call" if epoch is None else f"after epoch {epoch}"
        )
    return f"epoch {epoch}"


def _watch_trend(
    config: dict[str, Any], pre: dict[str, Any], counter: int, loss: Optional[float]
) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """Repeats policy 2's verdict on the trial that ends at this call.

    Args:
        config: The engine's configuration.
        pre: The engine's state before the call.
        counter: The call's counter.
        loss: The loss the engine heard, as a float.

    Returns:
        The measured drop to remember for the explanations (``trial``,
        ``first``, ``last``, ``losses``, ``drop``) or None, and a note when
        the trial had too few losses for a verdict, else None.
    """
    trial = pre["trend_window"]
    if trial is None:
        return None, None
    length = config["interval_hold"]
    start = trial * config["interval"]
    n, sx, sy, sxx, sxy = (
        pre["trend_n"],
        pre["trend_sum_x"],
        pre["trend_sum_y"],
        pre["trend_sum_xx"],
        pre["trend_sum_xy"],
    )
    if start < counter <= start + length and loss is not None and math.isfinite(loss):
        x = float(counter - start)
        n, sx, sy, sxx, sxy = n + 1, sx + x, sy + loss, sxx + x * x, sxy + x * loss
    if counter < start + length:
        return None, None
    if n >= _CONST["TREND_MIN_POINTS"]:
        spread = sxx - sx * sx / n
        slope = (sxy - sx * sy / n) / spread if spread > 0 else math.nan
        drop = -slope * length / max(abs(sy / n), 1e-12)
        if math.isfinite(drop):
            trend = {
                "trial": trial,
                "first": start,
                "last": start + length - 1,
                "losses": n,
                "drop": drop,
            }
            return trend, None
    return None, (
        f"trial {trial} (epochs {start}-{start + length - 1}) gave {n} usable losses, "
        f"fewer than {_CONST['TREND_MIN_POINTS']}: no new verdict"
    )


def _reason_text(
    config: dict[str, Any],
    after: dict[str, Any],
    reason: str,
    counter: int,
    *,
    last_event: Optional[tuple[int, str]],
    last_trip: Optional[tuple[int, str]],
    last_trend: Optional[dict[str, Any]],
    previous_level: int,
) -> str:
    """The rule behind ``reason`` at ``counter``, with its numbers.

    Args:
        config: The engine's configuration.
        after: The engine's state after the call.
        reason: The engine's reason for the decision.
        counter: The call's counter.
        last_event: The counter and text of policy 1's last event, or None.
        last_trip: The counter and text of the last guard trip, or None.
        last_trend: The last trend verdict's measurement (see
            :func:`_watch_trend`), or None.
        previous_level: The cool-down level before the last trip.
    """
    start, end = config["start"], config["end"]
    if reason == "before_start":
        return f"epoch {counter} is before start_time {start}"
    if reason == "window":
        if end is None:
            return f"epoch {counter} is at or after start_time {start} (no end_time)"
        return f"epoch {counter} is inside start_time {start} <= epoch < end_time {end}"
    if reason == "after_end":
        return f"epoch {counter} is at or after end_time {end}"
    if reason == "hold":
        through = after["hold_until"] - 1
        if last_event is None:
            return (
                f"fp32 hold through epoch {through} after a learning-rate change "
                "or an abnormal loss"
            )
        at, event = last_event
        if at == counter:
            return f"{event}: fp32 hold through epoch {through}"
        return f"fp32 hold through epoch {through} (since epoch {at}: {event})"
    if reason == "cooldown":
        through = after["cool_until"] - 1
        if last_trip is None:
            what = _TRIPS.get(after["last_trip"], "a guard trip")
            return f"the scaler guard's cool-down runs through epoch {through} after {what}"
        at, what = last_trip
        if at != counter:
            return (
                f"the scaler guard's cool-down runs through epoch {through} "
                f"(tripped at epoch {at}: {what})"
            )
        length = after["cool_until"] - counter
        text = f"scaler guard tripped: {what}: fp32 for a cool-down of {length} epochs"
        if after["cool_level"] > 0:
            text += (
                f" ({2 ** after['cool_level']} x cooldown {config['cooldown']}: less than "
                f"{config['cooldown'] * 2**previous_level} epochs after the previous "
                f"cool-down, which ran through epoch {after['last_cool_end'] - 1})"
            )
        return text + f", through epoch {through}"
    interval, length = config["interval"], config["interval_hold"]
    if reason == "trial":
        trial = counter // interval
        first = trial * interval
        return (
            f"loss-trend trial {trial}: mixed precision for epochs "
            f"{first}-{first + length - 1} while the losses are measured"
        )
    next_trial = (counter // interval + 1) * interval
    if reason == "trend_default":
        return f"no loss-trend verdict yet (next trial at epoch {next_trial})"
    verdict = reason.removeprefix("trend_")
    if last_trend is None:
        return f"the last loss-trend verdict was {verdict!r} (until epoch {next_trial})"
    t = last_trend
    drop = t["drop"]
    size = f"{abs(drop):.1%}"
    if size == f"{0:.1%}":
        moved = f"stayed flat ({size})"
    else:
        moved = f"fell {size}" if drop > 0 else f"rose {size}"
    fast, slow = _pct(_CONST["TREND_FAST"]), _pct(_CONST["TREND_SLOW"])
    judged = {
        "fast": f"more than {fast}: falling too fast",
        "slow": f"less than a {slow} fall: too slow",
        "ok": f"between {slow} and {fast}",
    }[verdict]
    return (
        f"over trial {t['trial']} (epochs {t['first']}-{t['last']}, {t['losses']} losses) "
        f"the fitted loss {moved}, {judged} (until the next trial at epoch {next_trial})"
    )


def _settings(c: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The parameters and the fixed thresholds that a policy's rules use, for ``stats()``.

    Args:
        c: The engine's configuration.

    Returns:
        The parameters by the documents' table names, and the thresholds
        (lower-case names) of the schedule and, when on, the scaler guard.
    """
    number = int(c["policy"])
    if number == 2:
        settings: dict[str, Any] = {
            "interval_time": c["interval"],
            "interval_hold_time": c["interval_hold"],
        }
    else:
        settings = {"start_time": c["start"], "end_time": c["end"]}
        if number == 1:
            settings["hold_time"] = c["hold"]
    settings["cooldown"] = c["cooldown"]
    names = {
        1: ["LR_TOLERANCE", "LOSS_WINDOW", "LOSS_MIN_SAMPLES", "LOSS_SIGMAS", "LOSS_REL_FLOOR"],
        2: ["TREND_MIN_POINTS", "TREND_FAST", "TREND_SLOW"],
    }.get(number, [])
    if c["cooldown"] > 0:
        names += [
            "SCALE_FLOOR",
            "SCALE_COLLAPSE",
            "OVERFLOW_WINDOW",
            "OVERFLOW_LIMIT",
            "MAX_BACKOFF",
        ]
    return settings, {name.lower(): _CONST[name] for name in names}
