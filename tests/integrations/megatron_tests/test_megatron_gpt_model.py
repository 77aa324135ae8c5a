"""A tiny megatron-core GPTModel (local layer spec, no Transformer Engine) at tensor parallel 2
on gloo: GSPO through gspo_kernels.integrations.megatron (on the output layer's logits, and
fused from the hidden states the output layer takes) against the same loss on megatron-core's
own log-probs, -vocab_parallel_cross_entropy, with gk.policy_loss's sequence math on top. Loss,
log-probs and every trainable parameter's gradient, float32; and the fused output layer's
gradients in main_grad under megatron-core's DistributedDataParallel (distributed optimizer).

Not covered here, with why: sequence parallelism (the local spec's torch LayerNorm asserts "sequence
parallel not supported by torch LayerNorm"; the fused output layer's sequence-parallel path is
tested on a ColumnParallelLinear in test_megatron_output_layer.py) and packed THD batches (the
local spec's DotProductAttention takes no packed_seq_params).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_world import cpu_megatron, megatron_worker  # noqa: E402
from trainer_world import run  # noqa: E402
from gspo_kernels.testing.verify import relative_error, worst  # noqa: E402

B, S, V, TP = 2, 8, 32, 2
CLIP = dict(eps_low=0.02, eps_high=0.02)


def _model():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, use_cpu_initialization=True,
                               tensor_model_parallel_size=TP, params_dtype=torch.float32, hidden_dropout=0.0,
                               attention_dropout=0.0)
    torch.manual_seed(0)  # the same weights on every call: every rank draws the whole matrices and keeps its slice
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=V,
                    max_sequence_length=S, pre_process=True, post_process=True)


def _batch():
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, V, (B, S), generator=gen)
    labels = torch.roll(tokens, -1, dims=1)
    mask = torch.ones(B, S)
    mask[1, 5:] = 0.0
    return tokens, labels, mask


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _megatron_own(model, tokens, labels, mask, old, adv):
    """megatron-core's log-probs (its vocab-parallel cross entropy) and GSPO on them."""
    import gspo_kernels as gk
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = model(tokens, torch.arange(S)[None].expand(B, S), None)  # [b, s, V/tp]
    logp = -vocab_parallel_cross_entropy(logits.clone(), labels)  # it works in place on its input
    loss, _ = gk.policy_loss(logp, old, adv, mask=mask.bool(), **CLIP)
    return loss, logp


def _gpt_checks(rank):
    from gspo_kernels.integrations import megatron as gm

    cpu_megatron()
    tokens, labels, mask = _batch()
    adv = torch.tensor([1.0, -0.5])
    model = _model()
    with torch.no_grad():
        logits = model(tokens, torch.arange(S)[None].expand(B, S), None)
        lp = gm.token_logprobs(logits, labels, sequence_first=False)
    old = lp + 0.002 * torch.randn(B, S, generator=torch.Generator().manual_seed(3))
    old[0] -= 0.05  # sequence 0's ratio about e^0.05 with A > 0: clipped; sequence 1's inside the clip

    want_loss, want_logp = _megatron_own(model, tokens, labels, mask, old, adv)
    want_loss.backward()
    want = _grads(model)

    found = {}
    for path in ("logits", "fused_output"):
        model.zero_grad(set_to_none=True)
        if path == "logits":
            logits = model(tokens, torch.arange(S)[None].expand(B, S), None)
            logp = gm.token_logprobs(logits, labels, sequence_first=False)
            loss, metrics = gm.gspo_loss(logits, labels, old, adv, loss_mask=mask, sequence_first=False, **CLIP)
        else:
            seen = {}
            hook = model.output_layer.register_forward_hook(lambda m, args, out: seen.update(hidden=args[0]))
            model(tokens, torch.arange(S)[None].expand(B, S), None)
            hook.remove()
            logp = gm.fused_output_logprobs(seen["hidden"], model.output_layer, labels)
            loss, metrics = gm.fused_output_gspo_loss(seen["hidden"], model.output_layer, labels, old, adv,
                                                      loss_mask=mask, **CLIP)
        loss.backward()
        got = _grads(model)
        found[path] = {
            "loss": float((loss - want_loss).abs() / want_loss.abs()),
            "logp": float((logp.detach() - want_logp.detach()).abs().max()),
            "clip_frac": float(metrics["clip_frac"]),
            "missing": sorted(set(want) ^ set(got)),
            "grads": {n: relative_error(got[n], g, floor=1e-30) for n, g in want.items() if n in got},
        }
    found["main_grad"] = _main_grad_check(model, tokens, labels, mask, old, adv, want)
    return found


def _main_grad_check(model, tokens, labels, mask, old, adv, want):
    """The fused output layer under megatron-core's DistributedDataParallel with the distributed
    optimizer's settings: its backward hooks move each gradient into the parameter's float32
    main_grad, which finish_grad_sync reduces over the data-parallel group (of one here)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from gspo_kernels.integrations import megatron as gm

    model.zero_grad(set_to_none=True)  # the hooks add .grad into main_grad: none may be left over
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                              grad_reduce_in_fp32=True), model)
    ddp.zero_grad_buffer()
    seen = {}
    hook = model.output_layer.register_forward_hook(lambda m, args, out: seen.update(hidden=args[0]))
    ddp(tokens, torch.arange(S)[None].expand(B, S), None)
    hook.remove()
    loss, _ = gm.fused_output_gspo_loss(seen["hidden"], model.output_layer, labels, old, adv, loss_mask=mask, **CLIP)
    loss.backward()
    ddp.finish_grad_sync()
    params = dict(model.named_parameters())
    return {"grads": {n: relative_error(params[n].main_grad, g, floor=1e-30) for n, g in want.items()},
            "left_in_grad": sorted(n for n, p in params.items() if p.grad is not None)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run(megatron_worker, TP, tmp_path_factory.mktemp("gpt"), TP, TP, _gpt_checks)


@pytest.mark.parametrize("path", ["logits", "fused_output"])
def test_gpt_model_gradients_match_megatrons_own_log_probs(results, path):
    found = results[path]
    assert 0.0 < found["clip_frac"] < 1.0, found
    assert found["loss"] <= 1e-5 and found["logp"] <= 1e-5, found
    assert not found["missing"] and len(found["grads"]) > 10, found
    assert worst(found["grads"]) <= 1e-4, found["grads"]


def test_fused_output_gradients_reach_main_grad_under_megatron_ddp(results):
    found = results["main_grad"]
    assert len(found["grads"]) > 10 and not found["left_in_grad"], found
    assert worst(found["grads"]) <= 1e-4, found["grads"]
