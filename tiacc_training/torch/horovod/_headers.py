"""What the ranks exchange about their operations: headers, keys and a cycle's blocks.

Each rank describes an operation it submits (a :class:`Call`) by a
fixed-size header of integers: the kind of operation, its name, reduction,
root, scale factors, the dtype, shape and device of each tensor (a digest,
and the first tensor in full for the message), whether this rank refused
its own arguments, and which fused buffers an allreduce will reduce, so
joined ranks can take part with zeros. Operations are matched across ranks
by a key read from the header: its kind and name, or, for an operation
without a name, its place among the set's unnamed operations.

A *cycle* is one allgather among a set's ranks of a block per rank
(:class:`Block`): whether it is inside ``hvd.join()``, whether it waits,
whether it went ahead, how many operations it queued, its next unnamed
number, and the headers of its first :data:`ROWS` operations (the rest in
a second allgather, only when some rank queued more). What comes back for
an operation the ranks agreed on is an :class:`Agreement`.

Nothing here talks to the other ranks.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ._common import DESCRIPTION, describe
from ._process_sets import ProcessSet

# A block's state: the rank runs operations, or it is inside ``join()``.
ACTIVE, JOINED = 0, 1
# A header's status: this rank's arguments are fine, or it refused them.
OK, REFUSED = 0, 1
KINDS = {
    "allreduce": 1,
    "grouped_allreduce": 1,
    "allgather": 2,
    "grouped_allgather": 2,
    "broadcast": 3,
    "alltoall": 4,
    "reducescatter": 5,
    "grouped_reducescatter": 5,
    "barrier": 6,
    "process_set": 7,
}
KIND_NAMES = {1: "allreduce", 2: "allgather", 3: "broadcast", 4: "alltoall",
              5: "reducescatter", 6: "barrier", 7: "process_set"}  # fmt: skip
ALLREDUCE_KIND = 1
MAX_BUFFERS = 6
# Header fields (NAME: the name's digest, or the unnamed operation's number).
STATUS, KIND, OP, ROOT, PRE, POST, COUNT, DIGEST, NAMED, NAME, PAYLOAD = range(11)
FIRST = 11
BUFFERS = FIRST + DESCRIPTION
WIDTH = BUFFERS + 1 + 4 * MAX_BUFFERS
# A cycle's block per rank: its state, whether it waits, whether it went
# ahead, how many operations it queued, its next unnamed number, then the
# headers of its first ROWS operations.
STATE, WAITING, AHEAD, QUEUED, NEXT = range(5)
LEAD = 5
ROWS = 2

# What operations are matched by: (named, kind, name digest) or (0, 0, number).
Key = tuple[int, int, int]


@dataclass
class Call:
    """One rank's side of an operation, as the ranks compare it."""

    kind: str
    name: str
    named: bool
    process_set: ProcessSet
    tensors: Sequence[torch.Tensor] = ()
    skip_first: bool = False
    op: int = 0
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    # Numbers every rank needs from every other (first dimensions, splits).
    payload: list[int] = field(default_factory=list)
    # An allreduce's fused buffers: (dtype code, elements, tensors, on cuda).
    buffers: Sequence[Sequence[int]] = ()
    # This rank's own error with its arguments, raised once the ranks met.
    refusal: BaseException | None = None

    @property
    def what(self) -> str:
        """The call in messages: its kind and name."""
        return f"{self.kind} {self.name!r}"


@dataclass
class Agreement:
    """What the ranks agreed on: every rank's payload (first dimensions, splits)."""

    payloads: list[list[int]]


@dataclass
class Block:
    """One rank's block of a cycle."""

    state: int
    waiting: bool
    ahead: bool
    next: int
    rows: list[list[int]]


def to_bits(value: float) -> int:
    """A float's bits as an integer (scale factors travel so in a header)."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def to_float(bits: int) -> float:
    """The float whose bits :func:`to_bits` gave."""
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def key_of(call: Call) -> tuple[int, str, str]:
    """The key of a named operation in flight (process set id, kind, name)."""
    return (int(call.process_set.process_set_id or 0), call.kind, call.name)


def row_key(row: Sequence[int]) -> Key:
    """The key operations are matched by: kind and name, or the unnamed number."""
    if row[NAMED]:
        return (1, row[KIND], row[NAME])
    return (0, 0, row[NAME])


def header(call: Call, number: int) -> list[int]:
    """This rank's header for ``call`` (``call.refusal`` is set when it cannot be described).

    Args:
        call: this rank's side.
        number: the call's place among the set's unnamed operations (unused when named).
    """
    descriptions: list[int] = []
    if call.refusal is None:
        try:
            for tensor in call.tensors:
                descriptions.extend(describe(tensor, call.skip_first))
            if len(call.buffers) > MAX_BUFFERS:
                raise ValueError(
                    f"{call.what}: tensors of more than {MAX_BUFFERS} dtypes/devices in one "
                    "operation"
                )
        except (TypeError, ValueError) as error:
            call.refusal = error
    name = zlib.crc32(call.name.encode()) if call.named else number
    if call.refusal is not None:
        row = [REFUSED, KINDS[call.kind], 0, 0, 0, 0, 0, 0, int(call.named), name]
        return row + [0] * (WIDTH - len(row))
    digest = zlib.crc32(struct.pack(f"<{len(descriptions)}q", *descriptions))
    row = [OK, KINDS[call.kind], call.op, call.root, to_bits(call.prescale),
           to_bits(call.postscale), len(call.tensors), digest, int(call.named), name,
           len(call.payload)]  # fmt: skip
    first = descriptions[:DESCRIPTION]
    row += first + [0] * (DESCRIPTION - len(first))
    row.append(len(call.buffers))
    for buffer in call.buffers:
        row.extend(buffer)
    return row + [0] * (WIDTH - len(row))


def buffers_of(row: Sequence[int]) -> list[tuple[int, int, int, bool]]:
    """The fused buffers an allreduce's header describes: (dtype code, elements, tensors, cuda)."""
    found = []
    for b in range(row[BUFFERS]):
        first = BUFFERS + 1 + 4 * b
        code, numel, count, cuda = row[first : first + 4]
        found.append((code, numel, count, bool(cuda)))
    return found


def pack_block(
    joined: bool, waiting: bool, ahead: bool, next_number: int, rows: list[list[int]]
) -> list[int]:
    """A rank's block of a cycle: its lead, then its first :data:`ROWS` headers.

    Args:
        joined: the rank is inside ``join()``.
        waiting: the rank waits for an operation.
        ahead: the rank issued an allreduce without waiting (its one header).
        next_number: the rank's next unnamed number.
        rows: the headers of the operations it queued.
    """
    lead = [JOINED if joined else ACTIVE, int(waiting), int(ahead), len(rows), next_number]
    first = [v for row in rows[:ROWS] for v in row]
    return lead + first + [0] * (ROWS * WIDTH - len(first))


def pack_rest(rows: list[list[int]], most: int) -> list[int]:
    """The headers past a block's first :data:`ROWS`, padded to ``most`` queued operations."""
    rest = [v for row in rows[ROWS:] for v in row]
    return rest + [0] * ((most - ROWS) * WIDTH - len(rest))


def parse_block(values: list[int]) -> Block:
    """A rank's block from what the cycle's allgather brought (its first headers only)."""
    count = min(values[QUEUED], ROWS)
    rows = [values[LEAD + i * WIDTH : LEAD + (i + 1) * WIDTH] for i in range(count)]
    return Block(values[STATE], bool(values[WAITING]), bool(values[AHEAD]), values[NEXT], rows)


def add_rest(block: Block, queued: int, rest: list[int]) -> None:
    """Adds to ``block`` its headers past the first :data:`ROWS` (``queued`` in all)."""
    block.rows += [rest[i * WIDTH : (i + 1) * WIDTH] for i in range(max(0, queued - ROWS))]
