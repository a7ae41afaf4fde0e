"""One rank of a small DDP training run, for the multi-process tests.

Launched by the tests (plain processes with torchrun-style variables), by
torchrun and by mpirun. Trains a small MLP for a few steps natively and/or
through the tiacc engine and saves the final parameters per rank. Mode
``dgc`` is the engine with Top-K's momentum correction for the optimiser's
momentum (``topk_momentum=0.9``; Top-K itself comes from the environment).

Fault injection (``--fault``): ``kill`` makes ``--fault-rank`` SIGKILL
itself just after handing bucket 0 of step ``--fault-step`` to the engine
(in the middle of that allreduce); ``stop`` makes it SIGSTOP itself at the
start of that step; ``layout`` makes that rank allreduce a shorter buffer
than the others; ``strangers`` makes rank 0 knock on rank 1's engine port
before the engine connects, three times: with a wrong job token, with
random bytes, and with nothing (a silent connection); ``nan`` puts a NaN
into that rank's input; ``slow`` makes that rank sleep ``--slow-seconds``
in every forward. Both ranks print ``FAULT_AT`` / ``ERROR_AT`` wall-clock
times (a killed rank just before it dies) so the tests measure the time to
error, and ``STEP n`` as each step begins.

``--probe`` adds one backward pass of a one-bucket model whose gradient is
an input the test knows (``probe_input``), after the runs: the tests check
what the engine made of it against references of their own.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import tiacc_training.torch.distributed as tdist
from tests._launch import exit_failed
from tiacc_training.torch.distributed import _runtime

# The optimiser's momentum (mode ``dgc`` tells the engine).
MOMENTUM = 0.9


def build_model(width: int = 96, hidden: int = 4) -> nn.Module:
    """The workers' model, the same on every rank (seeded): 32 inputs,
    ``hidden`` + 1 ReLU layers of ``width``, 10 outputs."""
    torch.manual_seed(1234)
    layers: list[nn.Module] = [nn.Linear(32, width), nn.ReLU()]
    for _ in range(hidden):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


# What each stranger sends to an engine port: a well-formed hello with the
# wrong job token, random bytes, and nothing at all.
STRANGERS = {
    "token": b"TIACCv1\0" + b"\x00" * 16 + b"\x00" * 12,
    "garbage": bytes(random.Random(5).getrandbits(8) for _ in range(64)),
    "silent": b"",
}


def knock_as_strangers(knocked: threading.Event) -> None:
    """Rank 0 only: connect to rank 1's engine port as each stranger in turn."""
    try:
        store = dist.distributed_c10d._get_default_store()
        key = "tiacc_training/engine1/addr/1"
        store.wait([key], datetime.timedelta(seconds=60))
        host, port = store.get(key).decode().rsplit(":", 1)
        for name, payload in STRANGERS.items():
            with socket.create_connection((host, int(port))) as stranger:
                stranger.sendall(payload)
                stranger.settimeout(60)
                try:
                    closed = stranger.recv(1) == b""
                except ConnectionResetError:
                    closed = True
            print(f"STRANGER_CLOSED {name}={closed}", flush=True)
    finally:
        knocked.set()


def hold_rendezvous_until(knocked: threading.Event) -> None:
    """Rank 0 publishes its engine address but waits for the others' until
    after the knock: rank 1 then has every address and waits in its ring
    connect, accepting on its listener, when the strangers arrive."""
    original = _runtime.default_store

    class Held:
        """The default store, whose wait for the engines' addresses waits for the knock."""

        def __init__(self, store: object) -> None:
            self.store = store

        def __getattr__(self, name: str) -> object:
            return getattr(self.store, name)

        def wait(self, keys: list[str], *args: object) -> None:
            if any("/addr/" in key for key in keys):
                knocked.wait(60)
            self.store.wait(keys, *args)

    _runtime.default_store = lambda: Held(original())


class KillAfterSubmit:
    """The engine, but the process SIGKILLs itself just after handing the
    engine bucket 0 of step ``step`` (while that allreduce runs)."""

    def __init__(self, engine: object, step: int) -> None:
        self.engine = engine
        self.step = step
        self.seen = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.engine, name)

    def allreduce_async(self, *args: object) -> None:
        self.engine.allreduce_async(*args)
        bucket = args[4]
        if bucket == 0:
            self.seen += 1
            if self.seen == self.step + 1:
                print(f"FAULT_AT {time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)


def train(args: argparse.Namespace, mode: str) -> nn.Module:
    rank = dist.get_rank()
    model = build_model(args.width)
    bucket_cap_mb = args.bucket_cap_mb
    if mode == "tiacc" and args.fault == "strangers" and rank == 0:
        knocked = threading.Event()
        hold_rendezvous_until(knocked)
        threading.Thread(target=knock_as_strangers, args=(knocked,), daemon=True).start()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    if mode == "tiacc":
        store = dist.distributed_c10d._get_default_store()
        engine_addr = store.get(f"tiacc_training/engine1/addr/{rank}").decode()
        print(f"PORTS {os.environ['MASTER_PORT']} {engine_addr.rsplit(':', 1)[1]}", flush=True)
    if mode == "tiacc" and args.fault == "kill" and rank == args.fault_rank:
        ddp._tiacc_hook_state.engine = KillAfterSubmit(  # type: ignore[attr-defined]
            ddp._tiacc_hook_state.engine,
            args.fault_step,  # type: ignore[attr-defined]
        )
    if mode == "tiacc" and args.fault == "layout":
        # DDP syncs rank 0's bucket layout to every rank, so a diverging
        # layout is sent straight to the engine: one rank's "bucket" is
        # shorter than the others'.
        n = 1000 if rank == args.fault_rank else 1024
        grad = torch.ones(n)
        print(f"FAULT_AT {time.time():.3f}", flush=True)
        tdist.get_engine().allreduce(grad.data_ptr(), n * 4, "float32", 0, True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=MOMENTUM)
    gen = torch.Generator().manual_seed(100 + rank)
    started = time.monotonic()
    # A learnable task: labels from a fixed random linear map of the input.
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(7))
    batch = 64 if args.learnable else 16
    for step in range(args.steps):
        if mode == "tiacc":
            print(f"STEP {step}", flush=True)
            time.sleep(args.step_sleep)
        x = torch.randn(batch, 32, generator=gen)
        if args.learnable:
            y = (x @ teacher).argmax(dim=1)
        else:
            y = torch.randint(0, 10, (16,), generator=gen)
        if mode == "tiacc" and args.fault == "nan" and rank == args.fault_rank:
            if step == args.fault_step:
                x[0, 0] = float("nan")
        if mode == "tiacc" and step == args.fault_step and rank == args.fault_rank:
            if args.fault == "stop":
                wait_for_own_record(rank, min_step=1)
                print(f"FAULT_AT {time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
        if mode == "tiacc" and args.fault == "slow" and rank == args.fault_rank:
            time.sleep(args.slow_seconds)
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"TRAIN_SECONDS {mode} {time.monotonic() - started:.2f}", flush=True)
    if args.learnable:
        # Held-out loss of the final model: the same 4096 samples everywhere.
        held_out = torch.Generator().manual_seed(999)
        x = torch.randn(4096, 32, generator=held_out)
        with torch.no_grad():
            loss = nn.functional.cross_entropy(model(x), (x @ teacher).argmax(dim=1))
        print(f"FINAL_LOSS {mode} {loss.item():.6f}", flush=True)
    return model


# Elements of the probe's one bucket: a length no bucket of the training
# model has, so Top-K's state for that bucket index starts afresh.
PROBE_LEN = 1013


def probe_input(kind: str, rank: int, world: int) -> torch.Tensor:
    """This rank's gradient for the probe. ``fp16``/``bf16``: world times an
    integer in 2..6 (either sign) off by a fraction below half the wire
    type's spacing, so each rank's averaged share rounds to the integer and
    the shares sum exactly in any order; ``random``: normal values, none
    of them a float16 value and no two of equal magnitude."""
    if kind == "random":
        return torch.randn(PROBE_LEN, generator=torch.Generator().manual_seed(500 + rank))
    delta = 2.0**-12 if kind == "fp16" else 2.0**-9
    values = []
    for i in range(PROBE_LEN):
        m = (i * 7 + rank * 3) % 10
        j = -m - 2 if m < 5 else m - 3
        sign = -1.0 if (i + rank) % 3 == 0 else 1.0
        values.append(world * (j + sign * delta))
    return torch.tensor(values, dtype=torch.float32)


def probe(args: argparse.Namespace) -> None:
    """One backward pass of a DDP model whose gradient is exactly this
    rank's ``probe_input`` (a bias-free linear layer fed that input): saves
    the input, the gradient DDP ends with, how many buckets the hook
    handed to the engine and what the engine's own counters
    (``tdist.stats()["engine"]``) gained in that pass, for the test to
    compare with its own references."""
    from tiacc_training.torch.distributed._hook import totals

    rank, world = dist.get_rank(), dist.get_world_size()
    x = probe_input(args.probe, rank, world)
    layer = nn.Linear(PROBE_LEN, 1, bias=False)
    ddp = nn.parallel.DistributedDataParallel(layer)
    before, counted = totals.engine_buckets, tdist.stats()["engine"]
    ddp(x.unsqueeze(0)).sum().backward()
    carried = totals.engine_buckets - before
    grad = layer.weight.grad.detach().reshape(-1).clone()
    torch.save(
        {
            "input": x,
            "grad": grad,
            "carried": carried,
            "counted": counters_gained(counted, tdist.stats()["engine"]),
        },
        args.out / f"probe_rank{rank}.pt",
    )


def counters_gained(before: dict, after: dict) -> dict:
    """Per (path, codec) whose counters changed: what each field gained."""
    gained = {}
    for key, row in after.items():
        old = before.get(key, {"buckets": 0, "bytes_in": 0, "wire": {}})
        if row["buckets"] == old["buckets"]:
            continue
        gained[key] = {
            "buckets": row["buckets"] - old["buckets"],
            "bytes_in": row["bytes_in"] - old["bytes_in"],
            "wire": {g: n - old["wire"].get(g, 0) for g, n in row["wire"].items()},
        }
    return gained


def check_dtypes(engine: object) -> None:
    """Every dtype DDP may hand the engine sums exactly (small integers)."""
    world = dist.get_world_size()
    # Top-K sparsifies float32 buckets: those sums are not exact by design.
    sparse = os.environ.get("LIGHT_TOPK_ALLREDUCE") == "1"
    dtypes = (torch.float16, torch.bfloat16, torch.float64) + (() if sparse else (torch.float32,))
    for dtype in dtypes:
        t = torch.full((1001,), float(dist.get_rank() + 1), dtype=dtype)
        engine.allreduce(t.data_ptr(), t.numel() * t.element_size(), str(dtype), 7, False)
        expected = world * (world + 1) / 2
        assert torch.all(t == expected), (dtype, t[:4])
    print("DTYPES_OK", flush=True)


def wait_for_own_record(rank: int, min_step: int, deadline: float = 30.0) -> None:
    """Waits until this rank's progress record on the job's board shows
    ``min_step`` or later: the record the others will read after a stop is
    then one of a step this rank reached, whatever the machine's speed."""
    from tiacc_training.torch.distributed._rendezvous import board_store, default_store
    from tiacc_training.torch.distributed._state import state

    client, _ = board_store(default_store())
    key = f"tiacc_training/engine{state.generation}/progress/{rank}"
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if client.check([key]) and int(client.get(key).decode().split()[1]) >= min_step:
            return
        time.sleep(0.02)
    raise RuntimeError(f"no progress record of step {min_step} or later under {key}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--modes", default="native,tiacc")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--bucket-cap-mb", type=float, default=0.02)
    parser.add_argument("--learnable", action="store_true")
    parser.add_argument(
        "--fault",
        choices=["none", "kill", "stop", "layout", "strangers", "nan", "slow"],
        default="none",
    )
    parser.add_argument("--slow-seconds", type=float, default=0.05)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--width", type=int, default=96)
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-step", type=int, default=3)
    parser.add_argument("--probe", choices=["none", "fp16", "bf16", "random"], default="none")
    args = parser.parse_args()
    try:
        for mode in args.modes.split(","):
            if mode == "dgc":
                tdist.init_tiacc_training(enable=True, topk_momentum=MOMENTUM)
            else:
                tdist.init_tiacc_training(enable=(mode == "tiacc"))
            model = train(args, mode)
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            args.out.mkdir(parents=True, exist_ok=True)
            torch.save(state, args.out / f"{mode}_rank{dist.get_rank()}.pt")
        if args.probe != "none":
            probe(args)
        engine = tdist.get_engine()
        print(f"ENGINE_CHANNELS={engine.num_channels if engine else 0}", flush=True)
        print(f"ENGINE_COMPRESSION={engine.compression if engine else None}", flush=True)
        print(f"ENGINE_2D={engine.two_d_members if engine else None}", flush=True)
        print(f"ENGINE_USES_2D={engine.two_d if engine else None}", flush=True)
        print(f"ENGINE_TRANSPORTS={engine.transports if engine else None}", flush=True)
        if engine is not None:
            check_dtypes(engine)
        dist.barrier()
        dist.destroy_process_group()
        return 0
    except Exception as exc:  # the tests read the WORKER_ERROR line
        # Rank 0 hosts the store: it stays up a moment so that ranks failing
        # just after it can still read the failure board and the records.
        hosts_store = dist.is_initialized() and dist.get_rank() == 0
        exit_failed(exc, linger=2.0 if hosts_store else 0.0)
        return 3


if __name__ == "__main__":
    sys.exit(main())
