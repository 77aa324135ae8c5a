"""Finite differences in float64 on the torch path: checks the stage-3 gradient formula itself
(entropy term included) and stage 2's autograd, independently of the reference."""

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels.testing.problems import ProblemSpec, make_problem


def test_token_stats_gradient_formula(seed):
    logits = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (2, 3))

    def f(x):
        logp, entropy = gk.selective_log_softmax(x, targets, temperature=0.8, return_entropy=True, backend="torch")
        return logp, entropy

    assert torch.autograd.gradcheck(f, (logits,))


@pytest.mark.parametrize("level", ["sequence", "sequence_token", "token"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_loss_gradient(level, packed, seed):
    problem = make_problem(ProblemSpec(batch=4, seq_len=5, vocab=6, dtype=torch.float64, with_ref=True,
                                       empty_sequence=True, temperature=0.9, seed=seed))
    if packed:
        problem = problem.to_packed()
    args, kwargs = problem.loss_args()

    def f(x):
        loss, _ = gk.gspo_loss(x, *args[1:], **kwargs, level=level, beta=0.1, kl_estimator="k2",
                               entropy_coef=0.02, backend="torch")
        return loss

    # eps well below the clip range: a finite difference must not step across a clip edge.
    x = problem.logits.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(f, (x,), eps=1e-7, atol=1e-7, rtol=1e-4)
