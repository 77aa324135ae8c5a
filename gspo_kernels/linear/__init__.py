"""Fused linear: the GSPO loss from hidden states and the lm_head weight, the `[N, V]` logits
never held whole. api.py is the public side; plan.py resolves a call; chunked.py and sweeps.py
are the path every backend runs (products.py its matmuls); tiled.py the Triton tile kernels."""

from .api import FusedLinearGSPOLoss, fused_linear_gspo_loss, fused_linear_selective_log_softmax
from .plan import default_chunk_rows

__all__ = ["FusedLinearGSPOLoss", "default_chunk_rows", "fused_linear_gspo_loss", "fused_linear_selective_log_softmax"]
