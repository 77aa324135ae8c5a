"""gspo_kernels.integrations.megatron on real megatron-core tensor-parallel groups (2 gloo
processes): the token log-probs against megatron-core's own vocab_parallel_cross_entropy, and
the GSPO loss on each rank's vocab shard against the float64 reference on the whole logits,
sequence-first `[s, b, V/tp]`, batch-first and packed THD, float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_world import kept_sets_of, megatron_worker  # noqa: E402
from trainer_world import run  # noqa: E402
from gspo_kernels.testing.verify import relative_error  # noqa: E402

S, B, V, TP = 7, 3, 24, 2
CLIP = dict(eps_low=0.005, eps_high=0.01)  # the third sequence (ratio 1.0125, A > 0) clips, the other two do not


def _problem(dtype):
    gen = torch.Generator().manual_seed(11)
    logits = (2 * torch.randn(S, B, V, generator=gen)).to(dtype)  # Megatron's [s, b, V]
    labels = torch.randint(0, V, (B, S), generator=gen)
    loss_mask = (torch.rand(B, S, generator=gen) > 0.25).float()
    loss_mask[:, 0] = 1.0
    lp = torch.log_softmax(logits.double().transpose(0, 1), -1).gather(-1, labels[..., None])[..., 0]
    old = (lp + 0.05 * torch.randn(B, S, generator=gen, dtype=torch.float64)).float()
    adv = torch.tensor([1.0, -0.7, 0.4])
    upstream = torch.randn(B, S, generator=gen)
    return logits, labels, loss_mask, old, adv, upstream


def _shard(full, rank):
    width = full.shape[-1] // TP
    return full[..., rank * width:(rank + 1) * width]


def _relative(a, b):
    return relative_error(a, b, floor=1e-30)


def _logprob_checks(rank):
    """Ours against megatron-core's -vocab_parallel_cross_entropy: values and the shard's gradient."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from gspo_kernels.integrations import megatron as gm

    found = {}
    for dtype in (torch.float32, torch.bfloat16):
        logits, labels, loss_mask, _, _, upstream = _problem(dtype)
        theirs_in = _shard(logits, rank).clone().requires_grad_()
        # megatron-core's cross entropy works in place on its input: it gets a copy.
        nll = vocab_parallel_cross_entropy(theirs_in.float().clone(), labels.T.contiguous())  # [s, b]
        (nll * -upstream.T).sum().backward()
        ours_in = _shard(logits, rank).clone().requires_grad_()
        lp, entropy = gm.token_logprobs(ours_in, labels, return_entropy=True)
        (lp * upstream).sum().backward()
        name = str(dtype).split(".")[-1]
        found[f"logp_{name}"] = _relative(lp, -nll.T)
        found[f"grad_{name}"] = _relative(ours_in.grad, theirs_in.grad)
        probs = torch.softmax(logits.double().transpose(0, 1), -1)
        found[f"entropy_{name}"] = _relative(entropy, -(probs * probs.log()).sum(-1))
    # The model's soft-cap and scale on the shard (Gemma-style): against float64 on the whole logits.
    logits, labels, _, _, _, upstream = _problem(torch.float32)
    whole = logits.double().transpose(0, 1).requires_grad_()
    z = 2.0 * torch.tanh(whole * 1.5 / 2.0)
    want = torch.log_softmax(z, -1).gather(-1, labels[..., None])[..., 0]
    (want * upstream).sum().backward()
    ours_in = _shard(logits, rank).clone().requires_grad_()
    lp = gm.token_logprobs(ours_in, labels, logit_scale=1.5, logit_softcap=2.0)
    (lp * upstream).sum().backward()
    found["logp_softcap_float32"] = _relative(lp, want)
    found["grad_softcap_float32"] = _relative(ours_in.grad, _shard(whole.grad.transpose(0, 1), rank))
    return found


def _loss_checks(rank):
    """The GSPO loss on this rank's shard against the float64 reference on the whole logits."""
    from gspo_kernels.integrations import megatron as gm
    from gspo_kernels.testing import reference

    found = {}
    for dtype in (torch.float32, torch.bfloat16):
        logits, labels, loss_mask, old, adv, _ = _problem(dtype)
        whole = logits.double().transpose(0, 1).contiguous().requires_grad_()
        ref_loss, ref_metrics = reference.gspo_loss(whole, labels, old, adv, mask=loss_mask.bool(), **CLIP)
        ref_loss.backward()
        ref_grad = whole.grad.transpose(0, 1)  # back to [s, b, V]
        name = str(dtype).split(".")[-1]
        layouts = {
            "sequence_first": (_shard(logits, rank), dict(sequence_first=True)),
            "batch_first": (_shard(logits, rank).transpose(0, 1).contiguous(), dict(sequence_first=False)),
        }
        for layout, (shard, how) in layouts.items():
            shard = shard.clone().requires_grad_()
            loss, metrics = gm.gspo_loss(shard, labels, old, adv, loss_mask=loss_mask, **how, **CLIP)
            loss.backward()
            grad = shard.grad if how["sequence_first"] else shard.grad.transpose(0, 1)
            found[f"{layout}_{name}_loss"] = _relative(loss, ref_loss)
            found[f"{layout}_{name}_grad"] = _relative(grad, _shard(ref_grad, rank))
            found[f"{layout}_{name}_clip_frac"] = abs(float(metrics["clip_frac"]) - float(ref_metrics["clip_frac"]))
        found[f"clipped_{name}"] = float(ref_metrics["clip_frac"])
        # Packed THD: the same sequences one after another, [t, 1, V/tp], per-token inputs [1, t].
        lengths = [S, S - 2, S - 3]
        rows = torch.cat([logits[:n, i] for i, n in enumerate(lengths)])  # [t, V]
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
        flat = {k: torch.cat([v[i, :n] for i, n in enumerate(lengths)])[None]
                for k, v in (("labels", labels), ("old", old), ("mask", loss_mask))}
        whole = rows.double().contiguous().requires_grad_()
        ref_loss, _ = reference.gspo_loss(whole, flat["labels"][0], flat["old"][0], adv, mask=flat["mask"][0].bool(),
                                          cu_seqlens=cu, **CLIP)
        ref_loss.backward()
        shard = _shard(rows, rank)[:, None].clone().requires_grad_()  # [t, 1, V/tp]
        loss, _ = gm.gspo_loss(shard, flat["labels"], flat["old"], adv, loss_mask=flat["mask"], cu_seqlens=cu, **CLIP)
        loss.backward()
        found[f"packed_{name}_loss"] = _relative(loss, ref_loss)
        found[f"packed_{name}_grad"] = _relative(shard.grad[:, 0], _shard(whole.grad, rank))
    # The engine's kept sets over the global vocabulary, rows in the labels' [b, s] order.
    found.update(_kept_tokens_checks(rank))
    return found


def _kept_tokens_checks(rank):
    from gspo_kernels.integrations import megatron as gm
    from gspo_kernels.testing import reference

    logits, labels, loss_mask, old, adv, upstream = _problem(torch.float32)
    kept = kept_sets_of(labels, V, size=6, seed=5)
    whole = logits.double().transpose(0, 1).contiguous().requires_grad_()
    ref_loss, _ = reference.gspo_loss(whole, labels, old, adv, mask=loss_mask.bool(), kept_tokens=kept, **CLIP)
    ref_loss.backward()
    shard = _shard(logits, rank).clone().requires_grad_()
    loss, _ = gm.gspo_loss(shard, labels, old, adv, loss_mask=loss_mask, kept_tokens=kept, **CLIP)
    loss.backward()
    found = {"kept_tokens_float32_loss": _relative(loss, ref_loss),
             "kept_tokens_float32_grad": _relative(shard.grad, _shard(whole.grad.transpose(0, 1), rank))}
    ref_lp = reference.selective_log_softmax(logits.double().transpose(0, 1), labels, kept_tokens=kept)
    lp = gm.token_logprobs(_shard(logits, rank), labels, kept_tokens=kept)
    found["kept_tokens_float32_logp"] = _relative(lp, ref_lp)
    return found


def _error_checks(rank):
    from gspo_kernels.integrations import megatron as gm

    logits, labels, loss_mask, old, adv, _ = _problem(torch.float32)
    messages = {}
    for name, call in {
        "weighted_mask": lambda: gm.gspo_loss(_shard(logits, rank), labels, old, adv, loss_mask=loss_mask * 0.5),
        "two_d_logits": lambda: gm.token_logprobs(_shard(logits, rank)[0], labels),
        "packed_batch_of_two": lambda: gm.gspo_loss(_shard(logits, rank)[:, :2], labels[:2], old[:2], adv[:2],
                                                    cu_seqlens=torch.tensor([0, 4, 7])),
    }.items():
        try:
            call()
            messages[name] = "no error"
        except (ValueError, TypeError) as exc:
            messages[name] = str(exc)
    return messages


def _all_checks(rank):
    torch.manual_seed(0)
    return {"logprobs": _logprob_checks(rank), "loss": _loss_checks(rank), "errors": _error_checks(rank),
            "rank": rank}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run(megatron_worker, TP, tmp_path_factory.mktemp("megatron"), TP, TP, _all_checks)


def test_token_logprobs_match_megatron_cross_entropy(results):
    for key, err in results["logprobs"].items():
        limit = 1e-5 if "float32" in key else 1e-2  # bf16: the gradient is written in bf16
        assert err <= limit, (key, err)


def test_gspo_loss_on_shards_matches_the_reference(results):
    found = results["loss"]
    assert 0.0 < found["clipped_float32"] < 1.0  # the clip is active on some tokens, not all
    for key, err in found.items():
        if key.startswith("clipped"):
            continue
        if key.endswith("clip_frac"):
            assert err <= 1e-6, (key, err)  # the same tokens clipped; float32 against float64 means
        else:
            assert err <= (1e-5 if "float32" in key else 1e-2), (key, err)


def test_megatron_inputs_give_errors_that_name_the_fix(results):
    errors = results["errors"]
    assert "only 0 and 1" in errors["weighted_mask"] and "token_weights" in errors["weighted_mask"]
    assert "[s, b, V/tp]" in errors["two_d_logits"]
    assert "one batch row" in errors["packed_batch_of_two"]
