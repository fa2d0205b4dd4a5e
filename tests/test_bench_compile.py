"""The compile-time benchmark (scripts/bench_compile.py) compiles the block it times: one row per
(length, mode, backend), the compiled block's output equal to the uncompiled one. "block" mode
only: the regional mode compiles its chunk steps with Inductor (minutes on CPU); its training
run is held to eager in tests/test_training.py."""

from __future__ import annotations

from conftest import load_script

bench_compile = load_script("bench_compile")


def test_one_row_per_length_and_backend_with_equal_outputs(capsys):
    bench_compile.main(["--lengths", "128,256", "--backends", "eager", "--modes", "block", "--chunk", "32",
                        "--checkpoint-chunks", "2"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] in (["128"], ["256"])]
    assert [(chunks, mode, backend) for _, chunks, mode, backend, *_ in rows] == [("4", "block", "eager"),
                                                                                ("8", "block", "eager")]
    for *_, first, second, uncompiled, diff in rows:
        assert float(diff) <= 1e-6 and float(first) > 0
