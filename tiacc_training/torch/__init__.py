"""PyTorch integration of tiacc-training.

``tiacc_training.torch.tiacc_torch_warp`` holds ``IndexTFRDataset`` and
``MixedPrecision_TrainingPolicy`` (also in ``tiacc_training.torch.adaptfp16``),
and ``tiacc_training.torch.distributed`` holds ``init_tiacc_training`` (the
names follow the TI-ACC documents).
"""
