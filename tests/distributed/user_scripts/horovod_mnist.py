"""A Horovod training script in the shape of Horovod's MNIST example.

hvd.init(), one thread per process, a DistributedSampler over hvd.size()
and hvd.rank(), the learning rate scaled by the number of ranks, the
model's parameters and the optimizer's state broadcast from rank 0,
DistributedOptimizer (with fp16 compression or Adasum on request), and the
metrics averaged over the ranks with hvd.allreduce. The data is synthetic
(28x28 one-channel images whose label follows from the pixels), and there
is no dropout, so that the run is deterministic. Rank 0 prints
``LOSS <key> <value>`` per epoch. The only Horovod-specific line that
changes for tiacc is the import.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import tiacc_training.torch.horovod as hvd


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Horovod MNIST-style example")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--test-batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--fp16-allreduce", action="store_true", default=False)
    parser.add_argument("--use-adasum", action="store_true", default=False)
    parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
    return parser.parse_args(argv)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_digits(samples, seed):
    """Images and labels: the label is the brightest of ten fixed patterns."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(10, 28 * 28, generator=g)
    images = torch.randn(samples, 1, 28, 28, generator=g)
    labels = (images.view(samples, -1) @ patterns.t()).argmax(dim=1)
    return torch.utils.data.TensorDataset(images, labels)


def metric_average(value, name):
    return hvd.allreduce(torch.tensor(value), name=name).item()


def main():
    args = parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    train_dataset = synthetic_digits(args.samples, 0)
    test_dataset = synthetic_digits(args.samples // 2, 1)
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank(), seed=args.seed
    )
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, sampler=train_sampler
    )
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False
    )
    test_loader = torch.utils.data.DataLoader(
        test_dataset, batch_size=args.test_batch_size, sampler=test_sampler
    )

    model = Net()
    # Adasum needs no scaling of the learning rate; averaging does.
    lr_scaler = 1 if args.use_adasum else hvd.size()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor,
    )

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
        train_loss = metric_average(total / seen, "avg_train_loss")

        model.eval()
        test_loss, correct = 0.0, 0.0
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                correct += output.argmax(dim=1).eq(target).sum().item()
        test_loss = metric_average(test_loss / len(test_sampler), "avg_loss")
        accuracy = metric_average(correct / len(test_sampler), "avg_accuracy")
        if hvd.rank() == 0:
            print(f"LOSS train{epoch} {train_loss:.6f}", flush=True)
            print(f"LOSS test{epoch} {test_loss:.6f}", flush=True)
            print(f"ACCURACY test{epoch} {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()
