"""Fused GSPO policy loss: Triton and C++/CUDA kernels over the logits, checked against a
plain PyTorch reference."""

from . import reference
from .config import GSPOConfig
from .loss import GSPOLoss, gspo_loss
from .token_stats import selective_log_softmax

__version__ = "0.1.0"

__all__ = ["GSPOConfig", "GSPOLoss", "gspo_loss", "reference", "selective_log_softmax"]
