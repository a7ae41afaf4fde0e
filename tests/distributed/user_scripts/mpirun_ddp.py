"""A native DDP script for Open MPI's mpirun: rank and size from OMPI_*.

Started as ``mpirun -np 2 -x MASTER_ADDR -x MASTER_PORT python mpirun_ddp.py``.
"""

import tiacc_training.torch.distributed as tdist

tdist.init_tiacc_training()

import os

import torch
import torch.distributed as dist
import torch.nn as nn


def main():
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    world_size = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    address = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 1))
    model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    for _ in range(12):
        x = torch.randn(16, 12, generator=g)
        optimizer.zero_grad()
        loss = (model(x) - x[:, :1]).pow(2).mean()
        loss.backward()
        optimizer.step()
    losses = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(losses, torch.tensor([loss.item()]))
    if rank == 0:
        for r, value in enumerate(losses):
            print(f"LOSS {r} {value.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
