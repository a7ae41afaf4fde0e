"""One rank of a job that runs Horovod's PyTorch operations back to back, failures included.

Started by ``test_horovod_sequence.py`` (one process per rank, as Horovod's
own suite runs). Every case runs in the same process after the ones before
it, the way a Horovod job runs: working operations, and operations that
must fail (mismatched shapes, dtypes, devices, ops, roots and names across
ranks, bad splits, refused reductions, a rank inside ``join()``), each
checked for the exception class Horovod raises there. After each case an
allreduce checks that the job is still in step. The last line is
``RESULT {json}``: each case's outcome (``pass``, ``skip: why`` or
``fail: why``) on this rank.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _launch import exit_failed  # noqa: E402

import tiacc_training.torch.horovod as hvd  # noqa: E402

CASES: list[tuple[str, Callable[[int, int], None]]] = []


class Skip(Exception):
    """The case does not apply here."""


def case(function: Callable[[int, int], None]) -> Callable[[int, int], None]:
    """Adds ``function`` to the sequence, in definition order."""
    CASES.append((function.__name__, function))
    return function


def must_raise(kind: type[BaseException] | tuple, call: Callable[[], Any], what: str) -> None:
    """``call()`` raises ``kind`` (checked with isinstance, as an ``except`` would)."""
    try:
        call()
    except kind:
        return
    except BaseException as error:  # noqa: BLE001 - the wrong class is the failure
        raise AssertionError(f"{what}: raised {type(error).__name__}: {error}") from error
    raise AssertionError(f"{what}: nothing raised")


def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        raise AssertionError(f"{what}: got {got!r}, want {want!r}")


def ranks_value(n: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The sum over the ranks of ``full(shape, rank + 1)``."""
    return torch.full(shape, n * (n + 1) // 2).to(dtype)


# Horovod treats mismatches found by its coordinator as a RuntimeError
# (HorovodInternalError from synchronize), argument errors found when the
# operation is enqueued as ValueError.
MISMATCH = RuntimeError


@case
def allreduce_sum_dtypes_dims(n: int, me: int) -> None:
    for dtype in (torch.int32, torch.int64, torch.float32, torch.float64, torch.float16):
        for dims in (1, 2, 3):
            x = torch.full([5] * dims, me + 1).to(dtype)
            same(hvd.allreduce(x, op=hvd.Sum), ranks_value(n, x.shape, dtype), f"sum {dtype}")


@case
def allreduce_average_and_inplace(n: int, me: int) -> None:
    x = torch.full((4, 3), float(me + 1))
    same(hvd.allreduce(x), torch.full((4, 3), (n + 1) / 2), "average")
    hvd.allreduce_(x, op=hvd.Sum)
    same(x, ranks_value(n, (4, 3), torch.float32), "in place")


@case
def allreduce_async_poll_synchronize(n: int, me: int) -> None:
    handles = [hvd.allreduce_async(torch.full((8,), float(me + i)), op=hvd.Sum) for i in range(5)]
    for i, handle in enumerate(handles):
        if not isinstance(handle, int):
            raise AssertionError(f"allreduce_async returned {type(handle).__name__}")
        hvd.poll(handle)
        want = torch.full((8,), float(sum(r + i for r in range(n))))
        same(hvd.synchronize(handle), want, f"handle {i}")


@case
def allreduce_scale_factors(n: int, me: int) -> None:
    x = torch.full((3,), float(me + 1))
    got = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    same(got, ranks_value(n, (3,), torch.float32), "scaled")


@case
def allreduce_shape_mismatch(n: int, me: int) -> None:
    x = torch.zeros([17 + me] * 3)
    must_raise(MISMATCH, lambda: hvd.allreduce(x), "different sizes")
    y = torch.zeros(17, 23 * 57) if me == 0 else torch.zeros(17, 23, 57)
    must_raise(MISMATCH, lambda: hvd.allreduce(y), "same elements, different rank")


@case
def allreduce_dtype_mismatch(n: int, me: int) -> None:
    x = torch.zeros(17, 17, dtype=torch.int32 if me % 2 == 0 else torch.float32)
    must_raise(MISMATCH, lambda: hvd.allreduce(x), "int32 against float32")


@case
def allreduce_op_mismatch(n: int, me: int) -> None:
    op = hvd.Sum if me == 0 else hvd.Max
    must_raise(MISMATCH, lambda: hvd.allreduce(torch.ones(4), op=op), "Sum against Max")


@case
def allreduce_scale_mismatch(n: int, me: int) -> None:
    call = lambda: hvd.allreduce(torch.ones(4), op=hvd.Sum, prescale_factor=1.0 + me)  # noqa: E731
    must_raise(MISMATCH, call, "different prescale factors")


@case
def allreduce_duplicate_name(n: int, me: int) -> None:
    x = torch.ones(17, 17)
    first = hvd.allreduce_async(x, name="sequence.duplicate")
    must_raise(
        ValueError,
        lambda: hvd.allreduce_async(x, name="sequence.duplicate"),
        "a second allreduce with a name in flight",
    )
    same(hvd.synchronize(first), torch.ones(17, 17), "the first one still completes")
    hvd.synchronize(hvd.allreduce_async(x, name="sequence.duplicate"))  # free again


@case
def name_reused_for_another_operation(n: int, me: int) -> None:
    x = torch.ones(4)
    if me == 0:
        call = lambda: hvd.allreduce(x, name="sequence.reused")  # noqa: E731
    else:
        call = lambda: hvd.allgather(x, name="sequence.reused")  # noqa: E731
    must_raise(MISMATCH, call, "allreduce against allgather under one name")


@case
def allreduce_named_then_changed(n: int, me: int) -> None:
    for _ in range(3):
        hvd.allreduce(torch.ones(6), name="sequence.steady", op=hvd.Sum)
    x = torch.ones(6 + me)
    call = lambda: hvd.allreduce(x, name="sequence.steady", op=hvd.Sum)  # noqa: E731
    must_raise(MISMATCH, call, "a name seen before, now with another shape on one rank")


@case
def allreduce_not_a_tensor(n: int, me: int) -> None:
    must_raise(TypeError, lambda: hvd.allreduce([1.0, 2.0]), "a list")


@case
def allreduce_refused_on_one_rank(n: int, me: int) -> None:
    x = torch.ones(3)
    if me == 0:
        must_raise(ValueError, lambda: hvd.allreduce(x, op=17), "op 17 on rank 0")
    else:
        must_raise(MISMATCH, lambda: hvd.allreduce(x), "its peer refused")


@case
def allreduce_grad(n: int, me: int) -> None:
    x = torch.ones(5, requires_grad=True)
    hvd.allreduce(x, op=hvd.Sum).sum().backward()
    same(x.grad, torch.full((5,), float(n)), "gradient of a sum")


@case
def grouped_allreduce_all_forms(n: int, me: int) -> None:
    xs = [torch.full((i + 1,), float(me + 1)) for i in range(4)]
    for got, x in zip(hvd.grouped_allreduce(xs, op=hvd.Sum), xs):
        same(got, ranks_value(n, x.shape, torch.float32), "grouped")
    handle = hvd.grouped_allreduce_async_(xs, op=hvd.Sum)
    hvd.synchronize(handle)
    for x in xs:
        same(x, ranks_value(n, x.shape, torch.float32), "grouped in place")


@case
def grouped_allreduce_mismatch(n: int, me: int) -> None:
    xs = [torch.ones(3), torch.ones(4 + me)]
    must_raise(MISMATCH, lambda: hvd.grouped_allreduce(xs), "second tensor differs")
    ys = [torch.ones(3)] * (2 + me)
    must_raise(MISMATCH, lambda: hvd.grouped_allreduce(ys), "different list lengths")


@case
def allreduce_adasum(n: int, me: int) -> None:
    x = torch.ones(8)
    same(hvd.allreduce(x, op=hvd.Adasum), torch.ones(8), "equal vectors")


@case
def allgather_uneven_first_dims(n: int, me: int) -> None:
    for dtype in (torch.uint8, torch.int32, torch.float32, torch.float64):
        x = torch.full((me + 1, 3, 2), me).to(dtype)
        want = torch.cat([torch.full((r + 1, 3, 2), r).to(dtype) for r in range(n)])
        same(hvd.allgather(x), want, f"allgather {dtype}")


@case
def allgather_trailing_shape_mismatch(n: int, me: int) -> None:
    x = torch.ones(17, 10 * (me + 1), 17)
    must_raise(MISMATCH, lambda: hvd.allgather(x), "second dimension differs")


@case
def allgather_dtype_mismatch(n: int, me: int) -> None:
    x = torch.ones(17, 17, dtype=torch.int32 if me % 2 == 0 else torch.float32)
    must_raise(MISMATCH, lambda: hvd.allgather(x), "int32 against float32")


@case
def allgather_duplicate_name(n: int, me: int) -> None:
    x = torch.ones(3)
    first = hvd.allgather_async(x, name="sequence.gather")
    must_raise(ValueError, lambda: hvd.allgather_async(x, name="sequence.gather"), "twice")
    same(hvd.synchronize(first), torch.ones(3 * n), "the first one completes")


@case
def allgather_grad_and_grouped(n: int, me: int) -> None:
    x = torch.ones(me + 2, 2, requires_grad=True)
    hvd.allgather(x).sum().backward()
    same(x.grad, torch.ones(me + 2, 2), "allgather gradient (averaged, as Horovod's)")
    got = hvd.grouped_allgather([torch.full((1,), me), torch.full((2,), me)])
    same(got[1], torch.arange(n).repeat_interleave(2), "grouped allgather")


@case
def broadcast_all_forms(n: int, me: int) -> None:
    for root in range(n):
        x = torch.full((3, 2), float(me))
        same(hvd.broadcast(x, root), torch.full((3, 2), float(root)), "broadcast")
        hvd.broadcast_(x, root)
        same(x, torch.full((3, 2), float(root)), "broadcast_")
        handle = hvd.broadcast_async(torch.full((2,), me), root)
        same(hvd.synchronize(handle), torch.full((2,), root), "broadcast_async")


@case
def broadcast_shape_and_dtype_mismatch(n: int, me: int) -> None:
    x = torch.ones([17 + me] * 3)
    must_raise(MISMATCH, lambda: hvd.broadcast(x, 0), "different sizes")
    y = torch.ones(4, dtype=torch.int32 if me % 2 == 0 else torch.float32)
    must_raise(MISMATCH, lambda: hvd.broadcast(y, 0), "different dtypes")


@case
def broadcast_root_mismatch(n: int, me: int) -> None:
    must_raise(MISMATCH, lambda: hvd.broadcast(torch.ones(4), me), "each rank its own root")


@case
def broadcast_root_out_of_range(n: int, me: int) -> None:
    must_raise(ValueError, lambda: hvd.broadcast(torch.ones(2), n), "root n")


@case
def broadcast_duplicate_name(n: int, me: int) -> None:
    x = torch.ones(3)
    first = hvd.broadcast_async(x, 0, name="sequence.bcast")
    must_raise(ValueError, lambda: hvd.broadcast_async(x, 0, name="sequence.bcast"), "twice")
    hvd.synchronize(first)


@case
def broadcast_grad(n: int, me: int) -> None:
    x = torch.ones(4, requires_grad=True)
    hvd.broadcast(x, 0).sum().backward()
    same(x.grad, torch.full((4,), 1.0 if me == 0 else 0.0), "broadcast gradient")


@case
def alltoall_equal_and_splits(n: int, me: int) -> None:
    x = torch.arange(2 * n, dtype=torch.float32) + 100 * me
    want = torch.cat([torch.arange(2 * me, 2 * me + 2, dtype=torch.float32) + 100 * r
                      for r in range(n)])  # fmt: skip
    same(hvd.alltoall(x), want, "equal alltoall")
    splits = torch.tensor([r + 1 for r in range(n)], dtype=torch.int32)
    rows = torch.full((int(splits.sum()), 2), float(me))
    out, received = hvd.alltoall(rows, splits)
    same(received, torch.full((n,), me + 1, dtype=torch.int32), "received splits")
    same(out, torch.cat([torch.full((me + 1, 2), float(r)) for r in range(n)]), "uneven")


@case
def alltoall_dtype_mismatch(n: int, me: int) -> None:
    x = torch.ones(n, dtype=torch.int32 if me % 2 else torch.float32)
    must_raise(MISMATCH, lambda: hvd.alltoall(x), "int32 against float32")


@case
def alltoall_trailing_shape_mismatch(n: int, me: int) -> None:
    x = torch.ones(2 * n, 10 * (me + 1), 2 * n)
    must_raise(MISMATCH, lambda: hvd.alltoall(x), "second dimension differs")


@case
def alltoall_split_errors(n: int, me: int) -> None:
    must_raise(ValueError, lambda: hvd.alltoall(torch.ones(n + 1)), "not divisible")
    splits = torch.ones(n, dtype=torch.int32)
    must_raise(ValueError, lambda: hvd.alltoall(torch.ones(n - 1), splits), "sum too large")
    floats = torch.ones(n, dtype=torch.float32)
    must_raise(ValueError, lambda: hvd.alltoall(torch.ones(n), floats), "float splits")


@case
def alltoall_splits_wrong_on_one_rank(n: int, me: int) -> None:
    splits = [1] * n if me else [1] * (n + 1)
    kind = ValueError if me == 0 else MISMATCH
    must_raise(kind, lambda: hvd.alltoall(torch.ones(n), splits), "rank 0's splits are wrong")


@case
def alltoall_grad(n: int, me: int) -> None:
    x = torch.ones(2 * n, requires_grad=True)
    hvd.alltoall(x).sum().backward()
    same(x.grad, torch.ones(2 * n), "alltoall gradient")


@case
def reducescatter_sum_average(n: int, me: int) -> None:
    x = torch.full((4 * n, 3), float(me + 1))
    same(hvd.reducescatter(x, op=hvd.Sum), ranks_value(n, (4, 3), torch.float32), "sum")
    same(hvd.reducescatter(x), torch.full((4, 3), (n + 1) / 2), "average")
    handle = hvd.reducescatter_async(x, op=hvd.Sum)
    same(hvd.synchronize(handle), ranks_value(n, (4, 3), torch.float32), "async")


@case
def reducescatter_mismatches(n: int, me: int) -> None:
    x = torch.ones([17 + me] * 3)
    must_raise(MISMATCH, lambda: hvd.reducescatter(x, name="sequence.rs1"), "sizes")
    y = torch.ones(17, 23 * 57) if me == 0 else torch.ones(17, 23, 57)
    must_raise(MISMATCH, lambda: hvd.reducescatter(y, name="sequence.rs2"), "dimensions")
    z = torch.ones(17, 3, dtype=torch.int32 if me % 2 == 0 else torch.float32)
    must_raise(MISMATCH, lambda: hvd.reducescatter(z), "dtypes")


@case
def reducescatter_refuses_adasum_and_scalars(n: int, me: int) -> None:
    x = torch.ones(4 * n)
    must_raise(RuntimeError, lambda: hvd.reducescatter(x, op=hvd.Adasum), "Adasum")
    scalar = torch.tensor(float(me))
    must_raise((RuntimeError, ValueError), lambda: hvd.reducescatter(scalar), "a scalar")


@case
def reducescatter_duplicate_name(n: int, me: int) -> None:
    x = torch.ones(2 * n)
    first = hvd.reducescatter_async(x, name="sequence.rsdup")
    must_raise(ValueError, lambda: hvd.reducescatter_async(x, name="sequence.rsdup"), "twice")
    hvd.synchronize(first)


@case
def sparse_allreduce_handle_is_callable(n: int, me: int) -> None:
    dense = torch.zeros(6, 3)
    dense[me] = 1.0
    handles = [
        hvd.sparse_allreduce_async(dense.to_sparse(), name=f"sequence.sparse.{i}", op=hvd.Sum)
        for i in range(2)
    ]
    want = torch.zeros(6, 3)
    want[:n] = 1.0
    same(handles[0]().to_dense(), want, "handle() gives the result")
    same(hvd.synchronize(handles[1]).to_dense(), want, "synchronize takes it too")


@case
def objects_and_barrier(n: int, me: int) -> None:
    got = hvd.broadcast_object({"rank": me, "list": [me]}, root_rank=0)
    if got != {"rank": 0, "list": [0]}:
        raise AssertionError(f"broadcast_object: {got}")
    if hvd.allgather_object(me) != list(range(n)):
        raise AssertionError("allgather_object")
    hvd.barrier()


@case
def join_with_allreduce(n: int, me: int) -> None:
    for first in range(n):
        if me == first:
            last = hvd.join()
        else:
            got = hvd.allreduce(torch.ones(3), op=hvd.Sum)
            same(got, torch.full((3,), float(n - 1)), "the joined rank adds zeros")
            last = hvd.join()
        if last == first:
            raise AssertionError(f"join returned the first rank to join ({first})")


@case
def join_then_allgather_and_broadcast_fail(n: int, me: int) -> None:
    for call in (lambda: hvd.allgather(torch.ones(2)), lambda: hvd.broadcast(torch.ones(2), me)):
        if me == 0:
            hvd.join()
        else:
            must_raise(MISMATCH, call, "an operation other than allreduce after a join")
            hvd.join()


@case
def join_while_a_named_allreduce_changes(n: int, me: int) -> None:
    hvd.allreduce(torch.ones(3), name="sequence.joined", op=hvd.Sum)
    if me == 0:
        hvd.join()
    else:
        for _ in range(2):  # a new shape, then the same again (not waited for)
            got = hvd.allreduce(torch.ones(5), name="sequence.joined", op=hvd.Sum)
            same(got, torch.full((5,), float(n - 1)), "the joined rank follows the new shape")
        hvd.join()


@case
def allreduce_cpu_gpu_mismatch(n: int, me: int) -> None:
    if not torch.cuda.is_available():
        raise Skip("no CUDA device")
    device = f"cuda:{hvd.local_rank() % torch.cuda.device_count()}" if me % 2 == 0 else "cpu"
    x = torch.ones(17, device=device)
    must_raise(MISMATCH, lambda: hvd.allreduce(x), "CUDA tensor against CPU tensor")


@case
def grouped_allgather_and_reducescatter_mismatch(n: int, me: int) -> None:
    xs = [torch.ones(2, 3), torch.ones(2, 3 + me)]
    must_raise(MISMATCH, lambda: hvd.grouped_allgather(xs), "trailing shape of the second")
    ys = [torch.ones(2 * n), torch.ones(2 * n + me)]
    must_raise(MISMATCH, lambda: hvd.grouped_reducescatter(ys), "shape of the second")
    got = hvd.grouped_reducescatter([torch.ones(2 * n), torch.ones(n, 2)], op=hvd.Sum)
    same(got[1], torch.full((1, 2), float(n)), "grouped reducescatter after the failures")


@case
def sparse_allreduce_on_a_process_set(n: int, me: int) -> None:
    sets = [hvd.add_process_set([r]) for r in range(n)]
    dense = torch.eye(4)[me : me + 1].repeat(3, 1)
    handle = hvd.sparse_allreduce_async(dense.to_sparse(), name="sparse.set", process_set=sets[me])
    same(handle().to_dense(), dense, "a set of one rank")
    for s in sets:
        hvd.remove_process_set(s)


@case
def process_sets_add_use_remove(n: int, me: int) -> None:
    sets = [hvd.add_process_set([r]) for r in range(n)]
    mine = sets[me]
    same(hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=mine), torch.ones(2), "own set")
    must_raise(ValueError, lambda: hvd.add_process_set([0]), "the same ranks twice")
    other = sets[(me + 1) % n]
    must_raise(ValueError, lambda: hvd.allreduce(torch.ones(1), process_set=other), "not in")
    for s in sets:
        if not hvd.remove_process_set(s):
            raise AssertionError("remove_process_set")
    again = hvd.add_process_set([0])  # free again after the removal
    hvd.remove_process_set(again)


@case
def process_set_left_after_a_failure(n: int, me: int) -> None:
    first = hvd.add_process_set([0])
    try:
        must_raise(MISMATCH, lambda: hvd.allreduce(torch.ones(2 + me)), "a failure meanwhile")
    finally:
        hvd.remove_process_set(first)
    hvd.remove_process_set(hvd.add_process_set([0]))


@case
def process_set_added_differently(n: int, me: int) -> None:
    must_raise(ValueError, lambda: hvd.add_process_set([me]), "each rank names another set")
    asked = [0, n] if me == 0 else [0]
    must_raise(ValueError, lambda: hvd.add_process_set(asked), "rank 0 names a rank too large")
    hvd.remove_process_set(hvd.add_process_set([0]))  # nothing was left registered


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 2))


@case
def optimizer_without_named_parameters(n: int, me: int) -> None:
    model = _model()
    groups = [{"params": model[0].parameters()}, {"params": model[1].parameters()}]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1))
    names = opt._parameter_names
    if len(set(names.values())) != len(names) or len(names) != 4:
        raise AssertionError(f"names: {names}")
    every = hvd.allgather_object(sorted(names.values()))
    if any(e != every[0] for e in every):
        raise AssertionError(f"ranks disagree on the names: {every}")
    model(torch.full((3, 6), float(me))).sum().backward()
    opt.step()


@case
def optimizer_duplicate_and_missing_names(n: int, me: int) -> None:
    a, b = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    named = [*a.named_parameters(), *b.named_parameters()]
    must_raise(ValueError, lambda: hvd.DistributedOptimizer(opt, named_parameters=named), "dup")
    some = list(a.named_parameters())[:1]
    must_raise(ValueError, lambda: hvd.DistributedOptimizer(opt, named_parameters=some), "miss")


@case
def broadcast_state_with_a_parameter_without_grad(n: int, me: int) -> None:
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.index = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), False)
            self.weight = torch.nn.Parameter(torch.rand(4))

    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9, nesterov=True)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    if opt.param_groups[0]["params"][0].grad is not None:
        raise AssertionError("the parameter without gradient got one")
    grad = opt.param_groups[0]["params"][1].grad
    same(hvd.broadcast(grad, root_rank=0), grad, "the gradient is the same everywhere")


@case
def broadcast_state_and_train(n: int, me: int) -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for _ in range(2):
        opt.zero_grad()
        model(torch.full((2, 6), float(me))).square().mean().backward()
        opt.step()
    weights = hvd.allgather_object([p.detach().clone() for p in model.parameters()])
    for theirs in weights[1:]:
        for a, b in zip(weights[0], theirs):
            same(a, b, "the ranks' weights stay equal")


@case
def optimizer_on_a_rank_outside_its_set(n: int, me: int) -> None:
    first = hvd.add_process_set([0])
    try:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt = hvd.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(), process_set=first
        )
        model(torch.full((2, 6), float(me))).sum().backward()
        opt.step()  # rank 0 reduces over its set of one; the others step alone
    finally:
        hvd.remove_process_set(first)


@case
def sparse_as_dense_hands_back_sparse(n: int, me: int) -> None:
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    opt = torch.optim.SparseAdam(list(embedding.parameters()), lr=0.1)
    opt = hvd.DistributedOptimizer(opt, sparse_as_dense=True)
    embedding(torch.tensor([[1, 2 + me]])).sum().backward()
    opt.step()
    if not embedding.weight.grad.is_sparse:
        raise AssertionError("the optimizer got a dense gradient")


@case
def reducescatter_grad(n: int, me: int) -> None:
    for op, factor in ((hvd.Sum, n), (hvd.Average, 1)):
        x = torch.ones(2 * n, 2, requires_grad=True)
        hvd.reducescatter(x, op=op).sum().backward()
        same(x.grad, torch.full((2 * n, 2), float(factor)), f"reducescatter gradient {op!r}")
    xs = [torch.ones(n, requires_grad=True), torch.ones(2 * n, requires_grad=True)]
    sum(b.sum() for b in hvd.grouped_reducescatter(xs, op=hvd.Sum)).backward()
    same(xs[1].grad, torch.full((2 * n,), float(n)), "grouped reducescatter gradient")
    ys = [torch.ones(me + 1, requires_grad=True)]
    hvd.grouped_allgather(ys)[0].sum().backward()
    same(ys[0].grad, torch.ones(me + 1), "grouped allgather gradient (averaged)")


def in_step(n: int) -> None:
    """An allreduce every rank issues after each case: the job is still usable."""
    got = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="sequence.in_step")
    same(got, torch.full((2,), float(n)), "the job after the case")


def main() -> None:
    outcomes: dict[str, str] = {}
    try:
        hvd.init()
        n, me = hvd.size(), hvd.rank()
        only = sys.argv[1:]  # case names to run (all when none are given)
        for name, function in CASES:
            if only and name not in only:
                continue
            try:
                function(n, me)
                outcome = "pass"
            except Skip as why:
                outcome = f"skip: {why}"
            except Exception as error:  # noqa: BLE001 - recorded, the job goes on
                traceback.print_exc()
                outcome = f"fail: {type(error).__name__}: {error}"[:500]
            try:
                in_step(n)
            except Exception as error:  # noqa: BLE001
                traceback.print_exc()
                if outcome == "pass":
                    outcome = f"fail: the next operation failed: {type(error).__name__}: {error}"
            outcomes[name] = outcome
        hvd.shutdown()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        print("RESULT " + json.dumps({"cases": outcomes}), flush=True)
        exit_failed(exc, linger=2.0)
    print("RESULT " + json.dumps({"cases": outcomes}), flush=True)


if __name__ == "__main__":
    main()
