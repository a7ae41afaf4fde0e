"""Horovod's elastic API: ``hvd.elastic.run``, the states and the sampler.

A training function decorated with :func:`run` survives workers that leave
and join an elastic job (``tiaccrun --host-discovery-script ...``):

- a collective that fails because a worker died raises
  :class:`HorovodInternalError`; ``run`` restores the state to its last
  :meth:`State.commit`, starts Horovod again (the driver's next round, the
  remaining workers) and calls the function again;
- when the driver adds or removes hosts, the next :meth:`State.commit` (or
  :meth:`State.check_host_updates`) raises :class:`HostsUpdatedInterrupt`
  on every worker at once; ``run`` starts the new round, and workers that
  joined get the state from rank 0 (:meth:`State.sync`).

Outside an elastic job the decorator runs the function once as it is, and
a failure starts the same world again.
"""

from __future__ import annotations

import copy
import functools
import math
import random
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import _basics, _init, _rounds
from ._allgather import allgather_object
from ._broadcast import broadcast_object
from ._broadcast_state import broadcast_optimizer_state, broadcast_parameters
from ._exceptions import HorovodInternalError, HostsUpdatedInterrupt

__all__ = [
    "ElasticSampler",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "TorchState",
    "run",
]


class State:
    """What a training function keeps across the rounds of an elastic job.

    Subclasses say how to :meth:`save` (at each :meth:`commit`),
    :meth:`restore` (after a failed collective) and :meth:`sync` (from rank
    0 to every worker, after a round that added workers).

    Args:
        bcast_object: broadcasts a picklable object from rank 0.
        get_rank: this worker's rank now.
    """

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int]) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Functions called after each new round has started (before training resumes)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """A new round has started: :meth:`reset`, then the registered callbacks."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Saves the state, then raises if the driver changed the hosts.

        Raises:
            HostsUpdatedInterrupt: on every worker at the same commit, when
                the driver published a new round since this one started.
        """
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raises :class:`HostsUpdatedInterrupt` when the driver published a new round.

        Rank 0 reads the driver's newest round and broadcasts what it read,
        so that every worker raises at the same call (or none does).
        ``skip_sync`` is true when the new round only removed workers: each
        remaining worker holds the committed state already.
        """
        membership = _init.elastic_membership()
        if membership is None:
            return
        update = None
        if self._rank() == 0:
            latest = _rounds.latest_round(membership.store)
            if latest > membership.round:
                now = set(_rounds.members(membership.store, membership.round))
                later = set(_rounds.members(membership.store, latest))
                update = (latest, later <= now)
        update = self._bcast_object(update)
        if update is not None:
            raise HostsUpdatedInterrupt(skip_sync=update[1])

    def save(self) -> None:
        """Keeps the current values as the committed state."""
        raise NotImplementedError

    def restore(self) -> None:
        """Goes back to the committed state."""
        raise NotImplementedError

    def sync(self) -> None:
        """Makes every worker's state rank 0's."""
        raise NotImplementedError

    def reset(self) -> None:
        """Adapts to a new round (its size, its rank); nothing by default."""


class ObjectState(State):
    """A state of picklable attributes, given as keyword arguments.

    ``state = ObjectState(bcast_object, get_rank, epoch=0, batch=0)``: the
    attributes (``state.epoch``) are saved by :meth:`commit`, restored after
    a failure and broadcast from rank 0 by :meth:`sync`.
    """

    def __init__(
        self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int], **kwargs: Any
    ) -> None:
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        """Keeps the current values as the committed state."""
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self) -> None:
        """Goes back to the committed state."""
        self._set_attrs()

    def sync(self) -> None:
        """Makes every worker's state rank 0's."""
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, value)


class _Handler:
    """How one value of a :class:`TorchState` is saved, restored and synced."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.saved: Any = None
        self.save()

    def save(self) -> None:
        """Keeps the current values as the committed state."""
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        """Goes back to the committed state."""
        self.value.load_state_dict(self.saved)

    def sync(self) -> None:
        """Makes every worker's state rank 0's."""
        raise NotImplementedError

    def reset(self) -> None:
        """Adapts to a new round (its size, its rank)."""
        pass


class _ModelHandler(_Handler):
    def sync(self) -> None:
        """Makes every worker's state rank 0's."""
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def sync(self) -> None:
        """Makes every worker's state rank 0's."""
        broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_Handler):
    def sync(self) -> None:
        """Makes every worker's state rank 0's."""
        # Every index any worker processed counts as processed.
        processed: set[int] = set()
        for indices in allgather_object(self.value.processed_indices):
            processed |= set(indices)
        state = self.value.state_dict()
        state["processed_indices"] = processed
        self.value.load_state_dict(broadcast_object(state, root_rank=0))

    def reset(self) -> None:
        """Adapts to a new round (its size, its rank)."""
        self.value.reset()


def _handler_for(value: Any) -> _Handler | None:
    if isinstance(value, torch.nn.Module):
        return _ModelHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        return _OptimizerHandler(value)
    if isinstance(value, ElasticSampler):
        return _SamplerHandler(value)
    return None


class TorchState(ObjectState):
    """The state of a torch training loop: model, optimizer, sampler and attributes.

    ``TorchState(model, optimizer, epoch=0, batch=0)``: a module's and an
    optimizer's ``state_dict()`` are copied at each :meth:`commit`, loaded
    back by :meth:`restore` and broadcast from rank 0 by :meth:`sync`
    (``broadcast_parameters``, ``broadcast_optimizer_state``); an
    :class:`ElasticSampler` keeps the indices processed so far; any other
    keyword is a picklable attribute, as in :class:`ObjectState`.
    Assigning a new module or optimizer to the attribute is tracked.
    """

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers: dict[str, _Handler] = {}
        plain: dict[str, Any] = {}
        for name, value in kwargs.items():
            handler = _handler_for(value)
            if handler is None:
                plain[name] = value
            else:
                handlers[name] = handler
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=_basics.rank, **plain)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name] = _handler_for(value) or handlers[name]
            if handlers[name].value is not value:  # not a module/optimizer/sampler
                raise TypeError(
                    f"TorchState.{name} holds a {type(handlers[name].value).__name__}; "
                    f"got a {type(value).__name__}"
                )
        object.__setattr__(self, name, value)

    def save(self) -> None:
        """Keeps the current values as the committed state."""
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        """Goes back to the committed state."""
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        """Makes every worker's state rank 0's."""
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def reset(self) -> None:
        """Adapts to a new round (its size, its rank)."""
        for handler in self._handlers.values():
            handler.reset()
        super().reset()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorates a training function ``func(state, ...)`` to survive changes of the job.

    Before each call the state is synced from rank 0 (not after a round
    that only removed workers). On :class:`HorovodInternalError` the state
    is restored to its last commit; on either that or
    :class:`HostsUpdatedInterrupt`, Horovod starts again
    (``shutdown()``, ``init()``: the next round), the state's reset
    callbacks run and the function is called again. Its return value is
    returned.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        skip_sync = False
        while True:
            if not skip_sync:
                state.sync()
            try:
                return func(state, *args, **kwargs)
            except HorovodInternalError:
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as update:
                skip_sync = update.skip_sync
            _init.shutdown()
            _init.init()
            state.on_reset()

    return wrapper


class ElasticSampler(torch.utils.data.Sampler):
    """A sampler that shards what is left of an epoch over the current workers.

    Each worker iterates over its share of the indices not yet processed in
    this epoch; :meth:`record_batch` (or :meth:`record_indices`) marks what
    was trained on, and a new round (:meth:`reset`) shares the rest out
    again over the new number of workers. Kept in a :class:`TorchState`,
    the processed indices are committed, restored and merged across
    workers with it.

    Args:
        dataset: what is sampled (its length is used).
        shuffle: shuffle the indices each epoch (the same order on every
            worker: seeded by ``seed + epoch``).
        seed: the shuffle's seed.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.indices: list[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Starts epoch ``epoch``: nothing of it processed yet."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """This worker's indices of batch ``batch_idx`` (of ``batch_size``) in this round."""
        start = batch_idx * batch_size
        return self.indices[start : min(start + batch_size, len(self.indices))]

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Marks this worker's batch ``batch_idx`` as processed."""
        self.record_indices(self.get_indices(batch_idx, batch_size))

    def record_indices(self, indices: Any) -> None:
        """Marks ``indices`` as processed."""
        self.processed_indices.update(int(i) for i in indices)

    def state_dict(self) -> dict[str, Any]:
        """The epoch and the indices processed in it."""
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Takes an epoch and its processed indices, and shares out the rest."""
        self.epoch = int(state_dict["epoch"])
        self.processed_indices = set(state_dict["processed_indices"])
        self.reset()

    def reset(self) -> None:
        """Shares the unprocessed indices out over the current workers."""
        initialized = _basics.is_initialized()
        self.num_replicas = _basics.size() if initialized else 1
        self.rank = _basics.rank() if initialized else 0
        self.remaining_indices = [
            i for i in range(len(self.dataset)) if i not in self.processed_indices
        ]
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(self.remaining_indices)
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        padded = list(self.remaining_indices)
        if padded:
            while len(padded) < self.total_size:
                padded += padded[: self.total_size - len(padded)]
        self.indices = padded[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
