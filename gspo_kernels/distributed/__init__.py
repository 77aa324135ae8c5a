"""GSPO over torch.distributed: vocab-parallel (tp_group), context-parallel (cp_group) and
data-parallel (global_normalizer) splits. The keywords live on gspo_loss and friends; this
package holds the collectives and the set-up helpers (docs/distributed.md). It imports no other
part of gspo_kernels but config.py: inputs/, token_stats/ and sequence/ call it, never the other way round."""

from .normalizer import global_normalizer
from .vocab_split import check_vocab_split

__all__ = ["check_vocab_split", "global_normalizer"]
