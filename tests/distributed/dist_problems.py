"""The whole GSPO problem of a distributed case, built the same on every rank from the case's
seed: logits (or hidden states and an lm_head), targets with pad ids outside the mask, old,
reference and rollout log-probs near the current ones; and gspo_loss's options and tensor
keywords for it."""

from __future__ import annotations

import torch

from gspo_kernels.testing.problem_split import even_parts

from dist_grid import Case

BATCH, SEQ_LEN, VOCAB, HIDDEN = 4, 7, 37, 8
PACKED_LENGTHS = (6, 1, 0, 9, 5)  # 1 and 0: some rank holds an empty part, or nothing at all


def stress_rows(p: dict, vocab: int, world: int) -> None:
    """Rows of sequence 0 that stress the merge across the ranks' vocab slices; the first rank's
    slice is [0, first)."""
    first = even_parts(vocab, world)[0][1]
    logits, targets, mask = p["logits"], p["targets"], p["mask"]
    row = logits[0]
    mask[0, :6] = True
    targets[0, :6] = torch.tensor([first + 1, first + 2, 1, 2, vocab + 3, first])
    row[0, :first] = 130.0  # the target's slice lies ~130 below the peak: its weight underflows
    row[1, :first] = float("-inf")  # a slice with no mass
    row[2, :first] = float("-inf")  # ... holding the target: logp = -inf
    row[3, 0] = float("nan")  # a NaN logit in the loss: NaN log-prob, NaN gradient row
    row[4, :] = row[4, :] * 3  # a target outside the global vocab: NaN log-prob and gradient row
    row[5, first + 2] = float("inf")  # +inf on another rank's slice than the target's
    mask[0, 6] = False
    row[6, 1] = float("nan")  # outside the loss: zeros, whatever it holds


def whole_problem(case: Case, vocab: int, seed: int, world: int = 2) -> dict:
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    if case.layout == "padded":
        token_shape, cu, num_seqs = (BATCH, SEQ_LEN), None, BATCH
        mask = torch.rand(token_shape, generator=gen) < 0.8
        mask[:, :2] = False  # a prompt: rank 0's first columns are outside the loss
        mask[1, : SEQ_LEN // 2 + 1] = False  # sequence 1 has no response token on rank 0's part
        mask[3] = False  # an empty sequence
    else:
        lengths = torch.tensor(PACKED_LENGTHS)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        token_shape, num_seqs = (int(cu[-1]),), len(PACKED_LENGTHS)
        mask = torch.rand(token_shape, generator=gen) < 0.85
    targets = torch.randint(0, vocab, token_shape, generator=gen)
    targets = torch.where(mask, targets, torch.full_like(targets, -100))  # pad ids outside the loss
    p = {"token_shape": token_shape, "cu_seqlens": cu, "num_seqs": num_seqs, "mask": mask, "targets": targets,
         "advantages": torch.randn(num_seqs, generator=gen, dtype=torch.float64).float()}
    if case.linear:
        p["hidden"] = torch.randn(*token_shape, HIDDEN, generator=gen).to(dtype)
        p["weight"] = (torch.randn(vocab, HIDDEN, generator=gen) * 0.7).to(dtype)
        p["bias"] = (torch.randn(vocab, generator=gen) * 0.3).to(dtype)
        logits = (p["hidden"].double() @ p["weight"].double().T + p["bias"].double())
    else:
        logits = torch.randn(*token_shape, vocab, generator=gen, dtype=torch.float64) * 2.0
        p["logits"] = logits.to(dtype)
    if case.edges:
        stress_rows(p, vocab, world)
        logits = p["logits"].double()
    # Old, reference and rollout log-probs near the current ones: ratios inside and outside
    # the clip range, none on its edge.
    current = torch.log_softmax(logits, -1).gather(-1, targets.clamp(0, vocab - 1).unsqueeze(-1)).squeeze(-1)
    for name, scale in (("old_logprobs", 0.08), ("ref_logprobs", 0.2), ("rollout_logprobs", 0.05)):
        p[name] = (current + torch.randn(token_shape, generator=gen, dtype=torch.float64) * scale).float()
    return p


def options_of(case: Case) -> dict:
    opts = dict(level=case.level, loss_agg=case.loss_agg, backend=case.backend, eps_low=0.02, eps_high=0.03)
    opts.update(case.options)
    opts.pop("reduce_hidden_grad", None)
    if case.loss_agg == "seq-mean-token-sum-norm":
        opts["max_len"] = SEQ_LEN if case.layout == "padded" else max(PACKED_LENGTHS)
    return opts


def per_call(case: Case, p: dict, rows=None, seqs=None) -> dict:
    """gspo_loss's tensor keywords for the whole problem, or for some rows and sequences."""
    def take(name):
        t = p[name].reshape(-1)
        return t if rows is None else t[rows]
    kw = {"old_logprobs": take("old_logprobs"), "mask": take("mask")}
    opts = dict(case.options)
    if opts.get("beta", 0) > 0:
        kw["ref_logprobs"] = take("ref_logprobs")
    if "rollout_correction" in opts or "off_policy_mask_threshold" in opts:
        kw["rollout_logprobs"] = take("rollout_logprobs")
    kw["advantages"] = p["advantages"] if seqs is None else p["advantages"][seqs[0]:seqs[1]]
    return kw
