"""Stages 1 and 3 on materialised logits behind one autograd Function, and the wiring every
path shares (the fused-linear Functions included): what autograd hands the kernels, the
bad-target rule, and stage 3 over a slice of the vocabulary."""
