"""The DDP twin of horovod_mnist.py: the same model, data, sampler and
optimizer, trained through tiacc's DDP path (the two lines, torchrun's
variables), with the metrics averaged by dist.all_reduce. Its losses are
the reference of the Horovod script's.
"""

import tiacc_training.torch.distributed as tdist

tdist.init_tiacc_training()

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from horovod_mnist import Net, parse_args, synthetic_digits  # noqa: E402


def metric_average(value):
    tensor = torch.tensor(value)
    dist.all_reduce(tensor)
    return tensor.item() / dist.get_world_size()


def main():
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    train_dataset = synthetic_digits(args.samples, 0)
    test_dataset = synthetic_digits(args.samples // 2, 1)
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=world, rank=rank, seed=args.seed
    )
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, sampler=train_sampler
    )
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=world, rank=rank, shuffle=False
    )
    test_loader = torch.utils.data.DataLoader(
        test_dataset, batch_size=args.test_batch_size, sampler=test_sampler
    )

    net = Net()
    model = DDP(net)
    optimizer = optim.SGD(model.parameters(), lr=args.lr * world, momentum=args.momentum)

    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        total, seen = 0.0, 0
        for data, target in train_loader:
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(data)
            seen += len(data)
        train_loss = metric_average(total / seen)

        model.eval()
        test_loss, correct = 0.0, 0.0
        with torch.no_grad():
            for data, target in test_loader:
                output = net(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                correct += output.argmax(dim=1).eq(target).sum().item()
        test_loss = metric_average(test_loss / len(test_sampler))
        accuracy = metric_average(correct / len(test_sampler))
        if rank == 0:
            print(f"LOSS train{epoch} {train_loss:.6f}", flush=True)
            print(f"LOSS test{epoch} {test_loss:.6f}", flush=True)
            print(f"ACCURACY test{epoch} {accuracy:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
