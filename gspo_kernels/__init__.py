"""Fused GSPO policy loss: Triton and C++/CUDA kernels over the logits, checked against a
plain PyTorch reference.

The house, top down: loss.py, policy_loss.py and linear/ are the entry points; config.py their
options; inputs/ checks what they are handed, token_stats/ (stages 1 and 3 on logits) and
sequence/ (stage 2, the sequence math) do the work, on backends/ (the kernels); distributed/
holds the collectives. testing/ (the float64 reference,
problems and their parallel splits, verification, tiny models), bench/ and cli/ sit on top.
"""

from . import compat  # noqa: F401  (first: a torch older than the supported range is refused there, by name)
from . import distributed
from .config import GSPOConfig, LinearConfig
from .inputs.kept_tokens import KeptTokens
from .linear import FusedLinearGSPOLoss, fused_linear_gspo_loss, fused_linear_selective_log_softmax
from .loss import GSPOLoss, gspo_loss
from .policy_loss import policy_loss
from .token_stats.on_logits import selective_log_softmax
from .testing import reference

__version__ = "0.1.0"

__all__ = [
    "FusedLinearGSPOLoss",
    "GSPOConfig",
    "GSPOLoss",
    "KeptTokens",
    "LinearConfig",
    "distributed",
    "fused_linear_gspo_loss",
    "fused_linear_selective_log_softmax",
    "gspo_loss",
    "policy_loss",
    "reference",
    "selective_log_softmax",
]
