"""A PyTorch Lightning script: Trainer(devices=2, strategy="ddp") on the CPU.

Started with a plain ``python``, Lightning starts the second process itself
(running this file again); under torchrun it joins torchrun's ranks.
"""

import tiacc_training.torch.distributed as tdist

tdist.init_tiacc_training()

import pytorch_lightning as pl
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(24, 48), nn.ReLU(), nn.Linear(48, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class PrintLoss(pl.Callback):
    def on_train_epoch_end(self, trainer, module):
        loss = trainer.callback_metrics["train_loss"].item()
        if trainer.is_global_zero:
            print(f"LOSS {trainer.current_epoch} {loss:.6f}", flush=True)
        if trainer.current_epoch == trainer.max_epochs - 1 and trainer.is_global_zero:
            print(f"WORLD {trainer.world_size}", flush=True)


def main():
    pl.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(384, 24, generator=g)
    y = (x[:, :3].argmax(dim=1)).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[PrintLoss()],
    )
    trainer.fit(Classifier(), loader)


if __name__ == "__main__":
    main()
