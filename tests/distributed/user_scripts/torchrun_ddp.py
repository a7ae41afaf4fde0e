"""A native DDP training script, as people write it for torchrun.

Its own init_process_group (env://), DistributedSampler, SGD, a metric
averaged with dist.all_reduce, destroy_process_group at the end.
"""

import tiacc_training.torch.distributed as tdist

tdist.init_tiacc_training()

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def dataset():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 32, generator=g)
    y = (x[:, :4].sum(dim=1) > 0).long() + 2 * (x[:, 4] > 0).long()
    return TensorDataset(x, y)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--backend", default="gloo", help="'none': no backend argument")
    args = parser.parse_args()

    if args.backend == "none":
        dist.init_process_group()
    else:
        dist.init_process_group(backend=args.backend)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    model = DDP(model)
    data = dataset()
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2)
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            total += torch.tensor([loss.item() * len(y), len(y)])
        dist.all_reduce(total)
        if rank == 0:
            print(f"LOSS {epoch} {total[0].item() / total[1].item():.6f}", flush=True)
    if rank == 0:
        local_rank = os.environ.get("LOCAL_RANK")
        print(f"WORLD {dist.get_world_size()} LOCAL_RANK {local_rank}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
