"""gk.reference has a float64 twin of each public entry point (the recipe in docs/testing.md,
"Checking your own loss"): policy_loss, selective_log_softmax and the fused-linear pair agree
with the fused ones, values and gradients."""

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels.testing.problems import ProblemSpec, make_problem


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-12))


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_policy_loss_twin(packed):
    problem = make_problem(ProblemSpec(vocab=50, with_ref=True, empty_sequence=True, seed=4))
    problem = problem.to_packed() if packed else problem
    logp = torch.log_softmax(problem.logits.double(), -1).gather(-1, problem.target_ids[..., None])[..., 0]
    entropy = torch.rand(logp.shape, dtype=torch.float64)
    weights = torch.rand(logp.shape, dtype=torch.float64)
    kwargs = dict(mask=problem.mask, cu_seqlens=problem.cu_seqlens, ref_logprobs=problem.ref_logprobs,
                  token_weights=weights, beta=0.05, entropy_coef=0.01)
    got, want = [], []
    for fn, out in ((gk.policy_loss, got), (gk.reference.policy_loss, want)):
        lp, ent = logp.clone().requires_grad_(), entropy.clone().requires_grad_()
        loss, metrics = fn(lp, problem.old_logprobs.double(), problem.advantages, entropy=ent, **kwargs)
        loss.backward()
        out.extend([loss.detach(), lp.grad, ent.grad, metrics])
    assert _rel(got[0], want[0]) < 1e-9 and _rel(got[1], want[1]) < 1e-9 and _rel(got[2], want[2]) < 1e-9
    assert got[3].keys() == want[3].keys()
    # The weights are not ignored: without them the loss moves.
    plain, _ = gk.reference.policy_loss(logp, problem.old_logprobs.double(), problem.advantages, entropy=entropy,
                                        **{**kwargs, "token_weights": None})
    assert _rel(plain, want[0]) > 1e-3


def test_fused_linear_twins():
    problem = make_problem(ProblemSpec(batch=3, seq_len=5, vocab=30, seed=2))
    gen = torch.Generator().manual_seed(0)
    hidden, weight, bias = (torch.randn(3, 5, 8, generator=gen), torch.randn(30, 8, generator=gen) / 3,
                            torch.randn(30, generator=gen))
    args, kwargs = problem.loss_args()
    grads = []
    for fn in (gk.fused_linear_gspo_loss, gk.reference.fused_linear_gspo_loss):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        loss, _ = fn(leaves[0], leaves[1], *args[1:], bias=leaves[2], chunk_size=4, logit_softcap=3.0, **kwargs)
        loss.backward()
        grads.append([loss.detach()] + [t.grad for t in leaves])
    assert all(_rel(a, b) < 1e-5 for a, b in zip(*grads))
    fused = gk.fused_linear_selective_log_softmax(hidden, weight, problem.target_ids, bias=bias, temperature=0.8,
                                                  return_entropy=True)
    twin = gk.reference.fused_linear_selective_log_softmax(hidden, weight, problem.target_ids, bias=bias,
                                                           temperature=0.8, return_entropy=True)
    assert _rel(fused[0], twin[0]) < 1e-6 and _rel(fused[1], twin[1]) < 1e-6
    plain = gk.reference.selective_log_softmax(hidden.double() @ weight.double().T + bias.double(),
                                               problem.target_ids, 0.8)
    assert torch.equal(plain, twin[0])
