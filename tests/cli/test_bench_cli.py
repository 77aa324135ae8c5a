"""The benchmark machinery on a tiny problem: it runs, reports and writes what it says.
(No timing is asserted: speed and memory are measured by `python -m gspo_kernels bench`.)"""

import json
import re
from dataclasses import replace

import pytest
import torch

from gspo_kernels.bench.problem import Shape, floor_bytes
from gspo_kernels.bench.providers import PROVIDERS
from gspo_kernels.cli import main


def test_shape_parsing_and_byte_floor():
    assert Shape.parse("8x512x32768") == Shape(8, 512, 32768)
    assert floor_bytes(Shape(8, 512, 32768), torch.bfloat16, "fwd+bwd") == 3 * 8 * 512 * 32768 * 2
    with pytest.raises(ValueError, match="BxTxV"):
        Shape.parse("8x512")


def test_bench_writes_rows_for_every_provider(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", "--shapes", "2x16x256", "--reps", "2", "--budget", "1",
                 "--providers", "eager,eager_trl,torch,cpu,liger", "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["provider"], r["mode"]) for r in rows} == {
        (p, m) for p in ("eager", "eager_trl", "torch", "cpu", "liger") for m in ("forward", "backward", "fwd+bwd")}
    ok = [r for r in rows if r["provider"] in ("eager", "torch") and r["status"] == "ok"]
    assert len(ok) == 6
    assert all(r["median_ms"] > 0 and r["peak_mem_mib"] is not None and r["floor_fraction"] > 0 for r in ok)
    if not torch.cuda.is_available():
        assert all(r["status"] == "skipped" and "GPU" in r["note"] for r in rows if r["provider"] == "liger")
    table = capsys.readouterr().out
    assert "speed-up vs eager" in table and "skipped: liger" in table


@pytest.mark.parametrize("quick", [False, True])
def test_quick_bench_leaves_the_references_single_passes_to_the_full_one(tmp_path, capsys, quick):
    out = tmp_path / "bench.json"
    args = ["bench", "--shapes", "2x8x64", "--reps", "1", "--warmup", "0", "--providers", "eager,reference",
            "--no-memory", "--json", str(out)] + (["--quick"] if quick else [])
    assert main(args) == 0
    status = {(r["provider"], r["mode"]): r["status"] for r in json.loads(out.read_text())["rows"]}
    assert status[("reference", "fwd+bwd")] == "ok"
    assert all(status[("eager", m)] == "ok" for m in ("forward", "backward", "fwd+bwd"))
    single = {status[("reference", m)] for m in ("forward", "backward")}
    assert single == ({"skipped"} if quick else {"ok"})
    assert ("reference forward and backward (timed without --quick)" in capsys.readouterr().out) == quick


def test_check_passes_on_the_torch_backend(capsys):
    assert main(["check", "--backends", "torch", "--vocab", "64", "--seq-len", "6"]) == 0
    assert "18/18 cases pass" in capsys.readouterr().out


def test_quick_check_keeps_every_level_dtype_and_layout_of_the_fused_linear_grid():
    import itertools

    from gspo_kernels.cli import check
    from gspo_kernels.config import LEVELS

    grid = list(itertools.product(("fp32", "bf16"), ("padded", "packed"), LEVELS))
    kept = [case for i, case in enumerate(grid) if check._quick_subset(i)]
    assert len(kept) == 4
    for position, values in enumerate((("fp32", "bf16"), ("padded", "packed"), LEVELS)):
        assert {case[position] for case in kept} == set(values)


def test_every_provider_has_a_reason_when_unavailable():
    for provider in PROVIDERS.values():
        reason = provider.unavailable("cpu")
        assert reason is None or isinstance(reason, str) and reason


def test_fused_linear_bench_runs_every_contender(tmp_path, capsys):
    from gspo_kernels.bench.linear import LINEAR_PROVIDERS, LinearShape

    assert LinearShape.parse("2048x512x32768").flops == 6 * 2048 * 512 * 32768
    assert LinearShape.parse("16384x4096x151936/1024").seq_len == 1024
    assert str(LinearShape.parse("16384x4096x151936/1024")) == "16384x4096x151936/1024"
    with pytest.raises(ValueError, match="sequence length"):
        LinearShape.parse("2048x512x32768/0")
    out = tmp_path / "linear.json"
    code = main(["bench", "--linear", "512x16x300/128", "--reps", "2", "--budget", "1", "--providers",
                 "eager,materialized,fused,fused_two_pass,fused_invariant,kept_64,cce", "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    ok = [r for r in rows if r["status"] == "ok"]
    assert {r["provider"] for r in ok} == {"eager", "materialized", "fused", "fused_two_pass", "fused_invariant",
                                           "kept_64"}
    assert all(r["median_ms"] > 0 and r["peak_mem_mib"] is not None and r["hidden"] == 16 for r in ok)
    assert {r["seq_len"] for r in ok} == {128}
    if not torch.cuda.is_available():
        assert all(r["status"] == "skipped" for r in rows if r["provider"] == "cce")
    table = capsys.readouterr().out
    assert "fused linear: N=512 in sequences of 128 rows, H=16 V=300" in table and "memory vs materialized" in table
    cells = re.sub(r" +", " ", table)
    assert "| fused_two_pass | 8NVH |" in cells and "| kept_64 | 6NkH = 1.28NVH |" in cells
    assert set(LINEAR_PROVIDERS) == {"eager", "eager_native", "materialized", "materialized_fp32", "compile", "liger",
                                     "cce", "fused", "fused_two_pass", "fused_tiles", "fused_invariant",
                                     "fused_tiles_invariant", "kept_64", "kept_512"}


@pytest.mark.parametrize("native", [True, False])
def test_eager_native_runs_only_where_bf16_is_native(native, monkeypatch):
    """eager with its lm_head matmul in bf16 runs on a CPU only where bf16 is native (else it is
    10-80x slower); on a GPU it would be eager itself."""
    from gspo_kernels.bench import linear

    monkeypatch.setattr(linear, "cpu_has_native_bf16", lambda: native)
    provider = linear.LINEAR_PROVIDERS["eager_native"]
    assert (provider.unavailable("cpu") is None) == native
    assert "same as eager" in provider.unavailable("cuda")


def test_host_bench_writes_a_row_per_case_and_layout(tmp_path, capsys):
    from gspo_kernels.bench import host

    out = tmp_path / "host.json"
    assert main(["bench", "--host", "--reps", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["case"], r["layout"]) for r in rows} == {(c, layout) for c in host.CASES for layout in host.LAYOUTS}
    # every call dispatches stage 1 and stage 3 at least, and took some host time
    assert all(r["ops_forward"] > 1 and r["ops_backward"] >= 1 and r["host_ms"] > 0 for r in rows)
    assert "ops fwd" in capsys.readouterr().out


def test_bench_megatron_rows(capsys):
    """bench --megatron on a small problem: one row per contender asked for, figures present."""
    pytest.importorskip("megatron.core")
    assert main(["bench", "--megatron", "512x2000", "--reps", "1", "--providers",
                 "megatron_fp32,ours_bf16_inplace"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| megatron_") or line.startswith("| ours_")]
    assert [r.split("|")[1].strip() for r in rows] == ["megatron_fp32", "ours_bf16_inplace"], out
    for row in rows:
        shard, peak, step = (float(x) for x in row.split("|")[2:5])
        assert shard > 0 and peak >= 0 and step >= 0, row
    assert main(["bench", "--megatron", "500x2000"]) == 2  # N not a multiple of 512: a message, no run
    assert "multiple of 512" in capsys.readouterr().out


def test_quick_suite_times_the_variants_forward_and_backward_together():
    # The main job (quick) times each variant's fwd+bwd, the price against plain GSPO; the full
    # suite each pass too. Plain providers keep every mode in both.
    from gspo_kernels.bench.problem import Shape
    from gspo_kernels.bench.runner import SuiteConfig, steps_in

    shape = (Shape.parse("1x8x16"),)
    for name in ("tx_top_k", "tx_top_p", "tx_min_p", "tx_softcap", "obj_cispo"):
        assert [steps_in(SuiteConfig(shapes=shape, providers=(name,), quick=quick, device="cpu"))
                for quick in (True, False)] == [2, 4], name
    assert steps_in(SuiteConfig(shapes=shape, providers=("eager",), quick=True, device="cpu")) == 4


def test_quick_suite_times_the_reference_once_without_its_memory_probe():
    # The float64 oracle's memory probe (a process of its own, 24 s of the main job on a 2-core
    # CPU) is the full suite's; the quick one times its fwd+bwd by one call and says so.
    from gspo_kernels.bench.problem import Shape
    from gspo_kernels.bench.runner import SuiteConfig, run_suite, steps_in, timing_note

    class Steps:
        def __init__(self):
            self.labels = []

        def step(self, label):
            self.labels.append(label)

    shape = (Shape.parse("1x8x16"),)
    quick = SuiteConfig(shapes=shape, providers=("reference", "cpu"), quick=True, device="cpu", reps=2, rounds=2)
    assert steps_in(SuiteConfig(shapes=shape, providers=("reference",), quick=False, device="cpu")) == 4
    assert steps_in(replace(quick, providers=("reference",))) == 1
    steps = Steps()
    rows = {(r.provider, r.mode): r for r in run_suite(quick, steps).rows}
    assert len(steps.labels) == steps_in(quick)
    assert not any("reference" in label and "memory" in label for label in steps.labels)
    assert rows["reference", "fwd+bwd"].status == "ok" and rows["reference", "fwd+bwd"].peak_mem_mib is None
    assert rows["cpu", "fwd+bwd"].peak_mem_mib is not None
    assert "reference: one call after a warm-up, in the first round only; peak memory without --quick" in timing_note(quick)


@pytest.mark.parametrize("name", ["tx_scale", "tx_softcap", "tx_top_k", "tx_top_p", "tx_min_p"])
def test_the_transform_contenders_give_every_row_a_gradient(name):
    """The bench's old log-probs and targets fit each variant (providers._variant_targets,
    _old_logprobs): random targets outside a top-k set gave -inf log-probs, and a transform's
    log-probs against the plain old ones clipped half the sequences; either way rows got no
    gradient and the timed backward zero-filled them. Every row of the variant must be worked, but
    for a min-p row that keeps its target alone (probability 1, no gradient: 1.2% here)."""
    from gspo_kernels.bench.problem import make_bench_problem
    from gspo_kernels.bench.providers import FAMILY, _family

    step = _family(FAMILY[name])(make_bench_problem(Shape(4, 64, 1024), torch.bfloat16, "cpu"))
    loss = step.loss()
    loss.backward()
    worked = (step.leaf.grad.float().abs().sum(-1) > 0).float().mean().item()
    assert torch.isfinite(loss) and worked >= 0.95, (float(loss), worked)
