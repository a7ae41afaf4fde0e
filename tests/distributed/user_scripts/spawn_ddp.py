"""A native DDP script that starts its own ranks with mp.spawn.

Each child imports this file again; it joins the group with an explicit
init_method, rank and world size.
"""

import tiacc_training.torch.distributed as tdist

tdist.init_tiacc_training()

import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def train(rank, world_size, port):
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1 + rank)
    for step in range(20):
        x = torch.randn(32, 16, generator=g)
        y = x.sum(dim=1, keepdim=True).sin()
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 10 == 9:
            print(f"LOSS {step} {loss.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(train, args=(2, int(sys.argv[1])), nprocs=2, join=True)
