"""PyTorch integration of tiacc-training.

``tiacc_training.torch.tiacc_torch_warp`` holds ``IndexTFRDataset`` (the
names follow the TI-ACC documents).
"""
