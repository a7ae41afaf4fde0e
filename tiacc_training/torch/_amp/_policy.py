"""The adaptive mixed-precision policy's class (``MixedPrecision_TrainingPolicy``).

The decisions are made by a state machine in the Rust engine; this module
checks the arguments (:mod:`._args`), reads the GradScaler, asks the engine
and records each decision with its explanation (:mod:`._explain`:
``stats()`` and a log line per change), reading the engine's state before
and after the call. With ``model=`` it also keeps the last finite copy of a
model's floating-point buffers and puts it back when an overflowed forward
pass has written NaN or inf into them (:mod:`._buffers`; the engine only
hears of it as a guard trip).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any, Optional

import torch

from tiacc_training import _engine
from tiacc_training.torch._amp._args import (
    _UNSET,
    _check_model,
    _Count,
    _count,
    _engine_args,
    _pick,
    _policy_number,
    _scalar,
)
from tiacc_training.torch._amp._buffers import (
    _flat_copies,
    _float_buffers,
    _Layout,
    _layout_key,
    _restore,
)
from tiacc_training.torch._amp._explain import (
    _SCHEDULES,
    _buffer_text,
    _check_text,
    _events_text,
    _reason_text,
    _settings,
    _trip_text,
    _watch_trend,
)

_STATE_VERSION = 1

# The package's name: the log lines keep the logger they had before the
# module became a package (the docs and tests name it).
_log = logging.getLogger("tiacc_training.torch._amp")

# What the engine remembers before its first call (and after a restart).
_FRESH_STATE: dict[str, Any] = dict(_engine.AmpPolicy(0, 0, None, None, 1000, 100, 0).state())

# Most per-call records and change records ``stats()`` keeps (the newest).
_HISTORY_LIMIT = 10_000


class MixedPrecision_TrainingPolicy:
    """Decides, step by step or epoch by epoch, whether to train in mixed precision.

    Call :meth:`enable_mixed_precision` once per step (or epoch) before the
    forward pass and pass the result as ``enabled=`` to ``torch.autocast``.
    ``epoch`` is the caller's counter (a step or an epoch number; every
    duration below is in its units). It should not decrease; when it does,
    the policy treats the call as a restart and forgets everything it
    learnt (as if newly built; use :meth:`state_dict` /
    :meth:`load_state_dict` to resume a run instead). Calling twice with the
    same counter is fine.

    **Policy 0 (time).** Mixed precision is on iff
    ``start_time <= epoch < end_time`` (start inclusive, end exclusive);
    ``end_time=None`` means no end.

    **Policy 1 (time + learning rate).** As policy 0, but an *event* at
    counter ``e`` forces fp32 for ``hold_time`` units: off while
    ``epoch < e + hold_time`` (a later event extends the hold; events are
    watched inside and outside the time window). Events:

    * the learning rate changes: ``|lr - ref| > 0.1 * max(|lr|, |ref|)``,
      where ``ref`` is the first ``lr`` passed, then the ``lr`` at the last
      such event (a step decay fires once, a per-step schedule once per 10 %
      of cumulative change);
    * the loss fluctuates abnormally: once at least 5 of the last 20 finite
      losses are recorded, a loss is abnormal iff
      ``|loss - mean| > max(4 * std, 0.02 * |mean|)`` (mean and population
      standard deviation of those recent losses, before the new one joins).

    **Policy 2 (loss trend).** Every ``interval_time`` units, for
    ``interval_hold_time`` units, the policy runs a trial: on for
    ``k * interval_time <= epoch < k * interval_time + interval_hold_time``
    (``k >= 1``, so with 1000 and 100: 1000-1099, 2000-2099, ...). The loss
    argument is the previous step's loss, so the losses passed at counters
    ``k * interval_time < epoch <= k * interval_time + interval_hold_time``
    are the trial's; a least-squares line is fitted through them and the
    relative drop over the trial, ``r = -slope * interval_hold_time /
    |mean loss|``, is judged at the first call at or after the trial's end:
    falling too fast (``r > 0.5``) or too slowly (``r < 0.01``, flat or
    rising) turns mixed precision off until the next trial, otherwise it
    stays on. Fewer than 3 losses keep the previous verdict; before the
    first verdict mixed precision is on. ``start_time``/``end_time`` are not
    used by policy 2.

    **Scaler guard (every policy, beyond the TI-ACC documents).** The policy
    watches the ``GradScaler`` passed as ``scaler`` and the loss. A *trip*
    turns mixed precision off for a cool-down of ``cooldown`` units (counter
    ``e`` to ``e + cooldown - 1``), whatever the policy says; afterwards it
    tries again. Trips: a non-finite loss; a non-finite scale or one below
    1.0; a scale at least 1024 times below the highest seen since the guard
    was last armed; 6 scale decreases (each is an overflowed, skipped step)
    within the last 32 calls. Backoff: a trip less than one cool-down length
    after the previous cool-down ended doubles the cool-down (up to 16 x
    ``cooldown``); a later trip starts again from ``cooldown``. When a
    cool-down ends the guard re-arms (the current scale becomes the peak,
    the overflow history is cleared). ``cooldown=0`` disables the guard.
    A disabled scaler (``is_enabled()`` false) or none is not watched.

    **Buffer protection (opt-in, with ``model=``).** The guard acts after
    the fact: the GradScaler skips an overflowed step's optimizer update,
    but the forward pass has already updated the model's buffers, and one
    overflowed batch leaves BatchNorm's running statistics NaN or inf for
    good (training goes on, evaluation is at chance). Pass the model as
    ``enable_mixed_precision(..., model=model)`` and the policy checks its
    floating-point buffers (every ``named_buffers()`` entry with a floating
    dtype: running means and variances, any other float buffer) at each
    call. While all are finite it keeps a copy of them (on their device);
    when one is not, it copies every floating-point buffer back from the
    last finite copy in place (same tensors, same device, no allocation;
    all of them, so a BatchNorm's mean and variance come from the same
    moment), logs one WARNING naming the non-finite buffers and the restore
    count, counts it in :meth:`stats` (``buffer_restores``,
    ``buffer_log``) and trips the scaler guard: the engine sees the call as
    a non-finite loss (policies 1 and 2 skip that loss as they skip any
    non-finite one), so autocast is off for the cool-down and
    :attr:`last_trip` reads ``nonfinite_buffers``. Non-finite buffers with
    no finite copy to restore (already bad at the first check, or the
    model's buffers changed name, shape, dtype or device since the copy)
    are logged and trip the guard, nothing is copied. During a cool-down,
    or with ``cooldown=0``, the buffers are still restored, with no new
    trip. The copy belongs to the policy, one model per policy; it is not
    in :meth:`state_dict` and :meth:`load_state_dict` drops it (the next
    check takes a new one).

    Only evaluation reads the running statistics (a training-mode forward
    pass normalises with its batch's), and an evaluation at the end of an
    epoch runs before the next call's check: called once per *epoch*, the
    restore would come after that evaluation; called per step, the last
    step of the epoch is checked only at the next epoch's first call.
    Either way, call :meth:`repair_buffers` before evaluating: it checks,
    restores and copies the same way, a restore it made trips the guard at
    the next call, and its answer (the non-finite buffers' names, empty
    when all were finite) says the last step or epoch overflowed, so
    evaluate it in fp32.

    **Explanations.** :meth:`stats` says what was decided on each call and
    why (the rule and its numbers); every change of the answer (autocast
    turned on or off; before the first call it counts as off) is logged at
    INFO level on the ``tiacc_training.torch._amp`` logger (a child of
    ``tiacc_training``), e.g. ``epoch 12: autocast off: learning rate
    changed from 0.1 to 0.01 (by 90.0%, more than 10%): fp32 hold through
    epoch 31``. No line is logged while the answer stays the same.

    Cost: one ``scaler.get_scale()`` per call (on CUDA that reads the scale
    tensor, one device-to-host copy) and ``float(loss)`` when the loss is a
    tensor (a synchronisation if it lives on a GPU); no other GPU work. The
    explanations add about 10 microseconds of CPU work per call. With
    ``model=`` (or per :meth:`repair_buffers` call): ``named_buffers()``,
    one concatenation of the floating-point buffers per device and dtype
    (a device-to-device copy, which becomes the policy's copy when all are
    finite: as much memory again as the buffers, two floats per BatchNorm
    channel), a few kernels counting their non-finite elements per buffer
    and one read of those counts per device (one synchronisation on CUDA
    for an ordinary model), whatever the number of buffers. On one CPU
    thread that is about 1 ms per call for ResNet-50 (106 buffers), most
    of it Python and ``named_buffers()``. A model without floating-point
    buffers costs only ``named_buffers()``. Restoring copies buffer by
    buffer.

    Args:
        policy: 0 (time), 1 (time + learning rate) or 2 (loss trend).
        start_step: First counter of the time window (policies 0 and 1);
            default 10. Keyword alias ``start_time``.
        hold_step: Length of a hold (policy 1, required there). Keyword
            alias ``hold_time``.
        end_step: First counter after the time window; None (default) = no
            end. Keyword alias ``end_time``.
        test_interval: Period of the trials (policy 2); default 1000.
            Keyword alias ``interval_time``.
        test_step: Length of a trial (policy 2), less than the period;
            default 100. Keyword alias ``interval_hold_time``.
        start_time: Alias of ``start_step`` (the documents' table name).
        end_time: Alias of ``end_step``.
        hold_time: Alias of ``hold_step``.
        interval_time: Alias of ``test_interval``.
        interval_hold_time: Alias of ``test_step``.
        cooldown: Base cool-down of the scaler guard; 0 turns it off.

    Raises:
        TypeError: A parameter given under both of its names, or a non-int.
        ValueError: A bad policy number, a parameter the policy needs that is
            missing (named in the message), or an out-of-range value.

    Example:
        >>> scaler = torch.amp.GradScaler("cuda")
        >>> policy = MixedPrecision_TrainingPolicy(1, 10, 20, None)  # hold 20 steps
        >>> loss = None
        >>> for step, (x, y) in enumerate(loader):
        ...     lr = optimizer.param_groups[0]["lr"]
        ...     on = policy.enable_mixed_precision(step, lr, loss, scaler=scaler, model=model)
        ...     with torch.autocast("cuda", dtype=policy.autocast_dtype("cuda"), enabled=on):
        ...         loss = criterion(model(x), y)
        ...     scaler.scale(loss).backward()
        ...     scaler.step(optimizer)
        ...     scaler.update()
    """

    def __init__(
        self,
        policy: int,
        start_step: _Count = _UNSET,
        hold_step: _Count = _UNSET,
        end_step: _Count = _UNSET,
        test_interval: _Count = _UNSET,
        test_step: _Count = _UNSET,
        *,
        start_time: _Count = _UNSET,
        end_time: _Count = _UNSET,
        hold_time: _Count = _UNSET,
        interval_time: _Count = _UNSET,
        interval_hold_time: _Count = _UNSET,
        cooldown: int = 100,
    ) -> None:
        number = _policy_number(policy)
        start = _pick("start_step", start_step, "start_time", start_time)
        hold = _pick("hold_step", hold_step, "hold_time", hold_time)
        end = _pick("end_step", end_step, "end_time", end_time)
        interval = _pick("test_interval", test_interval, "interval_time", interval_time)
        interval_hold = _pick("test_step", test_step, "interval_hold_time", interval_hold_time)
        self._engine = _engine.AmpPolicy(
            *_engine_args(number, start, hold, end, interval, interval_hold, cooldown)
        )
        # The explanation: counts, the newest records, and what the last
        # hold, guard trip and trend verdict were about.
        self._config: dict[str, Any] = dict(self._engine.config())
        self._calls = 0
        self._calls_on = 0
        self._changes = 0
        self._restarts = 0
        self._trips = 0
        self._epochs: deque[tuple[int, bool, str, str]] = deque(maxlen=_HISTORY_LIMIT)
        self._change_log: deque[tuple[int, bool, str, str]] = deque(maxlen=_HISTORY_LIMIT)
        # Buffer protection: the last finite copy of the model's
        # floating-point buffers, what it is a copy of (name, shape, dtype,
        # device per buffer) and the call it was taken at; the counts; what
        # each check that found non-finite buffers did; a restore made by
        # repair_buffers() that the next call turns into a guard trip.
        self._copies: list[torch.Tensor] = []
        self._layout: Optional[_Layout] = None
        self._copy_epoch: Optional[int] = None
        self._copy_via: Optional[str] = None
        self._buffer_checks = 0
        self._buffers_watched = 0
        self._buffer_restores = 0
        self._buffer_log: deque[dict[str, Any]] = deque(maxlen=_HISTORY_LIMIT)
        self._buffer_findings = 0
        self._pending_buffers: Optional[dict[str, Any]] = None
        self._forget()

    def enable_mixed_precision(
        self,
        epoch: int,
        lr: Optional[float] = None,
        loss: Any = None,
        scaler: Any = None,
        *,
        model: Optional[torch.nn.Module] = None,
    ) -> bool:
        """Whether the coming step (or epoch) should run under autocast.

        Args:
            epoch: The caller's counter (step or epoch), non-negative.
            lr: The current learning rate (policy 1 watches it).
            loss: The previous step's loss: a number or a one-element tensor
                (policies 1 and 2 and the guard read it).
            scaler: The ``torch.amp.GradScaler`` in use, or None; anything
                with ``get_scale()`` and ``is_enabled()`` works.
            model: The model being trained, to protect its floating-point
                buffers (see the class docs: checked, copied while finite,
                restored from the last finite copy and a guard trip when
                not); None (default) leaves them alone. Keyword only, like
                ``scaler`` it is read at the call and not kept.

        Returns:
            True to train the step in mixed precision, False for fp32.

        Raises:
            TypeError: An argument of the wrong type (``model`` not a
                ``torch.nn.Module``).
            ValueError: A negative counter or a non-finite learning rate.
        """
        counter = _count("epoch", epoch)
        if counter is None:
            raise TypeError("epoch must be an int, got None")
        rate = _scalar("lr", lr)
        if rate is not None and not math.isfinite(rate):
            raise ValueError(f"lr must be finite, got {rate}")
        loss_value = _scalar("loss", loss)
        scale = None
        if scaler is not None:
            if not (hasattr(scaler, "get_scale") and hasattr(scaler, "is_enabled")):
                raise TypeError(
                    "scaler must be a torch.amp.GradScaler (get_scale() and is_enabled()), "
                    f"got {type(scaler).__name__}"
                )
            if scaler.is_enabled():
                scale = float(scaler.get_scale())
        _check_model(model)
        found = None
        if model is not None:
            found = self._check_buffers(model, counter, "enable_mixed_precision")
        found = found or self._pending_buffers
        self._pending_buffers = None
        # Non-finite buffers prove an overflow: the engine hears of them as a
        # non-finite loss, its guard's first trip kind.
        heard = loss_value
        if found is not None and (loss_value is None or math.isfinite(loss_value)):
            heard = math.nan
        before = dict(self._engine.state())
        enabled = bool(self._engine.decide(counter, rate, heard, scale))
        self._explain(counter, rate, heard, scale, before, enabled, found, loss_value)
        return enabled

    def repair_buffers(self, model: torch.nn.Module) -> list[str]:
        """Checks ``model``'s floating-point buffers now, restoring them if need be.

        What ``enable_mixed_precision(..., model=model)`` does to the
        buffers, between calls: before an evaluation, which reads the
        running statistics before the next call would check them (see the
        class docs). When all are finite the policy's copy is
        refreshed; when one is not, every floating-point buffer is restored
        from the last finite copy (WARNING log line, ``buffer_restores``),
        and the next :meth:`enable_mixed_precision` call trips the scaler
        guard. Cost: as one call's buffer check (one synchronisation).

        Args:
            model: The model whose buffers the policy protects.

        Returns:
            The names of the buffers that were non-finite (now restored,
            unless there was no finite copy), empty when all were finite:
            a non-empty answer means the last step or epoch overflowed, so
            evaluate it in fp32.

        Raises:
            TypeError: ``model`` is not a ``torch.nn.Module``.
        """
        if model is None:
            raise TypeError("model must be a torch.nn.Module, got None")
        _check_model(model)
        epoch = self._engine.state()["last_counter"]
        found = self._check_buffers(model, epoch, "repair_buffers")
        if found is None:
            return []
        self._pending_buffers = found
        return list(found["buffers"])

    def _check_buffers(
        self, model: torch.nn.Module, epoch: Optional[int], via: str
    ) -> Optional[dict[str, Any]]:
        """Copies the model's floating-point buffers while finite, else restores them.

        Args:
            model: The model.
            epoch: The counter of the call (``repair_buffers``: the last
                call's, None before the first).
            via: ``"enable_mixed_precision"`` or ``"repair_buffers"``.

        Returns:
            None when every floating-point buffer is finite (or there are
            none), else the record of what was found and done (also in
            ``stats()["buffer_log"]``).
        """
        buffers = _float_buffers(model)
        if not buffers:
            return None
        self._buffer_checks += 1
        self._buffers_watched = len(buffers)
        known = self._layout
        restored = known is not None and known.key == _layout_key(buffers)
        layout = known if known is not None and restored else _Layout(buffers)
        flats, bad = _flat_copies(buffers, layout)
        if not any(bad):
            # This call's flat copies become the policy's copy.
            self._layout, self._copies = layout, flats
            self._copy_epoch, self._copy_via = epoch, via
            return None
        if restored:
            _restore(buffers, layout, self._copies)
            self._buffer_restores += 1
        self._buffer_findings += 1
        record = {
            "epoch": epoch,
            "via": via,
            "buffers": [name for (name, _), nonfinite in zip(buffers, bad) if nonfinite],
            "watched": len(buffers),
            "restored": restored,
            "copy_epoch": self._copy_epoch if restored else None,
            "copy_via": self._copy_via if restored else None,
        }
        self._buffer_log.append(record)
        text = _buffer_text(record, where=False)
        at = _check_text(epoch, via)
        _log.warning("%s: %s (buffer_restores=%d)", at, text, self._buffer_restores)
        return record

    def _forget(self) -> None:
        """Drops what the explanations remember about the engine's state."""
        self._buffer_trip: Optional[int] = None  # the engine's trip count at a buffer trip
        self._last_event: Optional[tuple[int, str]] = None
        self._last_trip: Optional[tuple[int, str]] = None
        self._last_trend: Optional[dict[str, Any]] = None
        self._previous_level = 0

    def _explain(
        self,
        counter: int,
        rate: Optional[float],
        loss: Optional[float],
        scale: Optional[float],
        before: dict[str, Any],
        enabled: bool,
        found: Optional[dict[str, Any]] = None,
        passed: Optional[float] = None,
    ) -> None:
        """Records one decision and logs it when autocast turned on or off.

        Args:
            counter: The call's counter.
            rate: The learning rate passed, as a float.
            loss: The loss the engine heard, as a float (NaN after a buffer
                finding with a finite loss).
            scale: The scale read from an enabled scaler, or None.
            before: The engine's state before the call.
            enabled: The decision.
            found: What a buffer check found since the last call, or None.
            passed: The loss the caller passed, as a float.
        """
        after = dict(self._engine.state())
        config = self._config
        reason = str(after["last_reason"])
        notes = []
        pre = before
        if before["last_counter"] is not None and counter < before["last_counter"]:
            pre = _FRESH_STATE
            self._restarts += 1
            self._forget()
            notes.append(
                f"the counter went back from {before['last_counter']} to {counter}: "
                "the policy restarted"
            )
        if config["policy"] == 1 and after["hold_until"] == counter + config["hold"]:
            event = _events_text(pre, after, rate, loss)
            if event is not None:
                self._last_event = (counter, event)
                if reason != "hold":
                    notes.append(f"{event}: fp32 hold through epoch {after['hold_until'] - 1}")
        kept = None
        if config["policy"] == 2:
            trend, kept = _watch_trend(config, pre, counter, loss)
            if trend is not None:
                self._last_trend = trend
        buffer_trip = None
        if after["trips"] > pre["trips"]:
            self._trips += 1
            if found is None:
                what = _trip_text(pre, after, counter, loss, scale)
            else:
                what = _buffer_text(found)
                if passed is not None and not math.isfinite(passed):
                    what = f"the loss is {passed} and {what}"
                else:
                    buffer_trip = int(after["trips"])
            self._last_trip = (counter, what)
            self._previous_level = int(pre["cool_level"])
        elif found is not None:
            why = "the guard is off: cooldown=0" if config["cooldown"] == 0 else "no new trip"
            notes.append(f"{_buffer_text(found)} ({why})")
        if reason != "cooldown":
            if pre["cool_until"] is not None and counter >= pre["cool_until"]:
                notes.append(
                    f"the scaler guard's cool-down is over (it ran through epoch "
                    f"{pre['cool_until'] - 1}) and the guard re-armed"
                )
            if pre["last_reason"] == "hold" and reason != "hold":
                notes.append("the fp32 hold is over")
        if kept is not None:
            notes.append(kept)
        notes.append(
            _reason_text(
                config,
                after,
                reason,
                counter,
                last_event=self._last_event,
                last_trip=self._last_trip,
                last_trend=self._last_trend,
                previous_level=self._previous_level,
            )
        )
        detail = "; ".join(notes)

        if buffer_trip is not None:
            self._buffer_trip = buffer_trip  # after a restart's _forget()
        self._calls += 1
        self._calls_on += enabled
        self._epochs.append((counter, enabled, reason, detail))
        if enabled != bool(before["last_enabled"]):
            self._changes += 1
            self._change_log.append((counter, enabled, reason, detail))
            _log.info("epoch %d: autocast %s: %s", counter, "on" if enabled else "off", detail)

    def stats(self) -> dict[str, Any]:
        """What the policy decided and why, as plain values (to log or print).

        Covers the calls this object answered (``load_state_dict`` does not
        bring a saved run's history; a restart is counted, not cleared).

        Returns:
            A dict with:

            * ``policy`` (0, 1 or 2) and ``schedule`` (``"time"``,
              ``"time + learning rate"`` or ``"loss trend"``);
            * ``settings``: the parameters that schedule and the scaler
              guard use, by the documents' table names;
            * ``thresholds``: the fixed numbers of those rules;
            * ``epochs_seen``, ``epochs_on``, ``epochs_off``: calls answered,
              and how many of them turned autocast on or off (a repeated
              counter counts once per call);
            * ``changes``: how many answers differed from the one before
              (before the first call autocast counts as off);
            * ``restarts`` (the counter went backwards) and ``guard_trips``;
            * ``last``: the newest entry of ``epochs``, or None;
            * ``epochs``: one dict per call, oldest first: ``epoch``,
              ``autocast``, ``reason`` (as :attr:`last_reason`) and
              ``detail`` (the rule and its numbers);
            * ``change_log``: one such dict per change, with ``message``,
              the line that was logged;
            * ``epochs_dropped``, ``changes_dropped``: the oldest entries
              not kept (each list keeps the newest 10000);
            * buffer protection (``model=``, :meth:`repair_buffers`):
              ``buffer_checks`` (checks of a model with floating-point
              buffers), ``buffers_watched`` (how many it had at the last
              check), ``buffer_restores`` (restores made) and
              ``buffer_log``: one dict per check that found non-finite
              buffers, oldest first (the newest 10000): ``epoch`` (the
              call's counter; for :meth:`repair_buffers` the last call's,
              None before the first), ``via`` (``"enable_mixed_precision"``
              or ``"repair_buffers"``), ``buffers`` (the non-finite ones'
              names), ``watched``, ``restored`` (False: no finite copy)
              ``copy_epoch`` and ``copy_via`` (when and by which method the
              restored copy was taken);
              ``buffer_log_dropped``, its oldest entries not kept.
        """
        c = self._engine.config()
        number = int(c["policy"])
        settings, thresholds = _settings(c)
        epochs = [
            {"epoch": e, "autocast": on, "reason": why, "detail": detail}
            for e, on, why, detail in self._epochs
        ]
        changes = [
            {
                "epoch": e,
                "autocast": on,
                "reason": why,
                "detail": detail,
                "message": f"epoch {e}: autocast {'on' if on else 'off'}: {detail}",
            }
            for e, on, why, detail in self._change_log
        ]
        return {
            "policy": number,
            "schedule": _SCHEDULES[number],
            "settings": settings,
            "thresholds": thresholds,
            "epochs_seen": self._calls,
            "epochs_on": self._calls_on,
            "epochs_off": self._calls - self._calls_on,
            "changes": self._changes,
            "restarts": self._restarts,
            "guard_trips": self._trips,
            "last": epochs[-1] if epochs else None,
            "epochs": epochs,
            "change_log": changes,
            "epochs_dropped": self._calls - len(epochs),
            "changes_dropped": self._changes - len(changes),
            "buffer_checks": self._buffer_checks,
            "buffers_watched": self._buffers_watched,
            "buffer_restores": self._buffer_restores,
            "buffer_log": [dict(r, buffers=list(r["buffers"])) for r in self._buffer_log],
            "buffer_log_dropped": self._buffer_findings - len(self._buffer_log),
        }

    @staticmethod
    def autocast_dtype(device_type: str = "cuda") -> torch.dtype:
        """The dtype to pass to ``torch.autocast`` on ``device_type``.

        ``torch.bfloat16`` on CPU and on CUDA devices that support it
        (Ampere and later), ``torch.float16`` elsewhere. bfloat16 has
        float32's exponent range, so it rarely overflows and needs no loss
        scaling (a GradScaler may still be used; it is harmless).

        Args:
            device_type: ``"cpu"``, ``"cuda"`` or another torch device type.

        Returns:
            The autocast dtype.
        """
        if not isinstance(device_type, str):
            raise TypeError(f"device_type must be a str, got {type(device_type).__name__}")
        kind = device_type.split(":", 1)[0]
        if kind == "cpu":
            return torch.bfloat16
        if kind == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float16

    @property
    def policy(self) -> int:
        """The policy number (0, 1 or 2)."""
        return int(self._engine.config()["policy"])

    @property
    def last_reason(self) -> str:
        """Why the last decision was made.

        One of ``none`` (no call yet), ``before_start``, ``window``,
        ``after_end``, ``hold``, ``trial``, ``trend_default``, ``trend_ok``,
        ``trend_fast``, ``trend_slow`` or ``cooldown``.
        """
        return str(self._engine.last_reason)

    @property
    def last_trip(self) -> Optional[str]:
        """What last tripped the scaler guard, or None.

        One of ``nonfinite_loss``, ``nonfinite_scale``, ``scale_floor``,
        ``scale_collapse``, ``overflow`` or ``nonfinite_buffers`` (the
        model's buffers, with a finite loss; the engine, and so
        :meth:`state_dict`, records it as ``nonfinite_loss``).
        """
        trip = self._engine.last_trip
        if trip == "nonfinite_loss" and self._buffer_trip == self._engine.state()["trips"]:
            return "nonfinite_buffers"
        return trip

    @property
    def cooling(self) -> bool:
        """Whether a scaler-guard cool-down is running."""
        return bool(self._engine.cooling)

    def state_dict(self) -> dict[str, Any]:
        """The policy's parameters and state as plain values (for ``torch.save``).

        The copy of the model's buffers (``model=``) is not included: it is
        the model's state, which the model's own ``state_dict`` saves.

        Returns:
            ``{"version": 1, "config": {...}, "state": {...}}``.
        """
        return {
            "version": _STATE_VERSION,
            "config": dict(self._engine.config()),
            "state": dict(self._engine.state()),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continues from a :meth:`state_dict` of a policy with the same parameters.

        The copy of the model's buffers (``model=``) is not part of the
        state: it is dropped here, and the next check takes a new one from
        the (presumably also reloaded) model.

        Args:
            state_dict: What :meth:`state_dict` returned.

        Raises:
            TypeError: ``state_dict`` or one of its fields has the wrong type.
            ValueError: A different version or different parameters, or an
                invalid state.
        """
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        for key in ("version", "config", "state"):
            if key not in state_dict:
                raise ValueError(f"state_dict is missing {key!r}")
        if state_dict["version"] != _STATE_VERSION:
            raise ValueError(
                f"state_dict version {state_dict['version']!r} is not {_STATE_VERSION}"
            )
        config, state = state_dict["config"], state_dict["state"]
        if not isinstance(config, dict) or not isinstance(state, dict):
            raise TypeError("state_dict['config'] and state_dict['state'] must be dicts")
        mine = dict(self._engine.config())
        if config != mine:
            diff = sorted(k for k in set(mine) | set(config) if mine.get(k) != config.get(k))
            raise ValueError(
                "state_dict was saved by a policy with other parameters: "
                + ", ".join(f"{k}={config.get(k)!r} (here {mine.get(k)!r})" for k in diff)
            )
        self._engine.load_state(state)
        self._forget()
        self._copies, self._layout, self._copy_epoch, self._copy_via = [], None, None, None
        self._pending_buffers = None

    def __repr__(self) -> str:
        c = self._engine.config()
        return (
            f"MixedPrecision_TrainingPolicy(policy={c['policy']}, start_time={c['start']}, "
            f"end_time={c['end']}, hold_time={c['hold']}, interval_time={c['interval']}, "
            f"interval_hold_time={c['interval_hold']}, cooldown={c['cooldown']})"
        )
