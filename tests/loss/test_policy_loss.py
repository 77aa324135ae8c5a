"""gk.policy_loss (stage 2 from log-probs) against gspo_loss on the logits those log-probs come
from: the same loss, metrics and logits gradient, in float64, for every level and aggregation
and the options that read the entropy; token_weights and its checks."""

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels.config import LEVELS, LOSS_AGGS
from gspo_kernels.testing.problems import ProblemSpec, make_problem

OPTIONS = [{}, {"beta": 0.1}, {"entropy_coef": 0.02}, {"top_entropy_quantile": 0.5}, {"objective": "sapo"}]


def _stats(logits, targets, temperature):
    logp_all = torch.log_softmax(logits / temperature, -1)
    logp = logp_all.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
@pytest.mark.parametrize("level", LEVELS)
def test_matches_gspo_loss(level, loss_agg, packed, seed):
    options = OPTIONS[(LEVELS.index(level) + LOSS_AGGS.index(loss_agg)) % len(OPTIONS)]
    if options.get("objective") == "sapo" and level != "token":
        options = {}
    problem = make_problem(ProblemSpec(batch=4, seq_len=6, vocab=30, dtype=torch.float64, with_ref=True,
                                       empty_sequence=True, seed=seed % 1000, temperature=0.9))
    problem = problem.to_packed() if packed else problem
    args, kwargs = problem.loss_args()
    kwargs.update(level=level, loss_agg=loss_agg, max_len=6, **options)
    a = args[0].detach().clone().requires_grad_()
    want, want_metrics = gk.gspo_loss(a, *args[1:], backend="torch", **kwargs)
    want.backward()
    b = args[0].detach().clone().requires_grad_()
    temperature = kwargs.pop("temperature")
    logp, entropy = _stats(b, problem.target_ids, temperature)
    got, metrics = gk.policy_loss(logp, *args[2:], entropy=entropy, **kwargs)
    got.backward()
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-14)
    keep = problem.mask.unsqueeze(-1)
    assert torch.allclose(torch.where(keep, b.grad, 0), torch.where(keep, a.grad, 0), rtol=1e-10, atol=1e-13)
    for name in ("clip_frac", "seq_ratio", "entropy_mean"):
        assert torch.allclose(metrics[name], want_metrics[name], rtol=1e-6, atol=1e-9), name


def test_token_weights_scale_the_policy_term_and_are_checked():
    problem = make_problem(ProblemSpec(batch=3, seq_len=5, vocab=20, dtype=torch.float64))
    logp, _ = _stats(problem.logits, problem.target_ids, 1.0)
    args = (problem.old_logprobs, problem.advantages)
    base, _ = gk.policy_loss(logp, *args, mask=problem.mask, level="token", loss_agg="token-sum")
    doubled, _ = gk.policy_loss(logp, *args, mask=problem.mask, level="token", loss_agg="token-sum",
                                token_weights=torch.full_like(logp, 2.0))
    assert torch.allclose(doubled, 2 * base)
    with pytest.raises(ValueError, match="token_weights"):
        gk.policy_loss(logp, *args, token_weights=torch.ones(3))
    with pytest.raises(ValueError, match="entropy"):
        gk.policy_loss(logp, *args, entropy_coef=0.1)
    with pytest.raises(ValueError, match="logprobs"):
        gk.policy_loss(logp.float().unsqueeze(-1).expand(3, 5, 2), *args)
