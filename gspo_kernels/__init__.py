"""Fused GSPO policy loss: Triton and C++/CUDA kernels over the logits, checked against a
plain PyTorch reference."""

from . import distributed, reference
from .config import GSPOConfig
from .fused_linear import FusedLinearGSPOLoss, fused_linear_gspo_loss, fused_linear_selective_log_softmax
from .loss import GSPOLoss, gspo_loss
from .policy_loss import policy_loss
from .token_stats import selective_log_softmax

__version__ = "0.1.0"

__all__ = [
    "FusedLinearGSPOLoss",
    "GSPOConfig",
    "GSPOLoss",
    "distributed",
    "fused_linear_gspo_loss",
    "fused_linear_selective_log_softmax",
    "gspo_loss",
    "policy_loss",
    "reference",
    "selective_log_softmax",
]
