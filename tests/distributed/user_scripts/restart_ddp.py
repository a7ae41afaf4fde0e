"""A DDP script that checkpoints every step and resumes, as jobs run under
``torchrun --max-restarts``.

Its own ``init_process_group`` (or none with ``--backend none``), a
checkpoint written by rank 0 after every step, and faults planted in
attempts: ``--kill-rank R --faults 0:4,1:7`` makes rank R kill itself with
SIGKILL (or raise, ``--fault raise``) after step 4 of attempt 0 and after
step 7 of attempt 1 (``TORCHELASTIC_RESTART_COUNT``). Rank 0 prints
``LOSS <step> <loss> WORLD <size>`` for every step it trains, and ``ATTEMPT <n> RESUMED
<step>`` when it starts from a checkpoint. Without ``--tiacc`` it is the
stock script (native DDP), for comparison.
"""

import argparse
import os
import signal
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--tiacc", action="store_true")
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--ckpt", required=True)
parser.add_argument("--backend", default="gloo", help="'none': no backend argument")
parser.add_argument("--kill-rank", type=int, default=-1)
parser.add_argument("--faults", default="", help="attempt:step pairs, comma-separated")
parser.add_argument("--fault", default="kill", choices=("kill", "raise"))
parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep after each step")
parser.add_argument("--reinit", action="store_true", help="init, destroy, then init again")
parser.add_argument("--stop-rank", type=int, default=-1, help="stops itself (SIGSTOP)")
parser.add_argument("--stop-at", default="before-init", choices=("before-init", "before-ddp"))
parser.add_argument("--stop-seconds", type=float, default=10.0, help="until SIGCONT")
parser.add_argument(
    "--global-batch",
    type=int,
    default=0,
    help="one batch of this many samples per step, split over the ranks (0: 32 per rank)",
)
args = parser.parse_args()

if args.tiacc:
    import tiacc_training.torch.distributed as tdist

    tdist.init_tiacc_training()

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def batch(step: int, rank: int, world: int) -> tuple:
    """32 samples of the rank's own, or its share of a global batch: the same
    data and mean gradient for any world size that divides it."""
    if args.global_batch:
        g = torch.Generator().manual_seed(1000 * step)
        x = torch.randn(args.global_batch, 16, generator=g).chunk(world)[rank]
    else:
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(32, 16, generator=g)
    return x, (x[:, :3].sum(dim=1) > 0).long()


def stop_here(where: str) -> None:
    """SIGSTOPs this rank at ``where`` if asked; a child sends SIGCONT later.

    Woken, the rank exits at once (code 3), so the launcher ends the job
    without waiting out its grace period for a stopped process.
    """
    if args.stop_at != where or int(os.environ.get("RANK", "-1")) != args.stop_rank:
        return
    pid = os.getpid()
    print(f"STOPPING rank {args.stop_rank} {where} at {time.time():.3f}", flush=True)
    if os.fork() == 0:
        # Out of the launcher's reach: it signals the rank's whole group.
        os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(args.stop_seconds)
        os.kill(pid, signal.SIGCONT)
        os._exit(0)
    os.kill(pid, signal.SIGSTOP)
    os._exit(3)


def init() -> None:
    if args.backend == "none":
        dist.init_process_group()
    else:
        dist.init_process_group(backend=args.backend)


def main() -> None:
    stop_here("before-init")
    init()
    if args.reinit:
        dist.barrier()
        dist.destroy_process_group()
        init()
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    start = 0
    if os.path.exists(args.ckpt):
        saved = torch.load(args.ckpt)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start = saved["step"] + 1
        if rank == 0:
            print(f"ATTEMPT {attempt} RESUMED {start}", flush=True)
    stop_here("before-ddp")
    ddp = DDP(model)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(start, args.steps):
        x, y = batch(step, rank, dist.get_world_size())
        optimizer.zero_grad()
        loss = loss_fn(ddp(x), y)
        loss.backward()
        optimizer.step()
        value = loss.detach().clone()
        dist.all_reduce(value)
        if rank == 0:
            world = dist.get_world_size()
            print(f"LOSS {step} {value.item() / world:.6f} WORLD {world}", flush=True)
            tmp = args.ckpt + ".tmp"
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                tmp,
            )
            os.replace(tmp, args.ckpt)
        dist.barrier()
        time.sleep(args.step_seconds)
        if rank == args.kill_rank and f"{attempt}:{step}" in args.faults.split(","):
            if args.fault == "raise":
                raise RuntimeError(f"planted fault on rank {rank} after step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        print(f"DONE attempt {attempt}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except BaseException as err:
        # When each rank failed, and with what, in one line (the tests
        # measure how long after a stopped rank the others gave up).
        first = str(err).splitlines()[0] if str(err) else ""
        print(
            f"RANK_FAILED {os.environ.get('RANK')} at {time.time():.3f}: "
            f"{type(err).__name__}: {first}",
            flush=True,
        )
        raise
    sys.exit(0)
