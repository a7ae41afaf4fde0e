"""One rank of a job that checks Horovod's collectives (``tiacc_training.torch.horovod``).

Started by ``test_horovod_ops.py``, with torchrun's variables, Horovod's
only, or none (alone). ``--suite full`` checks every op, dtype, reduction,
async handles, grouped and sparse ops, objects, join, autograd, Adasum and
bad input (with 4 ranks also process sets, one given to ``init``);
``--suite basics`` the layout, an allreduce, ``shutdown`` and ``init``
again; ``--suite duplicate-names`` Horovod's duplicate-name rule for every
operation that takes a name (also in the order Horovod's own suite calls
it, which must leave the job in step); ``--suite step-warning`` the
warning of ``step()`` after an explicit ``synchronize()``.
``--preinit``: the script makes the default group (the two lines,
then its own ``init_process_group``) before ``hvd.init()``.
``--peer-exit``: at the end rank 1 leaves and rank 0 expects
``HorovodInternalError``. Each check compares the result with a reference
computed here from every rank's input, which every rank can generate. The
last line is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _launch import exit_failed  # noqa: E402

import tiacc_training.torch.horovod as hvd  # noqa: E402
from tiacc_training.torch.distributed import _backend  # noqa: E402

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int32, torch.int64]
checks: list[str] = []


def expect(got: Any, want: Any, what: str, atol: float = 0.0) -> None:
    """Equality (dtype, shape and values; ``atol`` for float tolerances), or an error."""
    if isinstance(want, torch.Tensor):
        ok = (
            isinstance(got, torch.Tensor)
            and got.dtype == want.dtype
            and got.shape == want.shape
            and (
                torch.equal(got, want)
                if atol == 0.0
                else torch.allclose(got.double(), want.double(), atol=atol, rtol=0)
            )
        )
    else:
        ok = got == want
    if not ok:
        raise AssertionError(f"rank {hvd.rank()}: {what}: got {got!r}, want {want!r}")
    checks.append(what)


def raises(kind: type[BaseException], text: str, call: Callable[[], Any], what: str) -> None:
    """``call`` raises ``kind`` with ``text`` in its message."""
    try:
        call()
    except kind as error:
        if text not in str(error):
            raise AssertionError(f"{what}: {kind.__name__} without {text!r}: {error}") from error
        checks.append(what)
        return
    raise AssertionError(f"{what}: no {kind.__name__} raised")


def data(rank: int, dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: small integers in [-3, 3] every dtype holds exactly."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randint(-3, 4, shape, generator=g).to(dtype)


def reduce_ref(
    op: Any, dtype: torch.dtype, n: int, shape: tuple[int, ...], seed: int
) -> torch.Tensor:
    stack = torch.stack([data(r, dtype, shape, seed).double() for r in range(n)])
    if op is hvd.Sum:
        out = stack.sum(0)
    elif op is hvd.Min:
        out = stack.min(0).values
    elif op is hvd.Max:
        out = stack.max(0).values
    elif op is hvd.Product:
        out = stack.prod(0)
    else:  # Average: the sum over the size, integers rounded toward zero
        out = stack.sum(0) / n
        if not dtype.is_floating_point:
            out = out.trunc()
    return out.to(dtype)


def check_basics(n: int, me: int) -> None:
    expect(hvd.size(), n, "size")
    expect(hvd.rank(), me, "rank")
    expect(hvd.local_size(), n, "local_size (one host)")
    expect(hvd.local_rank(), me, "local_rank")
    expect((hvd.cross_rank(), hvd.cross_size()), (0, 1), "cross rank and size (one host)")
    expect(hvd.is_homogeneous(), True, "is_homogeneous")
    expect(
        (hvd.mpi_built(), hvd.mpi_enabled(), hvd.ddl_built(), hvd.ccl_built()),
        (False, False, False, False),
        "no MPI, DDL, CCL",
    )
    expect(hvd.gloo_built(), True, "gloo built")
    expect(hvd.cuda_built(), torch.version.cuda is not None, "cuda_built")
    hvd.init()  # a second call does nothing
    expect(hvd.size(), n, "second init is a no-op")


def check_allreduce(n: int, me: int) -> None:
    shape = (5, 3)
    for seed, dtype in enumerate(FLOATS + INTS):
        for op in (hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product):
            x = data(me, dtype, shape, seed)
            before = x.clone()
            got = hvd.allreduce(x, op=op)
            expect(got, reduce_ref(op, dtype, n, shape, seed), f"allreduce {dtype} {op!r}")
            expect(x, before, f"allreduce leaves its input ({dtype} {op!r})")
        y = data(me, dtype, shape, seed)
        same = hvd.allreduce_(y, op=hvd.Sum, name=f"inplace.{dtype}")
        expect(same is y, True, f"allreduce_ returns its tensor ({dtype})")
        expect(y, reduce_ref(hvd.Sum, dtype, n, shape, seed), f"allreduce_ {dtype}")
    # The default op is Average, and average= still works.
    x = data(me, torch.float32, shape, 7)
    expect(hvd.allreduce(x), reduce_ref(hvd.Average, torch.float32, n, shape, 7), "default op")
    expect(
        hvd.allreduce(x, average=False),
        reduce_ref(hvd.Sum, torch.float32, n, shape, 7),
        "average=False",
    )
    # Scale factors: float and integer (scaled in float64, rounded toward zero).
    stack = torch.stack([data(r, torch.float64, shape, 8) for r in range(n)])
    want = (stack * 0.5).sum(0) * 3.0
    expect(
        hvd.allreduce(
            data(me, torch.float32, shape, 8), op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0
        ),
        want.float(),
        "allreduce prescale/postscale",
    )
    ints = torch.stack([data(r, torch.int64, shape, 8) for r in range(n)])
    want_int = (ints.double() * 1.5).trunc().sum(0)
    want_int = (want_int * (0.5 / n)).trunc().long()
    expect(
        hvd.allreduce(
            data(me, torch.int64, shape, 8),
            op=hvd.Average,
            prescale_factor=1.5,
            postscale_factor=0.5,
        ),
        want_int,
        "integer Average with scale factors",
    )
    # Through fp16 on the wire: back in float32, the values are small integers (exact).
    got = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16)
    expect(got, reduce_ref(hvd.Sum, torch.float32, n, shape, 7), "allreduce with fp16 compression")
    # A non-contiguous tensor in place.
    z = data(me, torch.float32, (3, 4), 9).t()
    hvd.allreduce_(z, op=hvd.Sum)
    want_t = torch.stack([data(r, torch.float32, (3, 4), 9) for r in range(n)]).sum(0).t()
    expect(z, want_t, "allreduce_ of a transposed tensor")


def check_async(n: int, me: int) -> None:
    shape = (64,)
    handles = []
    for i in range(4):
        handles.append(
            hvd.allreduce_async(
                data(me, torch.float32, shape, 20 + i), op=hvd.Sum, name=f"async.{i}"
            )
        )
    inplace = data(me, torch.float64, shape, 30)
    h_inplace = hvd.allreduce_async_(inplace, op=hvd.Max)
    deadline = time.monotonic() + 60
    while not all(hvd.poll(h) for h in handles) and time.monotonic() < deadline:
        time.sleep(0.01)
    expect(all(hvd.poll(h) for h in handles), True, "poll says done")
    expect(isinstance(handles[0], int), True, "handles are ints")
    for i, h in enumerate(handles):
        expect(
            hvd.synchronize(h),
            reduce_ref(hvd.Sum, torch.float32, n, shape, 20 + i),
            f"allreduce_async {i}",
        )
    out = hvd.synchronize(h_inplace)
    expect(out is inplace, True, "allreduce_async_ returns its tensor")
    expect(inplace, reduce_ref(hvd.Max, torch.float64, n, shape, 30), "allreduce_async_ Max")
    raises(ValueError, "unknown", lambda: hvd.synchronize(handles[0]), "synchronize twice")
    # A name seen before with the same shape: the shape exchange is not waited for.
    for step in range(3):
        bufs = [data(me, torch.float32, (6,), 200 + step + k) for k in range(2)]
        hs = [hvd.allreduce_async_(b, name=f"repeat.{k}", op=hvd.Sum) for k, b in enumerate(bufs)]
        for k, h in enumerate(hs):
            got = hvd.synchronize(h)
            want = reduce_ref(hvd.Sum, torch.float32, n, (6,), 200 + step + k)
            expect(got, want, f"named allreduce {k} step {step}")
    # Broadcast and allgather asynchronously.
    b = hvd.broadcast_async(data(me, torch.float32, (4,), 31), root_rank=n - 1)
    g = hvd.allgather_async(data(me, torch.float32, (me + 1, 2), 32))
    expect(hvd.synchronize(b), data(n - 1, torch.float32, (4,), 31), "broadcast_async")
    want = torch.cat([data(r, torch.float32, (r + 1, 2), 32) for r in range(n)])
    expect(hvd.synchronize(g), want, "allgather_async")


def check_grouped(n: int, me: int) -> None:
    shapes = [(3,), (2, 2), (5,), (1, 3)]
    dtypes = [torch.float32, torch.float32, torch.int64, torch.float64]
    before = _backend.served_in_process["allreduce"]
    outs = hvd.grouped_allreduce(
        [data(me, d, s, 40 + i) for i, (d, s) in enumerate(zip(dtypes, shapes))],
        op=hvd.Sum,
        name="grouped",
    )
    for i, (d, s) in enumerate(zip(dtypes, shapes)):
        expect(outs[i], reduce_ref(hvd.Sum, d, n, s, 40 + i), f"grouped_allreduce {i}")
    # One fused collective per dtype (three dtypes), all on the engine.
    expect(_backend.served_in_process["allreduce"] - before, 3, "grouped_allreduce fuses per dtype")
    ts = [data(me, torch.float32, (4,), 50), data(me, torch.float32, (2, 3), 51)]
    same = hvd.grouped_allreduce_(ts, op=hvd.Average)
    expect(same[0] is ts[0], True, "grouped_allreduce_ returns its tensors")
    expect(ts[1], reduce_ref(hvd.Average, torch.float32, n, (2, 3), 51), "grouped_allreduce_")
    h = hvd.grouped_allreduce_async([data(me, torch.int32, (3,), 52)], op=hvd.Min)
    expect(
        hvd.synchronize(h)[0],
        reduce_ref(hvd.Min, torch.int32, n, (3,), 52),
        "grouped_allreduce_async",
    )
    gathered = hvd.grouped_allgather(
        [data(me, torch.int64, (me + 1,), 53), data(me, torch.float16, (2, 2), 54)]
    )
    expect(
        gathered[0],
        torch.cat([data(r, torch.int64, (r + 1,), 53) for r in range(n)]),
        "grouped_allgather 0",
    )
    expect(
        gathered[1],
        torch.cat([data(r, torch.float16, (2, 2), 54) for r in range(n)]),
        "grouped_allgather 1",
    )
    rows = 2 * n + 1
    blocks = hvd.grouped_reducescatter(
        [data(me, torch.float32, (rows, 2), 55), data(me, torch.float64, (n,), 56)], op=hvd.Sum
    )
    full = reduce_ref(hvd.Sum, torch.float32, n, (rows, 2), 55)
    expect(blocks[0], full[_rows_of(me, rows, n)], "grouped_reducescatter 0")
    expect(
        blocks[1],
        reduce_ref(hvd.Sum, torch.float64, n, (n,), 56)[me : me + 1],
        "grouped_reducescatter 1",
    )


def sparse_input(rank: int) -> torch.Tensor:
    """Rank ``rank``'s sparse 5x3 tensor: ``rank + 1`` entries, some shared."""
    rows = torch.tensor([(rank + k) % 5 for k in range(rank + 1)])
    cols = torch.tensor([k % 3 for k in range(rank + 1)])
    values = torch.arange(rank + 1, dtype=torch.float32) + 1 + 10 * rank
    return torch.sparse_coo_tensor(torch.stack([rows, cols]), values, (5, 3))


def check_sparse(n: int, me: int) -> None:
    dense = torch.stack([sparse_input(r).to_dense() for r in range(n)]).sum(0)
    for op, want in ((hvd.Sum, dense), (hvd.Average, dense / n)):
        got = hvd.synchronize(hvd.sparse_allreduce_async(sparse_input(me), name="sparse", op=op))
        expect(got.is_sparse, True, f"sparse_allreduce_async {op!r} is sparse")
        expect(got.to_dense(), want, f"sparse_allreduce_async {op!r}")


def _rows_of(me: int, rows: int, n: int) -> slice:
    """Horovod's split: the first ``rows % n`` ranks get one more row."""
    base, extra = divmod(rows, n)
    counts = [base + (1 if r < extra else 0) for r in range(n)]
    start = sum(counts[:me])
    return slice(start, start + counts[me])


def check_allgather_broadcast(n: int, me: int) -> None:
    for seed, dtype in enumerate(FLOATS + INTS):
        x = data(me, dtype, (me + 1, 3), 60 + seed)  # uneven first dimensions
        want = torch.cat([data(r, dtype, (r + 1, 3), 60 + seed) for r in range(n)])
        expect(hvd.allgather(x), want, f"allgather uneven {dtype}")
        even = hvd.allgather(data(me, dtype, (2,), 70 + seed))
        expect(
            even,
            torch.cat([data(r, dtype, (2,), 70 + seed) for r in range(n)]),
            f"allgather even {dtype}",
        )
        for root in range(n):
            y = data(me, dtype, (4, 2), 80 + seed)
            expect(
                hvd.broadcast(y, root_rank=root),
                data(root, dtype, (4, 2), 80 + seed),
                f"broadcast {dtype} from {root}",
            )
            expect(y, data(me, dtype, (4, 2), 80 + seed), f"broadcast leaves its input {dtype}")
        z = data(me, dtype, (3,), 90 + seed)
        expect(hvd.broadcast_(z, root_rank=n - 1) is z, True, "broadcast_ returns its tensor")
        expect(z, data(n - 1, dtype, (3,), 90 + seed), f"broadcast_ {dtype}")


def check_alltoall_reducescatter(n: int, me: int) -> None:
    def rows(src: int, dst: int) -> int:
        return (src + 2 * dst) % 3  # zero rows included

    def block(src: int, dst: int, dtype: torch.dtype) -> torch.Tensor:
        k = rows(src, dst)
        base = torch.arange(k * 2).reshape(k, 2) + 100 * src + 10 * dst
        return base.to(dtype)

    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        send = torch.cat([block(me, j, dtype) for j in range(n)])
        splits = [rows(me, j) for j in range(n)]
        out, received = hvd.alltoall(send, splits=splits)
        expect(out, torch.cat([block(s, me, dtype) for s in range(n)]), f"alltoall uneven {dtype}")
        expect(
            received,
            torch.tensor([rows(s, me) for s in range(n)], dtype=torch.int32),
            f"alltoall received splits {dtype}",
        )
    equal = torch.arange(2 * n).float() + 100 * me
    got = hvd.alltoall(equal)
    want = torch.cat([torch.arange(2 * n).float()[2 * me : 2 * me + 2] + 100 * s for s in range(n)])
    expect(got, want, "alltoall equal splits")
    h = hvd.alltoall_async(equal, splits=torch.tensor([2] * n))
    out, received = hvd.synchronize(h)
    expect(out, want, "alltoall_async")
    expect(received, torch.full((n,), 2, dtype=torch.int32), "alltoall_async splits")
    for rows_total in (2 * n, 2 * n + 1, n - 1):
        for op in (hvd.Sum, hvd.Average):
            for dtype in (torch.float32, torch.int32):
                x = data(me, dtype, (rows_total, 3), 110 + rows_total)
                full = reduce_ref(op, dtype, n, (rows_total, 3), 110 + rows_total)
                expect(
                    hvd.reducescatter(x, op=op),
                    full[_rows_of(me, rows_total, n)],
                    f"reducescatter {rows_total} rows {op!r} {dtype}",
                )
    x = data(me, torch.float32, (n, 2), 120)
    h = hvd.reducescatter_async(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
    full = reduce_ref(hvd.Sum, torch.float32, n, (n, 2), 120) * 0.5
    expect(hvd.synchronize(h), full[me : me + 1], "reducescatter_async with scale factors")


def check_objects_barrier_join(n: int, me: int) -> None:
    obj = {"rank": me, "name": f"r{me}", "list": list(range(me + 1))}
    expect(
        hvd.broadcast_object(obj, root_rank=n - 1),
        {"rank": n - 1, "name": f"r{n - 1}", "list": list(range(n))},
        "broadcast_object",
    )
    expect(
        hvd.allgather_object(obj),
        [{"rank": r, "name": f"r{r}", "list": list(range(r + 1))} for r in range(n)],
        "allgather_object",
    )
    hvd.barrier()
    # The last rank joins only once every other rank has (it watches the join's counter).
    import torch.distributed as dist

    if me == n - 1:
        store = dist.distributed_c10d._get_default_store()
        deadline = time.monotonic() + 60
        while store.add("tiacc_training/horovod/join.0/count", 0) < n - 1:
            if time.monotonic() > deadline:
                raise AssertionError("the other ranks did not join")
            time.sleep(0.01)
    expect(hvd.join(), n - 1, "join returns the last rank to join")
    again = hvd.join()
    expect(hvd.allgather_object(again), [again] * n, "a second join agrees on every rank")
    expect(0 <= again < n, True, "a second join names a rank")


def check_join_uneven(n: int, me: int) -> None:
    """Rank r runs r + 1 allreduces, then joins; the joined ranks add zeros."""
    for k in range(me + 1):
        x = torch.full((5,), float(me + 1))
        got = hvd.allreduce(x, op=hvd.Sum, name=f"uneven.{k}")
        # Ranks k .. n-1 are still working at the k-th allreduce.
        expect(got, torch.full((5,), float(sum(r + 1 for r in range(k, n)))), f"join: sum {k}")
        avg = hvd.allreduce(torch.full((3,), 8.0 * (me + 1)), op=hvd.Average)
        want = 8.0 * sum(r + 1 for r in range(k, n)) / n
        expect(avg, torch.full((3,), want), f"join: average {k} over the job's size")
    if me == n - 1:
        # Alone now: a grouped allreduce of two dtypes, Adasum (zeros change nothing),
        # and an operation join does not serve.
        ints, floats = hvd.grouped_allreduce(
            [torch.tensor([1, 2], dtype=torch.int64), torch.tensor([0.5])], op=hvd.Sum
        )
        expect(ints, torch.tensor([1, 2], dtype=torch.int64), "join: grouped int")
        expect(floats, torch.tensor([0.5]), "join: grouped float")
        v = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
        expect(hvd.allreduce(v, op=hvd.Adasum), v, "join: Adasum of one working rank", atol=1e-12)
        raises(
            hvd.HorovodInternalError,
            "called hvd.join()",
            lambda: hvd.broadcast(v, 0),
            "join: broadcast",
        )
    expect(hvd.join(), n - 1, "join after uneven work names the busiest rank")


def check_autograd(n: int, me: int) -> None:
    w = [data(r, torch.float64, (4,), 130) for r in range(n)]
    for op in (hvd.Sum, hvd.Average):
        x = data(me, torch.float64, (4,), 131).requires_grad_()
        y = hvd.allreduce(x, op=op, postscale_factor=2.0)
        (y * w[me]).sum().backward()
        want = torch.stack(w).sum(0) * 2.0
        if op is hvd.Average:
            want = want / n
        expect(x.grad, want, f"allreduce gradient {op!r}")
    # allgather: this rank's rows of the averaged gradient (as Horovod's).
    x = data(me, torch.float64, (me + 1, 2), 132).requires_grad_()
    total = sum(r + 1 for r in range(n))
    c = [data(r, torch.float64, (total, 2), 133) for r in range(n)]
    (hvd.allgather(x) * c[me]).sum().backward()
    start = sum(r + 1 for r in range(me))
    expect(x.grad, torch.stack(c).mean(0)[start : start + me + 1], "allgather gradient")
    # reducescatter: the gathered gradient, times the size for Sum (as Horovod's).
    for op, factor in ((hvd.Sum, n), (hvd.Average, 1)):
        x = data(me, torch.float64, (2 * n, 3), 137).requires_grad_()
        block = hvd.reducescatter(x, op=op)
        (block * w[me][0]).sum().backward()
        want = torch.cat([torch.full((2, 3), float(w[r][0]) * factor) for r in range(n)])
        expect(x.grad, want.double(), f"reducescatter gradient {op!r}")
    # broadcast: the averaged gradient on the root, zero elsewhere.
    root = n - 1
    x = data(me, torch.float64, (4,), 134).requires_grad_()
    (hvd.broadcast(x, root_rank=root) * w[me]).sum().backward()
    want = torch.stack(w).mean(0) if me == root else torch.zeros(4, dtype=torch.float64)
    expect(x.grad, want, "broadcast gradient")
    # alltoall: the gradient goes back to its sender.
    splits = [(me + j) % 2 + 1 for j in range(n)]
    x = data(me, torch.float64, (sum(splits), 3), 135).requires_grad_()
    out, received = hvd.alltoall(x, splits=splits)
    weights = [
        data(r, torch.float64, (sum((s + r) % 2 + 1 for s in range(n)), 3), 136) for r in range(n)
    ]
    (out * weights[me]).sum().backward()
    pieces = []
    for j in range(n):  # the rows this rank sent to j sit in j's output after earlier senders
        offset = sum((s + j) % 2 + 1 for s in range(me))
        pieces.append(weights[j][offset : offset + splits[j]])
    expect(x.grad, torch.cat(pieces), "alltoall gradient")


def adasum_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The definition, in float64."""
    ab, aa, bb = (a * b).sum(), (a * a).sum(), (b * b).sum()
    ca = 1 - ab / (2 * aa) if aa > 0 else torch.tensor(1.0, dtype=torch.float64)
    cb = 1 - ab / (2 * bb) if bb > 0 else torch.tensor(1.0, dtype=torch.float64)
    return ca * a + cb * b


def adasum_tree(vectors: list[torch.Tensor]) -> torch.Tensor:
    """Pairs (0,1), (2,3), ... then their results, after folding ranks above a power of two."""
    n = len(vectors)
    p = 1 << (n.bit_length() - 1)
    level = [adasum_pair(vectors[i], vectors[i + p]) if i + p < n else vectors[i] for i in range(p)]
    while len(level) > 1:
        level = [adasum_pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def adasum_input(rank: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7000 + 100 * seed + rank)
    return torch.randn(length, generator=g, dtype=torch.float64)


def check_adasum(ranks: list[int], me: int, process_set: Any = None) -> None:
    kwargs = {} if process_set is None else {"process_set": process_set}
    where = f"set {ranks}"
    for length in (37, 1, 8):
        vectors = [adasum_input(r, length, length) for r in ranks]
        want = adasum_tree(vectors)
        for dtype, tol in ((torch.float64, 1e-9), (torch.float32, 1e-4)):
            got = hvd.allreduce(adasum_input(me, length, length).to(dtype), op=hvd.Adasum, **kwargs)
            expect(got, want.to(dtype), f"Adasum {dtype} length {length} {where}", atol=tol)
        # Half precision: combined in float32, against the definition over the rounded inputs.
        for dtype in (torch.float16, torch.bfloat16):
            rounded = [v.to(dtype).double() for v in vectors]
            want_half = adasum_tree(rounded).to(dtype)
            got = hvd.allreduce(adasum_input(me, length, length).to(dtype), op=hvd.Adasum, **kwargs)
            scale = float(want_half.double().abs().max())
            expect(got, want_half, f"Adasum {dtype} length {length} {where}", atol=0.02 * scale)
    # Grouped: each tensor has its own coefficients.
    parts = [(5,), (3, 3)]
    inputs = [[adasum_input(r, 5, 91), adasum_input(r, 9, 92)] for r in ranks]
    mine = [adasum_input(me, 5, 91), adasum_input(me, 9, 92).reshape(3, 3)]
    got = hvd.grouped_allreduce(mine, op=hvd.Adasum, **kwargs)
    for k, shape in enumerate(parts):
        want = adasum_tree([inputs[i][k] for i in range(len(ranks))]).reshape(shape)
        expect(got[k], want, f"grouped Adasum tensor {k} {where}", atol=1e-9)
    # The two limits of the definition: equal vectors average, orthogonal ones add.
    same = hvd.allreduce(
        torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), op=hvd.Adasum, **kwargs
    )
    expect(
        same,
        torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64),
        f"Adasum of equal {where}",
        atol=1e-12,
    )
    raises(
        ValueError,
        "floating-point",
        lambda: hvd.allreduce(torch.ones(2, dtype=torch.int64), op=hvd.Adasum, **kwargs),
        "Adasum of integers",
    )


def check_errors(n: int, me: int) -> None:
    shape = (3,) if me == 0 else (4,)
    # Mismatches fail on every rank with Horovod's error (a RuntimeError).
    raises(
        hvd.HorovodInternalError,
        "differ",
        lambda: hvd.allreduce(torch.zeros(shape)),
        "shape mismatch",
    )
    dtype = torch.float32 if me == 0 else torch.float64
    raises(
        hvd.HorovodInternalError,
        "differ",
        lambda: hvd.broadcast(torch.zeros(2, dtype=dtype), 0),
        "dtype mismatch",
    )
    raises(
        hvd.HorovodInternalError,
        "differ",
        lambda: hvd.allgather(torch.zeros(2, 2 + (me == 1))),
        "allgather trailing dimension mismatch",
    )
    raises(
        ValueError,
        "out of range",
        lambda: hvd.broadcast(torch.zeros(2), root_rank=n),
        "root out of range",
    )
    raises(
        ValueError,
        "splits",
        lambda: hvd.alltoall(torch.zeros(3), splits=[1] * (n + 1)),
        "bad splits",
    )
    raises(
        ValueError,
        "not a Horovod reduction",
        lambda: hvd.allreduce(torch.zeros(1), op=17),
        "bad op",
    )
    raises(TypeError, "torch.Tensor", lambda: hvd.allreduce([1.0]), "not a tensor")


# Every operation that takes a name: a call that submits it asynchronously.
NAMED_ASYNC: dict[str, Callable[[torch.Tensor, str], Any]] = {
    "allreduce": lambda t, name: hvd.allreduce_async(t, name=name),
    "grouped_allreduce": lambda t, name: hvd.grouped_allreduce_async([t, t + 1], name=name),
    "allgather": lambda t, name: hvd.allgather_async(t, name=name),
    "grouped_allgather": lambda t, name: hvd.grouped_allgather_async([t, t], name=name),
    "broadcast": lambda t, name: hvd.broadcast_async(t, root_rank=0, name=name),
    "reducescatter": lambda t, name: hvd.reducescatter_async(t, name=name),
    "grouped_reducescatter": lambda t, name: hvd.grouped_reducescatter_async([t, t], name=name),
    "alltoall": lambda t, name: hvd.alltoall_async(t, name=name),
}


def in_step(n: int, what: str) -> None:
    """An allreduce every rank issues gives the right sum: the job is in step."""
    got = hvd.allreduce(torch.ones(3), op=hvd.Sum, name=f"in_step.{what}")
    expect(got, torch.full((3,), float(n)), f"in step after {what}")


def outcome(call: Callable[[], Any]) -> str:
    """``call()``'s outcome: ``ok``, or the class and message of what it raised."""
    try:
        call()
    except (ValueError, hvd.HorovodInternalError) as error:
        return f"{type(error).__name__}: {error}"
    return "ok"


def duplicate_everywhere(me: int, kind: str, submit: Callable[[str], Any]) -> None:
    """Every rank submits twice (Horovod's suite, before it turned asymmetric).

    The second call raises on every rank, naming the operation, the name
    and the rank; the first one completes, and the name is free again once
    it is synchronized.
    """
    name = f"dup.{kind}"
    first = submit(name)
    for _ in range(3):
        raises(
            ValueError,
            f"{kind} {name!r} on rank {me}: an operation of this kind with this name "
            "is still in flight",
            lambda: submit(name),
            f"{kind}: a second call while the first is in flight",
        )
    hvd.synchronize(first)
    hvd.synchronize(submit(name))


def check_duplicate_names(n: int, me: int) -> None:
    """A second operation with a name still in flight raises ValueError (Horovod's rule)."""
    t = torch.ones(2 * n, 3)
    for kind, submit in NAMED_ASYNC.items():
        duplicate_everywhere(me, kind, functools.partial(submit, t))
        in_step(n, f"{kind}'s duplicate everywhere")
    # The same name for another kind of operation is no duplicate.
    handles = [hvd.allreduce_async(t, name="dup.shared"), hvd.allgather_async(t, name="dup.shared")]
    for handle in handles:
        hvd.synchronize(handle)
    checks.append("one name for two kinds of operation")


def horovod_order(me: int, submit: Callable[[str], Any], name: str) -> tuple[list[str], list]:
    """Rank 0 submits twice before a barrier, the others after it (Horovod's suite's order).

    Returns:
        Each call's outcome (``ok`` or the error's class and message), and
        what synchronizing each handle gave (its result, or the outcome).
    """
    seen: list[str] = []
    handles: list[int] = []

    def twice() -> None:
        for _ in range(2):
            seen.append(outcome(lambda: handles.append(submit(name))))

    if me == 0:
        twice()
    seen.append(outcome(hvd.barrier))
    if me != 0:
        twice()
    seen.append(outcome(hvd.barrier))
    results: list[Any] = []
    for handle in handles:
        try:
            results.append(hvd.synchronize(handle))
        except (ValueError, hvd.HorovodInternalError) as error:
            results.append(f"{type(error).__name__}: {error}")
    return seen, results


def expect_nested(got: Any, want: Any, what: str) -> None:
    """:func:`expect` through lists and tuples (grouped results, alltoall's pair)."""
    if isinstance(want, (list, tuple)):
        expect(isinstance(got, (list, tuple)) and len(got) == len(want), True, what)
        for g, w in zip(got, want):
            expect_nested(g, w, what)
        return
    expect(got, want, what)


def classes(lines: list[str]) -> list[str]:
    """The outcomes' classes (``ok``, ``ValueError``, ...)."""
    return [line.split(":")[0] for line in lines]


def check_duplicate_names_horovod_order(n: int, me: int) -> None:
    """Horovod's suite's order: rank 0 submits twice before a barrier, the others after it.

    Operations are matched by name (see docs/horovod.md): rank 0's first
    operation waits while the ranks run the barrier, and runs once the
    other ranks submit it after the barrier; each rank's second call raises
    ValueError on that rank only. Every first operation gives what a call
    every rank issues together gives, also for a name agreed before (whose
    allreduce goes ahead without waiting, finds the others at the barrier,
    and is queued again).
    """
    t = torch.ones(2 * n, 3)
    want = ["ok", "ValueError", "ok", "ok"] if me == 0 else ["ok", "ok", "ValueError", "ok"]
    for kind, submit in NAMED_ASYNC.items():
        reference = hvd.synchronize(submit(t, f"horovod_order.{kind}.reference"))
        for agreed_before in (False, True):
            name = f"horovod_order.{kind}.{agreed_before}"
            if agreed_before:  # twice in a row: it goes ahead when it comes next
                for _ in range(2):
                    hvd.synchronize(submit(t, name))
            seen, results = horovod_order(me, functools.partial(submit, t), name)
            expect(classes(seen), want, f"{kind} (agreed before: {agreed_before}): {seen}")
            if f"on rank {me}:" not in seen[want.index("ValueError")]:
                raise AssertionError(f"{kind}: a duplicate's error without the rank: {seen}")
            expect(len(results), 1, f"{kind}: one handle")
            expect_nested(results[0], reference, f"{kind} (agreed before: {agreed_before})")
            in_step(n, f"Horovod's order for {kind} (agreed before: {agreed_before})")
    # An in-place allreduce agreed before reduced into its input when it went
    # ahead: it cannot run again, so it fails on every rank, and the job goes on.
    name = "horovod_order.in_place"
    for _ in range(2):
        hvd.synchronize(hvd.allreduce_async_(t.clone(), name=name))
    in_place = lambda label: hvd.allreduce_async_(t.clone(), name=label)  # noqa: E731
    seen, results = horovod_order(me, in_place, name)
    expect(classes(seen), want, f"in-place allreduce agreed before: {seen}")
    expect(classes(results), ["HorovodInternalError"], f"in-place allreduce: {results}")
    in_step(n, "Horovod's order for an in-place allreduce agreed before")
    checks.append("Horovod's order of duplicate names, matched by name")


def check_matched_by_name(n: int, me: int) -> None:
    """Named operations submitted in other orders on other ranks run, matched by name.

    And calls that never meet (a name on one rank, an unnamed call on the
    other) fail on every rank once every rank waits, after which unnamed
    operations line up again.
    """
    names = [f"order.{k}" for k in range(3)]
    total = float(sum(r + 1 for r in range(n)))
    # Opposite orders first, then one order twice (so each name goes ahead when it
    # comes next), then opposite orders again (rank 0's first goes ahead alone).
    for step, opposite in enumerate((True, False, False, True)):
        handles = {}
        for name in names[::-1] if opposite and me % 2 else names:
            x = torch.full((names.index(name) + 1,), float(me + 1))
            handles[name] = hvd.allreduce_async(x, name=name, op=hvd.Sum)
        for k, name in enumerate(names):
            want = torch.full((k + 1,), total)
            expect(hvd.synchronize(handles[name]), want, f"{name} (step {step})")
    # add_process_set pairs up across ranks whatever is still in flight.
    x = torch.ones(2)
    if me == 0:
        handle = hvd.allreduce_async(x, name="order.before_set", op=hvd.Sum)
        added = hvd.add_process_set([0])
    else:
        added = hvd.add_process_set([0])
        handle = hvd.allreduce_async(x, name="order.before_set", op=hvd.Sum)
    expect(hvd.synchronize(handle), torch.full((2,), float(n)), "in flight while a set is added")
    expect(added.process_set_id is not None, True, "the set added meanwhile")
    hvd.remove_process_set(added)
    if me == 0:
        call = lambda: hvd.allreduce(torch.ones(2), name="order.rank_0_only")  # noqa: E731
    else:
        call = lambda: hvd.allreduce(torch.ones(2))  # noqa: E731
    raises(hvd.HorovodInternalError, "no rank can go on", call, "calls that never meet")
    got = hvd.allreduce(torch.ones(3), op=hvd.Sum)
    expect(got, torch.full((3,), float(n)), "an unnamed allreduce after calls that never met")


def check_step_warning(n: int, me: int) -> None:
    """``step()`` after ``synchronize()`` outside ``skip_synchronize()`` warns once."""
    model = torch.nn.Linear(1, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )

    def backward() -> None:
        optimizer.zero_grad()
        x = torch.zeros(1, 1, requires_grad=True)
        torch.nn.functional.mse_loss(model(x), torch.ones(1, 1)).backward()

    # Horovod's test_synchronize_step_warning: one warning, with these words.
    backward()
    optimizer.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    expect(len(caught), 1, f"one warning from step() after synchronize(): {caught}")
    warning = caught[0]
    expect(warning.category, UserWarning, "a UserWarning")
    text = "optimizer.step() called without optimizer.skip_synchronize()"
    expect(text in str(warning.message), True, f"Horovod's words: {warning.message}")
    expect(Path(warning.filename).name, Path(__file__).name, "the warning points at the caller")
    # No warning inside skip_synchronize(), nor for step() alone.
    for explicit in (True, False):
        backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if explicit:
                optimizer.synchronize()
                with optimizer.skip_synchronize():
                    optimizer.step()
            else:
                optimizer.step()
        expect([str(w.message) for w in caught], [], f"no warning (synchronize: {explicit})")


def check_process_sets(n: int, me: int) -> dict[str, Any]:
    even = hvd.ProcessSet([0, 2])
    odd_three = hvd.add_process_set([0, 1, 3])
    hvd.add_process_set(even)
    expect(even.size(), 2, "set size")
    expect(even.rank(), {0: 0, 2: 1}.get(me, -1), "set rank")
    expect(even.included(), me in (0, 2), "set included")
    expect(hvd.global_process_set.size(), n, "global set size")
    raises(
        ValueError, "already registered", lambda: hvd.add_process_set([2, 0]), "same ranks twice"
    )
    x = data(me, torch.float32, (6,), 140)
    if me in (0, 2):
        got = hvd.allreduce(x, op=hvd.Sum, process_set=even)
        want = data(0, torch.float32, (6,), 140) + data(2, torch.float32, (6,), 140)
        expect(got, want, "allreduce on the set {0, 2}")
        expect(
            hvd.broadcast(x, root_rank=2, process_set=even),
            data(2, torch.float32, (6,), 140),
            "broadcast on the set from global rank 2",
        )
        expect(
            hvd.allgather(x[: me + 1], process_set=even),
            torch.cat(
                [data(0, torch.float32, (6,), 140)[:1], data(2, torch.float32, (6,), 140)[:3]]
            ),
            "allgather on the set",
        )
        raises(
            ValueError,
            "not in the process set",
            lambda: hvd.broadcast(x, root_rank=1, process_set=even),
            "root outside the set",
        )
        expect(hvd.allgather_object(me, process_set=even), [0, 2], "allgather_object on the set")
        hvd.barrier(process_set=even)
    else:
        raises(
            ValueError,
            "is not in the process set",
            lambda: hvd.allreduce(x, process_set=even),
            "excluded rank's allreduce",
        )
        raises(
            ValueError,
            "is not in the process set",
            lambda: hvd.barrier(process_set=even),
            "excluded rank's barrier",
        )
    if me in (0, 1, 3):
        check_adasum([0, 1, 3], me, odd_three)  # three ranks: not a power of two
    expect(hvd.remove_process_set(even), True, "remove_process_set")
    expect(even.size(), None, "a removed set has no size")
    expect(hvd.remove_process_set(hvd.global_process_set), False, "the global set stays")
    expect(hvd.remove_process_set(odd_three), True, "remove the second set")
    return {}


def peer_exit(me: int) -> dict[str, Any]:
    """Rank 1 leaves; rank 0's next allreduces raise HorovodInternalError."""
    x = torch.ones(1000)
    hvd.allreduce(x, op=hvd.Sum)
    if me == 1:
        os._exit(0)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            hvd.allreduce(x, op=hvd.Sum)
    except hvd.HorovodInternalError as error:
        return {
            "error": type(error).__name__,
            "cause": type(error.__cause__).__name__,
            "runtime": isinstance(error, RuntimeError),
        }
    return {"error": None}


def served() -> dict[str, int]:
    return dict(_backend.served_in_process)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--suite",
        default="full",
        choices=["full", "basics", "duplicate-names", "step-warning"],
    )
    # The script makes the default group (with the two lines) before hvd.init().
    parser.add_argument("--preinit", action="store_true")
    # After the suite, rank 1 leaves and rank 0 expects HorovodInternalError.
    parser.add_argument("--peer-exit", action="store_true")
    args = parser.parse_args()
    result: dict[str, Any] = {}
    try:
        raises(
            ValueError,
            "call hvd.init() first",
            lambda: hvd.allreduce(torch.zeros(1)),
            "an op before init",
        )
        raises(ValueError, "call hvd.init() first", hvd.rank, "rank before init")
        import torch.distributed as dist

        first_set = None
        if args.preinit:
            import tiacc_training.torch.distributed as tdist

            tdist.init_tiacc_training()
            dist.init_process_group("gloo")
            default = dist.distributed_c10d._get_default_group()
            hvd.init()
            expect(
                dist.distributed_c10d._get_default_group() is default,
                True,
                "the script's group is used",
            )
        elif args.suite == "full" and os.environ.get("WORLD_SIZE") == "4":
            first_set = hvd.ProcessSet([0, 3])
            hvd.init(process_sets=[first_set])
        else:
            hvd.init()
        n, me = hvd.size(), hvd.rank()
        check_basics(n, me)
        if first_set is not None:
            expect(first_set.included(), me in (0, 3), "a set given to init")
            if me in (0, 3):
                expect(
                    hvd.allreduce(torch.tensor([me]), op=hvd.Sum, process_set=first_set),
                    torch.tensor([3]),
                    "allreduce on a set given to init",
                )
            expect(hvd.remove_process_set(first_set), True, "remove a set given to init")
        if args.suite == "full":
            check_allreduce(n, me)
            check_async(n, me)
            check_grouped(n, me)
            check_sparse(n, me)
            check_allgather_broadcast(n, me)
            check_alltoall_reducescatter(n, me)
            check_objects_barrier_join(n, me)
            check_join_uneven(n, me)
            check_autograd(n, me)
            check_adasum(list(range(n)), me)
            check_errors(n, me)
            if n == 4:
                check_process_sets(n, me)
        elif args.suite == "duplicate-names":
            check_duplicate_names(n, me)
            check_duplicate_names_horovod_order(n, me)
            check_matched_by_name(n, me)
        elif args.suite == "step-warning":
            check_step_warning(n, me)
        else:
            x = data(me, torch.float32, (3,), 1)
            expect(
                hvd.allreduce(x, op=hvd.Sum),
                reduce_ref(hvd.Sum, torch.float32, n, (3,), 1),
                "allreduce",
            )
            hvd.shutdown()
            expect(hvd.is_initialized(), False, "shutdown")
            raises(ValueError, "call hvd.init() first", hvd.size, "size after shutdown")
            hvd.init()
            expect(
                hvd.allreduce(x, op=hvd.Max),
                reduce_ref(hvd.Max, torch.float32, n, (3,), 1),
                "allreduce after init again",
            )
        backend = _backend.cpu_backend_of(None)
        result = {
            "checks": len(checks),
            "served": served(),
            "cpu_backend": {"backend": "TiaccBackend", "process-group": "TiaccProcessGroup"}.get(
                getattr(backend, "form", ""), type(backend).__name__
            ),
            "env_rank": os.environ.get("RANK"),
        }
        if args.peer_exit:
            result.update(peer_exit(me))
        else:
            hvd.barrier()
            hvd.shutdown()
        if args.preinit:
            result["group_kept"] = dist.is_initialized()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        exit_failed(exc, linger=2.0)
    print("RESULT " + json.dumps(result), flush=True)
    if args.peer_exit:
        os._exit(0)  # the engine cannot shut down in order without rank 1


if __name__ == "__main__":
    main()
