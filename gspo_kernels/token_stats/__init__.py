"""Stages 1 and 3 on materialised logits behind one autograd Function (on_logits.py), and the
wiring every path shares, the fused-linear Functions included: what autograd hands the kernels
and the bad-target rule (upstream.py), and stage 3 over a slice of the vocabulary
(slice_grad.py)."""
