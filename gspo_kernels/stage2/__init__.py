"""Stage 2: the sequence math on `[N]` per-token and `[S]` per-sequence tensors, one
implementation for every backend and entry point. It knows nothing of kernels: it takes the
per-token log-probs and entropies (autograd-connected) and returns the loss and metrics."""
