"""An unknown option at an entry point names the nearest valid one (or ours for a TRL / verl
name) and lists the valid ones; mixing linear= with LinearConfig keywords names linear=."""

import pytest
import torch

import gspo_kernels as gk


def _logits_problem():
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(2, 3, 10, generator=gen), torch.randint(0, 10, (2, 3), generator=gen),
            torch.randn(2, 3, generator=gen), torch.randn(2, generator=gen))


@pytest.mark.parametrize("options, words", [
    ({"epsilon": 0.2}, ["'epsilon'", "ours is eps_low", "valid:", "eps_high"]),
    ({"epsilon_high": 0.28}, ["ours is eps_high"]),
    ({"loss_agg_mode": "token-mean"}, ["ours is loss_agg"]),
    ({"importance_sampling_level": "sequence"}, ["ours is level"]),
    ({"sapo_temperature_pos": 1.0}, ["ours is sapo_tau_pos"]),
    ({"eps_lo": 0.1}, ["did you mean 'eps_low'"]),
    ({"chunksize": 4}, ["did you mean 'chunk_size'", "fused-linear entry points only"]),
    ({"zzz": 1}, ["'zzz'", "valid:"]),
])
def test_unknown_option_names_the_fix(options, words):
    logits, targets, old, adv = _logits_problem()
    calls = [lambda: gk.gspo_loss(logits, targets, old, adv, **options),
             lambda: gk.policy_loss(old, old, adv, **options), lambda: gk.GSPOLoss(**options)]
    if "chunksize" not in options:  # a LinearConfig option's hint is for the fused-linear entry points
        calls.append(lambda: gk.GSPOConfig(**options))
    for call in calls:
        with pytest.raises(TypeError) as error:
            call()
        for word in words:
            assert word in str(error.value), (word, str(error.value))


def test_the_option_classes_themselves_name_the_fix():
    with pytest.raises(TypeError, match="unknown LinearConfig option.*did you mean 'chunk_size'.*valid: chunk_size"):
        gk.LinearConfig(chunksize=4)
    with pytest.raises(TypeError, match="unknown GSPOConfig option.*'epsilon': ours is eps_low"):
        gk.GSPOConfig(epsilon=0.2)


def test_fused_linear_unknown_option_and_linear_mix():
    _, targets, old, adv = _logits_problem()
    hidden, weight = torch.randn(2, 3, 8), torch.randn(10, 8)
    with pytest.raises(TypeError, match="did you mean 'chunk_size'"):
        gk.fused_linear_gspo_loss(hidden, weight, targets, old, adv, chunksize=4)
    with pytest.raises(TypeError, match="either as linear= or as keywords"):
        gk.fused_linear_gspo_loss(hidden, weight, targets, old, adv, linear=gk.LinearConfig(), chunk_size=4)
    with pytest.raises(TypeError, match="linear must be a LinearConfig"):
        gk.fused_linear_gspo_loss(hidden, weight, targets, old, adv, linear={"chunk_size": 4})


def test_fused_linear_module_given_a_tensor_names_the_function_form():
    _, targets, old, adv = _logits_problem()
    loss_fn = gk.FusedLinearGSPOLoss()
    with pytest.raises(TypeError, match="takes the lm_head module.*got a tensor.*fused_linear_gspo_loss"):
        loss_fn(torch.randn(2, 3, 8), torch.randn(10, 8), targets, old, adv)


def test_fused_on_a_cpu_without_the_interpreter_names_fused_not_a_backend():
    """In a process without TRITON_INTERPRET (the tests set it): the error is about fused=True,
    not about a backend='triton' the caller never passed."""
    import os
    import subprocess
    import sys

    code = ("import torch, gspo_kernels as gk\n"
            "h, w = torch.randn(2, 3, 8), torch.randn(10, 8)\n"
            "t, o, a = torch.randint(0, 10, (2, 3)), torch.randn(2, 3), torch.randn(2)\n"
            "try:\n    gk.fused_linear_gspo_loss(h, w, t, o, a, fused=True)\n"
            "except ValueError as e:\n    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120).stdout
    assert "fused=True runs the Triton tile kernels" in out and "fused=False" in out, out
    assert "backend='triton'" not in out, out
