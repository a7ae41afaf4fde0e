"""The adaptive mixed-precision policy under its second TI-ACC module name.

``tiacc_training.torch.adaptfp16.MixedPrecision_TrainingPolicy`` is the same
class as ``tiacc_training.torch.tiacc_torch_warp.MixedPrecision_TrainingPolicy``.
"""

from tiacc_training.torch._amp import MixedPrecision_TrainingPolicy

__all__ = ["MixedPrecision_TrainingPolicy"]
