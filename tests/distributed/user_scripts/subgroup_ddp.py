"""DDP over a sub-group (process_group=new_group(...)), with torchrun."""

import tiacc_training.torch.distributed as tdist

tdist.init_tiacc_training()

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    halves = [dist.new_group(list(range(0, world, 2))), dist.new_group(list(range(1, world, 2)))]
    mine = halves[rank % 2]
    torch.manual_seed(0)
    model = DDP(nn.Linear(10, 1), process_group=mine)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(10):
        x = torch.randn(8, 10, generator=g)
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
    weight = model.module.weight.detach().clone()
    weights = [torch.zeros_like(weight) for _ in range(world)]
    dist.all_gather(weights, weight)
    losses = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(losses, torch.tensor([loss.item()]))
    if rank == 0:
        for r in range(world):
            print(f"LOSS {r} {losses[r].item():.6f}", flush=True)
        same = [torch.equal(weights[r % 2], weights[r]) for r in range(world)]
        print(f"HALVES_SYNCED {all(same)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
