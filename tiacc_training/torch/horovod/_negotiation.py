"""Where an operation enters the ranks' negotiation: checked, refused or queued on its set.

The ranks agree on which operation runs next by matching operations by
name. Every operation comes through :func:`schedule`, which queues this
rank's side of it (a :class:`._headers.Call`) on its set's coordinator
(:mod:`._cycles`) and runs one cycle; the operation's collectives are
issued once every rank of the set queued it and the ranks' verdict
(:mod:`._verdicts`) lets it run.

A second operation of one kind under a name still in flight on this rank
raises ``ValueError`` at once, on this rank only (Horovod's rule); nothing
is queued. A rank whose own arguments are wrong still queues the call, as
a refusal (:func:`refuse`), so the other ranks' calls meet it and fail too.
"""

from __future__ import annotations

from typing import Any, Callable

from . import _handles
from ._cycles import Prepare, coordinator_of, lock
from ._exceptions import HorovodInternalError
from ._headers import Agreement, Call, key_of
from ._process_sets import ProcessSet, global_process_set
from ._verdicts import duplicate_name


def schedule(call: Call, prepare: Prepare | None, defer: bool = False) -> _handles.Pending:
    """Queues ``call`` on its set and runs one cycle; returns its pending operation.

    The pending operation's collectives are issued once every rank has the
    call (maybe in this very cycle); ``synchronize`` on it runs cycles until
    then, and raises the error the ranks' verdict gave it. A named call's
    pending operation carries its key, so that its name is in flight once it
    is registered (not a refusal's: :func:`refuse` completes it at once).

    Args:
        call: this rank's side.
        prepare: issues the operation's collectives, given what the ranks
            agreed on (``None`` for a call refused here, which only reports).
        defer: an allreduce that may go ahead without waiting for the cycle
            (when named and agreed before).

    Raises:
        ValueError: a named call whose name is still in flight on this rank.
        HorovodInternalError: the cycle's exchange failed.
    """
    if call.refusal is None and call.named and _handles.in_flight(key_of(call)):
        raise duplicate_name(call)
    with lock:
        coordinator = coordinator_of(call.process_set)
        number = -1
        if not call.named:
            number = coordinator.next
            coordinator.next += 1
        entry = coordinator.entry_of(call, prepare, number)
        if call.named and prepare is not None:  # not a refusal: its handle is registered
            entry.shell.key = key_of(call)
        if len(call.process_set.ranks) == 1:
            coordinator.run_alone(entry)
        elif defer and coordinator.can_go_ahead(entry):
            coordinator.go_ahead(entry)
        else:
            coordinator.queue.append(entry)
            coordinator.cycle(waiting=False)
    return entry.shell


def exchange_ints(kind: str, values: list[int], process_set: ProcessSet) -> list[list[int]]:
    """Every rank's ``values`` (one length everywhere), matched like an operation.

    Queued behind this rank's operations on the set, so it pairs with the
    other ranks' call of the same kind at the same place whatever they
    still have in flight (``add_process_set`` compares the ranks' sets so).
    """
    name = _handles.name_of(kind, None)
    call = Call(kind, name, False, process_set, payload=list(values))

    def prepare(agreed: Agreement) -> _handles.Pending:
        return _handles.Pending([], lambda: agreed.payloads, name, kind.upper())

    return _handles.complete(schedule(call, prepare))


def exchange_joined() -> None:
    """``join()``'s part: serves the global set's allreduces with zeros until every rank joined.

    This rank's own operations on the global set run first (their handles
    stay valid).
    """
    coordinator = coordinator_of(global_process_set)
    if len(coordinator.process_set.ranks) > 1:
        coordinator.serve_joined()


def refuse(
    kind: str, name: str, process_set: ProcessSet, error: BaseException, named: bool = False
) -> None:
    """Tells the set's other ranks this rank refused its arguments; raises ``error``.

    The refusal is queued as the call would have been and raised once the
    other ranks' calls met it (they raise :class:`HorovodInternalError`).
    """
    call = Call(kind, name, named, process_set, refusal=error)
    _handles.complete(schedule(call, None))
    raise error  # the verdict raised it already; for the type checker


def attempt(check: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    """``check()``'s value, or its argument error (to be refused after the exchange)."""
    try:
        return check(), None
    except (TypeError, ValueError, HorovodInternalError) as error:
        return None, error


def check_or_refuse(kind: str, name: str, process_set: ProcessSet, check: Callable[[], Any]) -> Any:
    """``check()``'s value; its argument error is refused on every rank (:func:`refuse`)."""
    value, error = attempt(check)
    if error is not None:
        refuse(kind, name, process_set, error)
    return value
