"""Bad command-line arguments end in argparse's one-line usage error (exit status 2) naming the
argument and the accepted form, never a traceback; `check --help` gives each option's default."""

import pytest
import torch

from gspo_kernels.cli import main


@pytest.mark.parametrize("argv, words", [
    (["check", "--loss-agg", "mean"], ["--loss-agg", "invalid choice", "seq-mean-token-mean"]),
    (["check", "--batch", "0"], ["--batch", "a positive integer"]),
    (["check", "--vocab", "ten"], ["--vocab", "a positive integer"]),
    (["bench", "--shapes", "8x512"], ["--shapes", "BxTxV", "8x512x32768"]),
    (["bench", "--shapes", "2x16x256,8x512"], ["--shapes", "BxTxV"]),
    (["bench", "--dtype", "fp64"], ["--dtype", "invalid choice", "bf16"]),
    (["bench", "--linear", "2x3"], ["--linear", "NxHxV"]),
    (["bench", "--distributed", "12"], ["--distributed", "NxV"]),
    (["bench", "--megatron", "4096"], ["--megatron", "NxV"]),
])
def test_bad_arguments_give_a_usage_line(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for word in words:
        assert word in err, (word, err)


def test_check_help_states_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    out = capsys.readouterr().out
    for text in ("(default 6)", "(default 16)", "(default 1000)", "(default seq-mean-token-mean)"):
        assert text in out, text


def test_check_says_which_backends_it_skips_and_why():
    from gspo_kernels.cli.check import runnable_backends, skipped_backends

    found = runnable_backends()
    why = skipped_backends(found)
    assert set(why) | set(found) == {"torch", "triton", "cpu", "cuda"} and not set(why) & set(found)
    if not torch.cuda.is_available():
        assert "no GPU" in why["cuda"] or "_C" in why["cuda"]
    without_triton = {name: device for name, device in found.items() if name != "triton"}
    if "triton" in found and found["triton"] == "cpu":  # interpreted here: what a plain run would say
        assert "TRITON_INTERPRET=1" in skipped_backends(without_triton).get("triton", "") or \
            "not installed" in skipped_backends(without_triton)["triton"]
