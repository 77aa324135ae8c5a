"""verl 0.9.1's Megatron backend with fused_kernel_options.impl_backend=gspo_kernels, on
megatron-core's TP=2 groups (2 gloo processes), each path against verl's own code unpatched:

- the engine's logits processor (MegatronEngineWithLMHead._lm_head_logits_processor, called on
  a stand-in engine whose model config holds the key, and without it): verl's
  vocab_parallel_entropy and -vocab_parallel_cross_entropy against ours on the same shard;
- the fused forward's linear_cross_entropy from the hidden states and a real
  ColumnParallelLinear's weight shard, without and with sequence parallelism (the hidden states
  gathered by megatron-core's gather_from_sequence_parallel_region, as verl's forward does),
  against that layer's logits through verl's processor;
- a tiny GPTModel whose forward verl's patch_fused_forward replaced, routed by the engine's own
  _maybe_enable_fused_kernels, against the unpatched forward's logits through verl's processor.

Log-probs, entropies and the gradients of a weighted sum of both (shard, hidden states, every
GPTModel parameter), float32. verl's linear_cross_entropy itself is a Triton kernel for CUDA
and cannot run here; verl's vocab_parallel_entropy compiles a product with torch.compile, which
runs eagerly here (torch._dynamo disabled in the workers: the same arithmetic, a minute less).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from conftest import import_installed
import torch

pytest.importorskip("megatron.core")
import_installed("verl")

from megatron_world import cpu_megatron, megatron_worker  # noqa: E402
from trainer_world import run  # noqa: E402
from gspo_kernels.testing.verify import relative_error, worst  # noqa: E402

T, H, V, TP = 12, 8, 20, 2
OURS = {"impl_backend": "gspo_kernels"}


def _relative(a, b):
    return relative_error(a, b, floor=1e-30)


def _stand_in(options, **engine):
    """What the two engine methods read off `self`."""
    return SimpleNamespace(model_config=SimpleNamespace(fused_kernel_options=options, mtp=SimpleNamespace(enable=False)),
                           engine_config=SimpleNamespace(entropy_from_logits_with_chunking=False, **engine),
                           is_value_model=False)


def _flags(**overrides):
    flags = dict(calculate_sum_pi_squared=False, calculate_entropy=True, distillation_use_topk=False,
                 distillation_only=False, logits_processor_func=None, batch=None, data_format="thd")
    flags.update(overrides)
    return flags


def _weights(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _stats_and_grads(outputs, leaves, seed=11):
    """Log-probs, entropies and the gradients of sum(w1 * logp + w2 * entropy) to the leaves."""
    logp, entropy = outputs["log_probs"], outputs["entropy"]
    objective = (_weights(logp.shape, seed) * logp).sum() + (_weights(entropy.shape, seed + 1) * entropy).sum()
    grads = torch.autograd.grad(objective, leaves)
    return logp.detach(), entropy.detach(), grads


def _compare(got, want):
    return {"logp": _relative(got[0], want[0]), "entropy": _relative(got[1], want[1]),
            "grads": [_relative(g, w) for g, w in zip(got[2], want[2])]}


def _count_calls(module, name, calls):
    function = getattr(module, name)

    def counted(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return function(*args, **kwargs)

    setattr(module, name, counted)


def _logits_processor(rank):
    from verl.workers.engine.megatron import transformer_impl
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    process = MegatronEngineWithLMHead._lm_head_logits_processor
    calls = {}
    for name in ("vocab_parallel_entropy", "vocab_parallel_log_probs_from_logits"):
        _count_calls(transformer_impl, name, calls)
    full = 3 * _weights((1, T, V), 1)
    labels = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(2))
    shard = full[..., rank * V // TP:(rank + 1) * V // TP].clone().requires_grad_()
    results = {}
    for name, options in (("verl", {}), ("ours", OURS)):
        calls.clear()
        temperature = torch.full((1, T), 0.7)
        temperature[0, -1] = 0.0  # padding's temperature: verl's guard makes it 1e-8
        logits = shard * 1.0  # the model's output: not a leaf, divided in place
        out = process(_stand_in(options), logits, labels, temperature, **_flags(calculate_sum_pi_squared=True))
        results[name] = _stats_and_grads(out, [shard]) + (out["sum_pi_squared"],)
        results[name + "_verl_calls"] = dict(calls)
        # the labels' log-probs alone, as the rollout's old policy pass asks for them
        results[name + "_logp_only"] = process(_stand_in(options), shard.detach() * 1.0, labels, torch.ones(1, T),
                                               **_flags(calculate_entropy=False))
    found = _compare(results["ours"], results["verl"])
    found["sum_pi_squared_equal"] = bool(torch.equal(results["ours"][3], results["verl"][3]))
    found["logp_only_keys"] = sorted(results["ours_logp_only"])
    found["logp_only"] = _relative(results["ours_logp_only"]["log_probs"], results["verl_logp_only"]["log_probs"])
    found["verl_calls"], found["our_calls"] = results["verl_verl_calls"], results["ours_verl_calls"]
    found["finite"] = bool(torch.isfinite(results["ours"][0]).all())
    return found


def _column_layer(weight, rank, sequence_parallel):
    from megatron.core import tensor_parallel
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, use_cpu_initialization=True,
                               tensor_model_parallel_size=TP, sequence_parallel=sequence_parallel,
                               params_dtype=torch.float32)
    layer = tensor_parallel.ColumnParallelLinear(H, V, config=config, init_method=torch.nn.init.zeros_, bias=False,
                                                 gather_output=False)
    with torch.no_grad():
        layer.weight.copy_(weight[rank * V // TP:(rank + 1) * V // TP])
    return layer


def _linear_cross_entropy(rank):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
    from verl.models.mcore import model_forward_fused
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from gspo_kernels.integrations.verl import megatron_engine

    hidden_full = _weights((T, 1, H), 3)  # verl's packed rows, [t, 1, h]
    weight = _weights((V, H), 4) / H ** 0.5
    labels = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(5))
    group = parallel_state.get_tensor_model_parallel_group()
    found = {}
    for sp in (False, True):
        part = hidden_full[rank * T // TP:(rank + 1) * T // TP] if sp else hidden_full
        want_layer, got_layer = _column_layer(weight, rank, sp), _column_layer(weight, rank, sp)
        hidden = part.clone().requires_grad_()
        logits, _ = want_layer(hidden)  # [t, 1, V/tp]
        out = MegatronEngineWithLMHead._lm_head_logits_processor(_stand_in({}), logits.transpose(0, 1), labels,
                                                                 torch.ones(1, T), **_flags())
        want = _stats_and_grads({k: v.reshape(-1) for k, v in out.items()}, [hidden, want_layer.weight])
        mine = part.clone().requires_grad_()
        gathered = gather_from_sequence_parallel_region(mine) if sp else mine  # as verl's fused forward does
        token = megatron_engine._ROUTED.set(sp)  # inside a routed model's forward
        try:
            logp, entropy = model_forward_fused.linear_cross_entropy(gathered, got_layer.weight, labels, 1.0, "none",
                                                                     group)
        finally:
            megatron_engine._ROUTED.reset(token)
        got = _stats_and_grads({"log_probs": logp, "entropy": entropy}, [mine, got_layer.weight])
        found[f"sp={sp}"] = _compare(got, want)
    return found


def _gpt_model(rank):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine, MegatronEngineWithLMHead

    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, use_cpu_initialization=True,
                               tensor_model_parallel_size=TP, params_dtype=torch.float32, hidden_dropout=0.0,
                               attention_dropout=0.0)
    torch.manual_seed(0)  # every rank draws the whole matrices and keeps its slice
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=32,
                     max_sequence_length=T, pre_process=True, post_process=True)
    tokens = torch.randint(0, 32, (1, T), generator=torch.Generator().manual_seed(6))
    labels, positions = torch.roll(tokens, -1, dims=1), torch.arange(T)[None]
    params = [p for p in model.parameters() if p.requires_grad]

    logits = model(tokens, positions, None)  # [1, t, V/tp]
    out = MegatronEngineWithLMHead._lm_head_logits_processor(_stand_in({}), logits, labels, torch.full((1, T), 0.8),
                                                             **_flags())
    want = _stats_and_grads({k: v.reshape(-1) for k, v in out.items()}, params)

    engine = _stand_in(OURS, use_fused_kernels=True, use_remove_padding=True)
    engine.module = [model]
    MegatronEngine._maybe_enable_fused_kernels(engine)  # verl's patch_fused_forward, then ours
    output = model(input_ids=tokens, position_ids=positions, attention_mask=None, labels=labels, temperature=0.8)
    got = _stats_and_grads({"log_probs": output.log_probs.reshape(-1), "entropy": output.entropy.reshape(-1)},
                           params)
    found = _compare(got, want)
    found["routed"] = bool(getattr(model.forward, "gspo_kernels", False))
    found["params"] = len(params)
    return found


def _checks(rank):
    torch._dynamo.config.disable = True
    cpu_megatron()  # the sequence-parallel ColumnParallelLinear allocates its gather buffer on current_device
    import gspo_kernels.integrations.verl  # noqa: F401  (VERL_USE_EXTERNAL_MODULES imports it in verl's workers)

    return {"logits_processor": _logits_processor(rank), "linear_cross_entropy": _linear_cross_entropy(rank),
            "gpt_model": _gpt_model(rank)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run(megatron_worker, TP, tmp_path_factory.mktemp("verl_megatron"), TP, TP, _checks)


def _assert_close(found, tol=1e-5):
    assert found["logp"] <= tol and found["entropy"] <= tol, found
    assert worst(found["grads"]) <= tol, found


def test_logits_processor_matches_verls(results):
    found = results["logits_processor"]
    _assert_close(found)
    assert found["sum_pi_squared_equal"] and found["finite"], found
    # the key routes the call: verl's two functions ran on verl's path only
    assert found["verl_calls"] == {"vocab_parallel_entropy": 1, "vocab_parallel_log_probs_from_logits": 1}, found
    assert found["our_calls"] == {}, found
    assert found["logp_only_keys"] == ["log_probs"] and found["logp_only"] <= 1e-6, found


@pytest.mark.parametrize("sp", [False, True])
def test_linear_cross_entropy_matches_the_output_layer_through_verls_processor(results, sp):
    _assert_close(results["linear_cross_entropy"][f"sp={sp}"])


def test_gpt_model_fused_forward_matches_the_unpatched_model(results):
    found = results["gpt_model"]
    assert found["routed"] and found["params"] > 10, found
    _assert_close(found, tol=1e-4)
