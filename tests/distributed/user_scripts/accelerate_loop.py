"""A Hugging Face Accelerate training loop (Accelerator, then prepare)."""

import tiacc_training.torch.distributed as tdist

tdist.init_tiacc_training()

import torch
import torch.nn as nn
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def main():
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 20, generator=g)
    y = (x[:, 0] * x[:, 1] > 0).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=False)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for epoch in range(2):
        total, count = 0.0, 0
        for inputs, targets in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            total, count = total + loss.item(), count + 1
        mean = accelerator.gather(torch.tensor([total / count])).mean().item()
        accelerator.print(f"LOSS {epoch} {mean:.6f}")
    accelerator.print(f"WORLD {accelerator.num_processes}")


if __name__ == "__main__":
    main()
