"""One rank of a small DDP training run, for the multi-process tests.

Launched by the tests (plain processes with torchrun-style variables), by
torchrun and by mpirun. Trains a small MLP for a few steps natively and/or
through the tiacc engine and saves the final parameters per rank. Mode
``dgc`` is the engine with Top-K's momentum correction for the optimiser's
momentum (``topk_momentum=0.9``; Top-K itself comes from the environment).

Fault injection (``--fault``): ``kill`` and ``stop`` make ``--fault-rank``
SIGKILL or SIGSTOP itself at ``--fault-step``; ``layout`` makes that rank
allreduce a shorter buffer than the others; ``token`` makes rank 0 knock on rank 1's engine port
with a wrong job token before the engine connects; ``nan`` puts a NaN into
that rank's input.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import socket
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import tiacc_training.torch.distributed as tdist
from tests._launch import exit_failed
from tiacc_training.torch.distributed import _engines

# The optimiser's momentum (mode ``dgc`` tells the engine).
MOMENTUM = 0.9


def build_model(width: int = 96) -> nn.Module:
    torch.manual_seed(1234)
    layers: list[nn.Module] = [nn.Linear(32, width), nn.ReLU()]
    for _ in range(4):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def knock_with_wrong_token(knocked: threading.Event) -> None:
    """Rank 0 only: connect to rank 1's engine port with a bad hello."""
    try:
        store = dist.distributed_c10d._get_default_store()
        key = "tiacc_training/engine1/addr/1"
        store.wait([key], datetime.timedelta(seconds=60))
        host, port = store.get(key).decode().rsplit(":", 1)
        stranger = socket.create_connection((host, int(port)))
        stranger.sendall(b"TIACCv1\0" + b"\x00" * 16 + b"\x00" * 12)
        stranger.settimeout(30)
        closed = stranger.recv(1) == b""
        print(f"STRANGER_CLOSED={closed}", flush=True)
    finally:
        knocked.set()


def hold_rendezvous_until(knocked: threading.Event) -> None:
    """Rank 0 joins the rings only after the knock: rank 1's listener is
    then certainly still open when the stranger arrives."""
    original = _engines.connect_tcp

    class Held:
        """The engine, whose connect() waits for the knock."""

        def __init__(self, engine: object) -> None:
            self.engine = engine

        def __getattr__(self, name: str) -> object:
            return getattr(self.engine, name)

        def connect(self, *args: object) -> None:
            knocked.wait(60)
            self.engine.connect(*args)

    def delayed(engine: object, *args: object) -> None:
        original(Held(engine), *args)

    _engines.connect_tcp = delayed


def train(args: argparse.Namespace, mode: str) -> nn.Module:
    rank = dist.get_rank()
    model = build_model()
    bucket_cap_mb = args.bucket_cap_mb
    if mode == "tiacc" and args.fault == "token" and rank == 0:
        knocked = threading.Event()
        hold_rendezvous_until(knocked)
        threading.Thread(target=knock_with_wrong_token, args=(knocked,), daemon=True).start()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    if mode == "tiacc" and args.fault == "layout":
        # DDP syncs rank 0's bucket layout to every rank, so a diverging
        # layout is sent straight to the engine: one rank's "bucket" is
        # shorter than the others'.
        n = 1000 if rank == args.fault_rank else 1024
        grad = torch.ones(n)
        tdist.get_engine().allreduce(grad.data_ptr(), n * 4, "float32", 0, True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=MOMENTUM)
    gen = torch.Generator().manual_seed(100 + rank)
    # A learnable task: labels from a fixed random linear map of the input.
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(7))
    batch = 64 if args.learnable else 16
    for step in range(args.steps):
        x = torch.randn(batch, 32, generator=gen)
        if args.learnable:
            y = (x @ teacher).argmax(dim=1)
        else:
            y = torch.randint(0, 10, (16,), generator=gen)
        if mode == "tiacc" and args.fault == "nan" and rank == args.fault_rank:
            if step == args.fault_step:
                x[0, 0] = float("nan")
        if mode == "tiacc" and step == args.fault_step and rank == args.fault_rank:
            if args.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if args.fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if args.learnable:
        # Held-out loss of the final model: the same 4096 samples everywhere.
        held_out = torch.Generator().manual_seed(999)
        x = torch.randn(4096, 32, generator=held_out)
        with torch.no_grad():
            loss = nn.functional.cross_entropy(model(x), (x @ teacher).argmax(dim=1))
        print(f"FINAL_LOSS {mode} {loss.item():.6f}", flush=True)
    return model


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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--modes", default="native,tiacc")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--bucket-cap-mb", type=float, default=0.02)
    parser.add_argument("--learnable", action="store_true")
    parser.add_argument(
        "--fault", choices=["none", "kill", "stop", "layout", "token", "nan"], default="none"
    )
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-step", type=int, default=3)
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
        engine = tdist.get_engine()
        print(f"ENGINE_CHANNELS={engine.num_channels if engine else 0}", flush=True)
        print(f"ENGINE_COMPRESSION={engine.compression if engine else None}", flush=True)
        print(f"ENGINE_2D={engine.two_d_members if engine else None}", flush=True)
        print(f"ENGINE_USES_2D={engine.two_d if engine else None}", flush=True)
        if engine is not None:
            check_dtypes(engine)
        dist.barrier()
        dist.destroy_process_group()
        return 0
    except Exception as exc:  # the tests read the WORKER_ERROR line
        exit_failed(exc)
        return 3


if __name__ == "__main__":
    sys.exit(main())
