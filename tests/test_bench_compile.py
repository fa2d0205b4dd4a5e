"""The compile-time benchmark (scripts/bench_compile.py) compiles the block it times: one row per
(length, backend), the compiled block's output equal to the uncompiled one."""

from __future__ import annotations

from conftest import load_script

bench_compile = load_script("bench_compile")


def test_one_row_per_length_and_backend_with_equal_outputs(capsys):
    bench_compile.main(["--lengths", "128", "--backends", "eager", "--chunk", "32", "--checkpoint-chunks", "2"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["128"]]
    assert len(rows) == 1
    length, chunks, backend, first, second, uncompiled, diff = rows[0]
    assert (chunks, backend) == ("4", "eager")
    assert float(diff) <= 1e-6 and float(first) > 0
