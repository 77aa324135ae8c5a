"""The fused output layer on megatron-core's tensor-parallel groups (2 gloo processes): the GSPO
loss and the token log-probs from the hidden states and a real ColumnParallelLinear's weight
shard, without and with Megatron's sequence parallelism, padded and packed THD, against the
float64 reference on the whole problem (hidden states, full weight and bias, their logits):
the loss, this rank's part of d hidden, and the weight and bias shards' gradients."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_world import kept_sets_of, megatron_worker  # noqa: E402
from trainer_world import run  # noqa: E402
from gspo_kernels.testing.verify import relative_error  # noqa: E402

S, B, H, V, TP = 6, 2, 8, 20, 2
CLIP = dict(eps_low=0.05, eps_high=0.01)  # ratios 1.017 (A > 0: clips) and 0.979 (A < 0: does not)
CASES = [(sp, packed) for sp in (False, True) for packed in (False, True)]


def _problem():
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(S, B, H, generator=gen)  # Megatron's [s, b, h]
    weight = torch.randn(V, H, generator=gen) / H ** 0.5
    bias = 0.1 * torch.randn(V, generator=gen)
    labels = torch.randint(0, V, (B, S), generator=gen)
    mask = torch.rand(B, S, generator=gen) > 0.2
    mask[:, 0] = True
    logits = hidden.double().transpose(0, 1) @ weight.double().T + bias.double()
    lp = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    old = (lp + 0.03 * torch.randn(B, S, generator=gen, dtype=torch.float64)).float()
    adv = torch.tensor([0.9, -0.4])
    return hidden, weight, bias, labels, mask, old, adv


def _layer(weight, bias, rank, sequence_parallel):
    from megatron.core import tensor_parallel
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, use_cpu_initialization=True,
                               tensor_model_parallel_size=TP, sequence_parallel=sequence_parallel,
                               params_dtype=torch.float32)
    layer = tensor_parallel.ColumnParallelLinear(H, V, config=config, init_method=torch.nn.init.zeros_, bias=True,
                                                 gather_output=False)
    width = V // TP
    with torch.no_grad():
        layer.weight.copy_(weight[rank * width:(rank + 1) * width])
        layer.bias.copy_(bias[rank * width:(rank + 1) * width])
    return layer


def _relative(a, b):
    return relative_error(a, b, floor=1e-30)


def _reference(hidden, weight, bias, labels, mask, old, adv, packed):
    """The float64 reference's loss and its gradients to hidden, weight and bias."""
    from gspo_kernels.testing import reference

    h64, w64, b64 = (t.double().requires_grad_() for t in (hidden, weight, bias))
    logits = h64.transpose(0, 1) @ w64.T + b64  # [b, s, V]
    if packed:  # the two sequences one after the other: the same loss, [t, V]
        loss, _ = reference.gspo_loss(logits.reshape(B * S, V), labels.reshape(-1), old.reshape(-1), adv,
                                      mask=mask.reshape(-1), cu_seqlens=torch.tensor([0, S, 2 * S]), **CLIP)
    else:
        loss, _ = reference.gspo_loss(logits, labels, old, adv, mask=mask, **CLIP)
    loss.backward()
    return loss, h64.grad, w64.grad, b64.grad


def _output_layer_checks(rank):
    from gspo_kernels.integrations import megatron as gm

    hidden, weight, bias, labels, mask, old, adv = _problem()
    width, part = V // TP, S // TP
    found = {}
    for sp, packed in CASES:
        ref_loss, ref_dh, ref_dw, ref_db = _reference(hidden, weight, bias, labels, mask, old, adv, packed)
        layer = _layer(weight, bias, rank, sp)
        if packed:  # [t, 1, h]: batch row 0's tokens, then row 1's
            full, ref_dh = hidden.transpose(0, 1).reshape(B * S, 1, H), ref_dh.transpose(0, 1).reshape(B * S, 1, H)
            inputs = dict(labels=labels.reshape(1, -1), old_logprobs=old.reshape(1, -1), loss_mask=mask.reshape(1, -1),
                          cu_seqlens=torch.tensor([0, S, 2 * S]))
        else:
            full = hidden
            inputs = dict(labels=labels, old_logprobs=old, loss_mask=mask)
        rows = full.shape[0] // TP
        mine = (full[rank * rows:(rank + 1) * rows] if sp else full).clone().requires_grad_()
        want_dh = ref_dh[rank * rows:(rank + 1) * rows] if sp else ref_dh
        loss, metrics = gm.fused_output_gspo_loss(mine, layer, advantages=adv, **inputs, **CLIP)
        loss.backward()
        name = f"{'sp' if sp else 'replicated'}_{'packed' if packed else 'padded'}"
        found[name] = {
            "loss": _relative(loss, ref_loss),
            "d_hidden": _relative(mine.grad, want_dh),
            "d_weight": _relative(layer.weight.grad, ref_dw[rank * width:(rank + 1) * width]),
            "d_bias": _relative(layer.bias.grad, ref_db[rank * width:(rank + 1) * width]),
            "clip_frac": float(metrics["clip_frac"]),
        }
        assert part  # S splits over the ranks
    # The log-probs alone, sequence parallel: against log_softmax of the whole logits.
    layer = _layer(weight, bias, rank, True)
    mine = hidden[rank * part:(rank + 1) * part].clone().requires_grad_()
    lp = gm.fused_output_logprobs(mine, layer, labels)
    want = torch.log_softmax(hidden.double().transpose(0, 1) @ weight.double().T + bias.double(), -1)
    found["logprobs_sp"] = _relative(lp, want.gather(-1, labels[..., None])[..., 0])
    found["kept_tokens"] = _kept_tokens_checks(rank, hidden, weight, bias, labels, mask, old, adv)
    return found


def _kept_tokens_checks(rank, hidden, weight, bias, labels, mask, old, adv):
    """The engine's kept sets (global ids, rows in the labels' [b, s] order), sequence parallel:
    only this shard's kept weight rows are multiplied; loss and gradients against the reference."""
    from gspo_kernels.integrations import megatron as gm
    from gspo_kernels.testing import reference

    kept = kept_sets_of(labels, V, size=5, seed=9)
    h64, w64, b64 = (t.double().requires_grad_() for t in (hidden, weight, bias))
    ref_loss, _ = reference.gspo_loss(h64.transpose(0, 1) @ w64.T + b64, labels, old, adv, mask=mask,
                                      kept_tokens=kept, **CLIP)
    ref_loss.backward()
    width, part = V // TP, S // TP
    layer = _layer(weight, bias, rank, True)
    mine = hidden[rank * part:(rank + 1) * part].clone().requires_grad_()
    loss, _ = gm.fused_output_gspo_loss(mine, layer, labels, old, adv, loss_mask=mask, kept_tokens=kept, **CLIP)
    loss.backward()
    return {"loss": _relative(loss, ref_loss),
            "d_hidden": _relative(mine.grad, h64.grad[rank * part:(rank + 1) * part]),
            "d_weight": _relative(layer.weight.grad, w64.grad[rank * width:(rank + 1) * width]),
            "d_bias": _relative(layer.bias.grad, b64.grad[rank * width:(rank + 1) * width])}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run(megatron_worker, TP, tmp_path_factory.mktemp("output_layer"), TP, TP, _output_layer_checks)


@pytest.mark.parametrize("sp,packed", CASES)
def test_fused_output_layer_matches_the_reference(results, sp, packed):
    found = results[f"{'sp' if sp else 'replicated'}_{'packed' if packed else 'padded'}"]
    assert 0.0 < found["clip_frac"] < 1.0, found  # the clip is active on some tokens, not all
    for key in ("loss", "d_hidden", "d_weight", "d_bias"):
        assert found[key] <= 1e-5, (key, found)


def test_fused_output_logprobs_with_sequence_parallelism(results):
    assert results["logprobs_sp"] <= 1e-6


def test_fused_output_loss_over_the_engines_kept_sets(results):
    for key, err in results["kept_tokens"].items():
        assert err <= 1e-5, (key, results["kept_tokens"])
