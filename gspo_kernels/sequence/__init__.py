"""Stage 2: the sequence math on per-token `[B, T]` / `[N]` and per-sequence tensors, one
implementation for every backend and entry point. It knows nothing of kernels: it takes the
per-token log-probs and entropies (autograd-connected) and a checked LossBatch, and returns the
loss and metrics, with the gradient written by hand (gradient.py)."""
