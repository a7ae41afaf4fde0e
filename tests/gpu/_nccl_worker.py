"""One rank of a small DDP run on CUDA, for the GPU tests.

Launched by the GPU tests with torchrun-style variables. Trains a small
MLP on ``cuda:LOCAL_RANK % device_count`` natively or through the tiacc
engine (``--transport nccl``, ``tcp`` or ``auto``; the algorithm comes from
the environment: ``LIGHT_*``, ``TIACC_TRAINING_*``) and saves the final
parameters per rank. Reads each step's loss on the host, as a training loop
that logs does, so a failure on another rank surfaces at the next step.
Prints ``SECONDS init <s> train <s> save <s>`` (where its time went) and
``DONE <mode> <transport used>`` at the end; ``--nan-rank`` puts a NaN
into that rank's input at ``--nan-step``. ``TIACC_TEST_STACKS_AFTER=<s>``
dumps every thread's Python stack to stderr each ``<s>`` seconds the run
is still going (what a stuck rank waits on).

``--cases FILE`` runs many cases in these same processes, one after the
other (a JSON list of ``{"id", "env", "channels"}``, each optionally with
its own ``"mode"``, ``"transport"`` and ``"expect_transport"``, else the
command line's): each case's settings replace the previous case's
variables, ``init_tiacc_training`` runs again (which rebuilds the engines
for the new settings, or turns them off for a native case), and the
case's parameters go to ``<out>/<id>/``, with ``CASE <id> SECONDS ...``,
``CASE <id> LOSS ...`` and
``CASE <id> DONE <mode> <transport>`` lines. A case that fails prints
``CASE <id> FAILED ...`` and the cases after it still run (``tests/_cases``);
the run then ends with exit code 3, naming the failed cases. Starting the
ranks, CUDA and the default group once for a whole matrix is what makes the
GPU suite short.
``--device cpu`` (with ``--backend gloo --transport tcp``) runs the same
loop on the CPU, where the tests check it without a GPU.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import tiacc_training.torch.distributed as tdist
from tests._cases import run_cases
from tests._launch import exit_failed
from tests.distributed.ddp_worker import build_model


def train(args: argparse.Namespace, out: Path, channels: int) -> tuple[str, float, float, str]:
    """One run: init, DDP training, the parameters saved under ``out``.

    ``args.mode``, ``args.transport`` and ``args.expect_transport`` are
    this run's (a case's, under ``--cases``). Returns the transport used,
    the mean loss of the first and last steps, and the seconds of each
    phase (``init ... train ... save ...``: where a launch's time goes).
    """
    started = time.monotonic()
    tdist.init_tiacc_training(
        backend=args.backend,
        enable=args.mode == "tiacc",
        num_streams=channels,
        transport=args.transport,
        # The engine's timeout: 120 s unless the test asks for another.
        timeout=float(os.environ.get("TIACC_TRAINING_TIMEOUT", "120")),
    )
    rank = dist.get_rank()
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    model = build_model(args.width, hidden=6).to(device)
    ddp = nn.parallel.DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=args.bucket_cap_mb,
    )
    # With the engine off DDP keeps a timing-only state (native=True).
    hook_state = getattr(ddp, "_tiacc_hook_state", None)
    hooked = hook_state is not None and not hook_state.native
    assert hooked == (args.mode == "tiacc"), f"{args.mode} run, tiacc hook attached: {hooked}"
    if args.mode == "tiacc":
        if device.type == "cuda":
            expected = args.expect_transport or args.transport
            assert tdist.cuda_transport() == expected, tdist.cuda_transport()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    built = time.monotonic()
    # Wall clock, as the ERROR_AT of a failure: a failed run's phases too.
    print(f"BUILT_AT {time.time():.3f} after {built - started:.2f}s", flush=True)
    gen = torch.Generator().manual_seed(100 + rank)
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(7))
    losses: list[float] = []
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=gen)
        y = (x @ teacher).argmax(dim=1)
        if rank == args.nan_rank and step == args.nan_step:
            x[0, 0] = float("nan")
        loss = nn.functional.cross_entropy(ddp(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    trained = time.monotonic()
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    assert all(torch.isfinite(v).all() for v in state.values()), "non-finite parameters"
    out.mkdir(parents=True, exist_ok=True)
    torch.save(state, out / f"{args.mode}_rank{rank}.pt")
    if args.mode != "tiacc":
        transport = args.backend
    else:
        transport = tdist.cuda_transport() if device.type == "cuda" else "tcp"
    # Mean losses of the first and the last five steps (one batch is noisy).
    n = min(5, len(losses))
    dist.barrier()
    del ddp, opt
    end = time.monotonic()
    phases = f"init {built - started:.2f} train {trained - built:.2f} save {end - trained:.2f}"
    return transport, sum(losses[:n]) / n, sum(losses[-n:]) / n, phases


def run_matrix(args: argparse.Namespace) -> int:
    """Every case of ``--cases`` in turn (see the module docstring)."""

    def run_one(case: dict) -> None:
        own = argparse.Namespace(**vars(args))
        for key in ("mode", "transport", "expect_transport"):
            setattr(own, key, case.get(key, getattr(args, key)))
        transport, first, last, phases = train(own, args.out / case["id"], case["channels"])
        print(f"CASE {case['id']} SECONDS {phases}", flush=True)
        print(f"CASE {case['id']} LOSS first {first:.6f} last {last:.6f}", flush=True)
        print(f"CASE {case['id']} DONE {own.mode} {transport}", flush=True)

    # A rank that failed waits for peers stuck in a collective to time out
    # (the engine's 120 s) and fail in turn.
    failed = run_cases(json.loads(Path(args.cases).read_text()), run_one, timeout=180)
    if failed:
        raise RuntimeError(f"cases failed: {', '.join(failed)}")
    tdist.shutdown()
    dist.destroy_process_group()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", choices=["native", "tiacc"], required=True)
    parser.add_argument("--transport", choices=["auto", "nccl", "tcp"], default="nccl")
    # The transport the engine must end up with (default: --transport).
    parser.add_argument("--expect-transport", choices=["nccl", "tcp"])
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    parser.add_argument("--channels", type=int, default=1)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--bucket-cap-mb", type=float, default=0.1)
    parser.add_argument("--nan-rank", type=int, default=-1)
    parser.add_argument("--nan-step", type=int, default=3)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--cases", help="a JSON file of cases to run one after the other")
    args = parser.parse_args()
    if os.environ.get("TIACC_TEST_STACKS_AFTER"):
        # Every thread's Python stack on stderr while the run is still going
        # after that many seconds (and as often again): what a stuck rank waits on.
        every = float(os.environ["TIACC_TEST_STACKS_AFTER"])
        faulthandler.dump_traceback_later(every, repeat=True)
    try:
        # Bitwise comparisons need deterministic kernels and no TF32.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.use_deterministic_algorithms(True)
        if args.cases:
            return run_matrix(args)
        transport, first, last, phases = train(args, args.out, args.channels)
        print(f"SECONDS {phases}", flush=True)
        print(f"LOSS first {first:.6f} last {last:.6f}", flush=True)
        print(f"DONE {args.mode} {transport}", flush=True)
        tdist.shutdown()
        dist.destroy_process_group()
        return 0
    except Exception as exc:  # the tests read the WORKER_ERROR line
        exit_failed(exc, linger=5)
        return 3


if __name__ == "__main__":
    sys.exit(main())
