"""Several trials in one process: a new process group for each.

The first trial joins through a file:// init_method with an explicit
timeout, the second through a TCPStore the script makes itself (store=).
Launched by torchrun; the script reads RANK and WORLD_SIZE itself.
"""

import tiacc_training.torch.distributed as tdist

tdist.init_tiacc_training()

import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def trial(lr):
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(10):
        x = torch.randn(16, 8, generator=g)
        optimizer.zero_grad()
        loss = (model(x) - x.mean(dim=1, keepdim=True)).pow(2).mean()
        loss.backward()
        optimizer.step()
    return loss.item()


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    folder = sys.argv[1]
    dist.init_process_group(
        "gloo",
        init_method=f"file://{folder}/rendezvous",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    first = trial(0.05)
    dist.destroy_process_group()

    store = dist.TCPStore("127.0.0.1", int(sys.argv[2]), world, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    second = trial(0.1)
    dist.destroy_process_group()
    if rank == 0:
        print(f"LOSS 0 {first:.6f}", flush=True)
        print(f"LOSS 1 {second:.6f}", flush=True)


if __name__ == "__main__":
    main()
