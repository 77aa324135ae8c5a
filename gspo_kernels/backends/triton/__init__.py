"""The Triton kernels: common.py holds what every kernel shares (the softmax-statistics merge,
the stats ending, the stage-3 row rule and gradient term, the log floor), written once as
csrc/gspo_math.h is for C++; row_kernels.py / row_ops.py are the backend over materialised
logits (one program per row), tile_kernels.py / tile_ops.py the fused-linear tile kernels."""
