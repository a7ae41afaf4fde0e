"""One rank of the Horovod training tests (``test_horovod_training.py``).

Runs the checks named by ``--checks`` (comma-separated) in one job and
prints ``CHECK <name> ok`` after each. Every check computes its reference
in this process with plain torch from every rank's inputs (each rank's
batch comes from a generator seeded with the rank, so every rank can
rebuild every other's): a single model over the concatenated batch, or
each rank's own gradients combined as the op defines.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import tiacc_training.torch.distributed as tdist
import tiacc_training.torch.horovod as hvd
from tests._launch import exit_failed

FEATURES, OUTPUTS = 6, 3


def build_model() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(
        nn.Linear(FEATURES, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, OUTPUTS),
    )


def batch(rank: int, seed: int, n: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch for ``seed`` (any rank can rebuild it)."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(n, FEATURES, generator=g) / 3, torch.randn(n, OUTPUTS, generator=g)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).square().mean()


def local_grads(model: nn.Module, rank: int, seed: int) -> list[torch.Tensor]:
    """The gradients rank ``rank`` computes alone (a copy of ``model``)."""
    twin = copy.deepcopy(model)
    twin.zero_grad()
    loss_of(twin, *batch(rank, seed)).backward()
    return [p.grad.clone() for p in twin.parameters()]


def concatenated(world: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(batch(r, seed) for r in range(world)))
    return torch.cat(xs), torch.cat(ys)


def close(name: str, got: list[torch.Tensor], want: list[torch.Tensor], rtol=1e-5, atol=1e-6):
    for i, (a, b) in enumerate(zip(got, want)):
        if not torch.allclose(a, b, rtol=rtol, atol=atol):
            raise AssertionError(
                f"{name}: tensor {i} differs by {(a - b).abs().max().item():.3g}:\n{a}\n{b}"
            )


def carried() -> tuple[int, int]:
    """CPU buckets and bytes the engine carried so far in this process."""
    stats = tdist.stats()
    if stats["native"]:
        raise AssertionError(f"buckets left to torch: {stats['native']}")
    return stats["buckets"].get("cpu", 0), stats["bytes"].get("cpu", 0)


def grad_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def check_train(world: int, rank: int) -> None:
    """SGD with momentum, 3 steps, against one process over the concatenated batch."""
    model = build_model()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.SGD), type(opt).__mro__
    # The engine's fusion threshold, from whichever variable the test set.
    threshold = os.environ.get("HOROVOD_FUSION_THRESHOLD") or os.environ.get(
        "TIACC_TRAINING_FUSION_THRESHOLD"
    )
    assert opt._hvd_threshold == int(threshold or 0), (opt._hvd_threshold, threshold)
    buckets = len(opt._hvd_plan.buckets)
    assert buckets > 1, f"the test's fusion threshold should give several buckets, got {buckets}"
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    before = carried()
    steps = 3
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, *batch(rank, step)).backward()
        opt.step()
        ref_opt.zero_grad()
        loss_of(reference, *concatenated(world, step)).backward()
        ref_opt.step()
    close("train", list(model.parameters()), list(reference.parameters()))
    after = carried()
    # Every step's every bucket went through the engine (none left to torch).
    assert after[0] - before[0] == steps * len(opt._hvd_plan.buckets), (before, after, buckets)
    assert after[1] - before[1] == steps * grad_bytes(model), (before, after)


def check_passes(world: int, rank: int) -> None:
    """backward_passes_per_step=2: the two passes add up, then one reduction."""
    model = build_model()
    reference = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        backward_passes_per_step=2,
    )
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    before = carried()
    for step in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        for micro in range(2):
            seed = 10 + 2 * step + micro
            loss_of(model, *batch(rank, seed)).backward()
            loss_of(reference, *concatenated(world, seed)).backward()
        opt.step()
        ref_opt.step()
    close("passes", list(model.parameters()), list(reference.parameters()))
    after = carried()
    assert after[0] - before[0] == 2 * len(opt._hvd_plan.buckets), (before, after)
    # A third backward pass before step() is one too many.
    opt.zero_grad()
    for _ in range(2):
        loss_of(model, *batch(rank, 30)).backward()
    try:
        loss_of(model, *batch(rank, 31)).backward()
    except AssertionError as exc:
        assert "backward_passes_per_step" in str(exc), exc
    else:
        raise AssertionError("a third backward pass with backward_passes_per_step=2 passed")
    opt.synchronize()


def synchronized_grads(opt: torch.optim.Optimizer, model: nn.Module, rank: int, seed: int):
    """The gradients ``opt`` leaves after backward and synchronize()."""
    opt.zero_grad()
    loss_of(model, *batch(rank, seed)).backward()
    opt.synchronize()
    grads = [p.grad.clone() for p in model.parameters()]
    with opt.skip_synchronize():
        opt.step()
    return grads


def check_fp16(world: int, rank: int) -> None:
    """Compression.fp16: the ranks average float16-rounded gradients in float16."""
    model = build_model()
    every = [local_grads(model, r, 40) for r in range(world)]
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16,
    )
    before = carried()
    got = synchronized_grads(opt, model, rank, 40)
    after = carried()
    want, plain = [], []
    for tensors in zip(*every):
        total = sum(t.half().float() for t in tensors)
        want.append((total / world).half().float())
        plain.append(sum(tensors) / world)
    # The inputs are not float16 values: no compression would be caught.
    assert any(not torch.allclose(a, b, rtol=1e-6, atol=0) for a, b in zip(plain, want))
    close("fp16", got, want, rtol=1e-6, atol=0)
    # float16 buckets, half the bytes, through the engine.
    assert after[1] - before[1] == grad_bytes(model) // 2, (before, after)


def check_sum_and_predivide(world: int, rank: int) -> None:
    model = build_model()
    every = [local_grads(model, r, 50) for r in range(world)]
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        op=hvd.Sum,
    )
    close("op=Sum", synchronized_grads(opt, model, rank, 50), [sum(t) for t in zip(*every)])
    model = build_model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        gradient_predivide_factor=4.0,
    )
    got = synchronized_grads(opt, model, rank, 50)
    close("gradient_predivide_factor", got, [sum(t) / world for t in zip(*every)])
    try:
        hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Sum, gradient_predivide_factor=2.0
        )
    except ValueError as exc:
        assert "gradient_predivide_factor" in str(exc), exc
    else:
        raise AssertionError("gradient_predivide_factor with op=Sum was accepted")


def check_adasum(world: int, rank: int) -> None:
    """op=Adasum on 2 ranks: each tensor combined by Adasum's rule."""
    assert world == 2
    model = build_model()
    a_all, b_all = (local_grads(model, r, 60) for r in range(2))
    want = []
    for a, b in zip(a_all, b_all):
        dot = (a.double() * b.double()).sum()
        aa, bb = a.double().square().sum(), b.double().square().sum()
        want.append(((1 - dot / (2 * aa)) * a.double() + (1 - dot / (2 * bb)) * b.double()).float())
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        op=hvd.Adasum,
    )
    close("op=Adasum", synchronized_grads(opt, model, rank, 60), want, rtol=1e-4, atol=1e-6)


def check_groups(world: int, rank: int) -> None:
    """groups=: explicit buckets, each reduced whole."""
    model = build_model()
    params = list(model.parameters())
    every = [local_grads(model, r, 70) for r in range(world)]
    want = [sum(t) / world for t in zip(*every)]
    for groups, count in (([params[:3], params[3:5]], 3), (2, 2)):
        m = copy.deepcopy(model)
        p = list(m.parameters())
        g = groups if isinstance(groups, int) else [p[:3], p[3:5]]
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(), groups=g
        )
        assert len(opt._hvd_plan.buckets) == count, (groups, len(opt._hvd_plan.buckets))
        before = carried()
        close(
            f"groups={groups if isinstance(groups, int) else 'lists'}",
            synchronized_grads(opt, m, rank, 70),
            want,
        )
        assert carried()[0] - before[0] == count


def check_broadcast(world: int, rank: int) -> None:
    """broadcast_parameters and broadcast_optimizer_state make every rank rank 0's."""
    torch.manual_seed(100 + rank)  # every rank starts different
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Linear(5, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1), betas=(0.8, 0.9))
    if rank == 0:  # only the root has state (steps taken)
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(3, 4)).square().sum().backward()
            opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    mine = {
        "params": {k: v.clone() for k, v in model.state_dict().items()},
        "state": opt.state_dict(),
    }
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    root = gathered[0]
    for k, v in mine["params"].items():
        assert torch.equal(v, root["params"][k]), f"rank {rank}: parameter {k} differs"
    assert mine["state"]["param_groups"] == root["state"]["param_groups"], mine["state"]
    assert opt.param_groups[0]["lr"] == 0.01, opt.param_groups[0]["lr"]
    assert len(mine["state"]["state"]) == len(model_params := list(model.parameters()))
    assert len(model_params) == len(root["state"]["state"])
    for index, entry in root["state"]["state"].items():
        for name, value in entry.items():
            ours = mine["state"]["state"][index][name]
            if isinstance(value, torch.Tensor):
                assert torch.equal(ours, value), (rank, index, name, ours, value)
            else:
                assert ours == value, (rank, index, name)
    # The state is usable: one more identical step keeps the ranks equal.
    opt.zero_grad()
    model(torch.ones(3, 4)).square().sum().backward()
    opt.step()
    after: list = [None] * world
    dist.all_gather_object(after, [p.detach().clone() for p in model.parameters()])
    for a, b in zip(after[rank], after[0]):
        assert torch.equal(a, b)


def check_sync_batch_norm(world: int, rank: int) -> None:
    """SyncBatchNorm against BatchNorm2d over the concatenated (uneven) batch."""
    sizes = [3 + 2 * r for r in range(world)]

    def inputs(r: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(80 + r)
        x = torch.randn(sizes[r], 4, 3, 2, generator=g) * (r + 1) + r
        return x, torch.randn(sizes[r], 4, 3, 2, generator=g)

    torch.manual_seed(5)
    sync = hvd.SyncBatchNorm(4, momentum=0.3)
    with torch.no_grad():
        sync.weight.copy_(torch.linspace(0.5, 2.0, 4))
        sync.bias.copy_(torch.linspace(-1.0, 1.0, 4))
    plain = nn.BatchNorm2d(4, momentum=0.3)
    plain.load_state_dict(sync.state_dict())
    x, w = inputs(rank)
    x.requires_grad_(True)
    y = sync(x)
    (y * w).sum().backward()
    xs, ws = zip(*(inputs(r) for r in range(world)))
    x_all = torch.cat(xs).requires_grad_(True)
    y_all = plain(x_all)
    # The sum of every rank's loss: each rank's input gradient is its slice.
    (y_all * torch.cat(ws)).sum().backward()
    start = sum(sizes[:rank])
    rows = slice(start, start + sizes[rank])
    close("SyncBatchNorm output", [y], [y_all[rows]], rtol=1e-4, atol=1e-5)
    close("SyncBatchNorm input grad", [x.grad], [x_all.grad[rows]], rtol=1e-4, atol=1e-5)
    # Parameter gradients stay local; summed over the ranks they are the whole batch's.
    for name in ("weight", "bias"):
        total = getattr(sync, name).grad.clone()
        dist.all_reduce(total)
        close(f"SyncBatchNorm {name} grad", [total], [getattr(plain, name).grad], 1e-4, 1e-5)
    close(
        "SyncBatchNorm running stats",
        [sync.running_mean, sync.running_var],
        [plain.running_mean, plain.running_var],
        rtol=1e-4,
        atol=1e-5,
    )
    sync.eval()
    plain.eval()
    close("SyncBatchNorm eval", [sync(x.detach())], [plain(x.detach())], 1e-4, 1e-5)


def check_api(world: int, rank: int) -> None:
    """Horovod's errors and the optimizer's behaviour as a torch optimizer."""
    model = build_model()
    named = list(model.named_parameters())

    def raises(what: str, fn: Callable[[], object], text: str) -> None:
        try:
            fn()
        except ValueError as exc:
            assert text in str(exc), (what, exc)
        else:
            raise AssertionError(f"{what} was accepted")

    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    raises(
        "duplicate names",
        lambda: hvd.DistributedOptimizer(sgd, named_parameters=[named[0], named[0], *named[1:]]),
        "unique",
    )
    raises(
        "missing names",
        lambda: hvd.DistributedOptimizer(sgd, named_parameters=named[1:]),
        "not in it",
    )
    raises("not tuples", lambda: hvd.DistributedOptimizer(sgd, named_parameters=[1, 2]), "tuples")
    raises(
        "backward_passes_per_step=0",
        lambda: hvd.DistributedOptimizer(sgd, backward_passes_per_step=0),
        "backward_passes_per_step",
    )
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named
    )
    assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loss_of(model, *batch(rank, 90)).backward()
    try:
        opt.zero_grad()
    except AssertionError as exc:
        assert "zero_grad" in str(exc), exc
    else:
        raise AssertionError("zero_grad() between backward() and step() passed")
    opt.step()
    scheduler.step()
    assert opt.param_groups[0]["lr"] == 0.05, opt.param_groups
    # step() after synchronize() outside skip_synchronize() warns.
    opt.zero_grad()
    loss_of(model, *batch(rank, 91)).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert any("skip_synchronize" in str(w.message) for w in caught), caught


def check_process_set(world: int, rank: int) -> None:
    """A DistributedOptimizer on the process set {0, 2} of 4 ranks."""
    assert world == 4
    members = [0, 2]
    subset = hvd.add_process_set(members)
    if rank in members:
        model = build_model()
        every = [local_grads(model, r, 95) for r in members]
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            process_set=subset,
        )
        close(
            "process set",
            synchronized_grads(opt, model, rank, 95),
            [sum(t) / 2 for t in zip(*every)],
        )
    hvd.barrier()
    hvd.remove_process_set(subset)


def check_sparse(world: int, rank: int) -> None:
    """Sparse embedding gradients: allgathered (or reduced dense), then averaged.

    The embedding shares its bucket with a dense layer's parameters.
    """
    torch.manual_seed(3)
    embedding = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    rows = [torch.tensor([r, r + 1, 7]) for r in range(world)]

    def alone(r: int) -> list[torch.Tensor]:
        twin = copy.deepcopy(embedding)
        twin(rows[r]).square().sum().backward()
        return [p.grad.to_dense() for p in twin.parameters()]

    want = [sum(t) / world for t in zip(*(alone(r) for r in range(world)))]
    for dense in (False, True):
        model = copy.deepcopy(embedding)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            sparse_as_dense=dense,
        )
        assert len(opt._hvd_plan.buckets) == 1, len(opt._hvd_plan.buckets)
        model(rows[rank]).square().sum().backward()
        opt.synchronize()
        grad = model[0].weight.grad
        # Reduced dense or not, the optimizer gets a sparse gradient back (as Horovod's).
        assert grad.is_sparse, (dense, grad.layout)
        got = [p.grad.to_dense() for p in model.parameters()]
        close(f"sparse_as_dense={dense}", got, want)
        with opt.skip_synchronize():
            opt.step()


CHECKS = {
    "train": check_train,
    "passes": check_passes,
    "fp16": check_fp16,
    "sum": check_sum_and_predivide,
    "adasum": check_adasum,
    "groups": check_groups,
    "broadcast": check_broadcast,
    "syncbn": check_sync_batch_norm,
    "api": check_api,
    "process_set": check_process_set,
    "sparse": check_sparse,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checks", required=True)
    args = parser.parse_args()
    hvd.init()
    world, rank = hvd.size(), hvd.rank()
    try:
        for name in args.checks.split(","):
            CHECKS[name](world, rank)
            print(f"CHECK {name} ok", flush=True)
    except BaseException as exc:  # noqa: BLE001
        exit_failed(exc, linger=2.0)
    hvd.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
