"""Bad input ends with one line naming the problem and the fix, and a non-zero exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, exit_code, train
from torchtitan_ext.training import cli, preflight
from torchtitan_ext.errors import UserError

DEBUG = ["--module", "train_configs.transformer", "--config", "transformer_debug"]


def check(args):
    preflight.check(cli.parse(args))


def test_valid_debug_config_passes(tokenizer_dir, tmp_path):
    config = cli.parse(DEBUG + ["--dump_folder", str(tmp_path), "--training.steps", "7"])
    preflight.check(config)  # raises UserError on any problem
    assert config.training.steps == 7 and config.model_spec.name == "transformer"


@pytest.mark.parametrize("args,expected", [
    (["--module", "train_configs.nope", "--config", "x"], "Cannot import module 'train_configs.nope'"),
    (["--module", "train_configs.transformer", "--config", "transformer_9b"], "transformer_debug"),
    (DEBUG + ["--training.seq_len", "200000"], "--training.seq_len 131072 or less"),
    (DEBUG + ["--dataloader.dataset", "c5"], "unknown dataset 'c5'"),
    (DEBUG + ["--dataloader.dataset", "local"], "needs a path"),
    (DEBUG + ["--dataloader.dataset", "local", "--dataloader.dataset_path", "/no/such/data"], "does not exist"),
    (DEBUG + ["--dataloader.dataset", "fineweb_edu", "--dataloader.dataset_path", "./no/such"], "does not exist"),
    (DEBUG + ["--hf_assets_path", "/no/such/tokenizer"], "build_tokenizer.py"),
])
def test_bad_input_is_one_clear_error(tokenizer_dir, tmp_path, args, expected):
    with pytest.raises(UserError, match=expected.replace("(", r"\(").replace(".", r"\.")):
        check(args + ([] if "--dump_folder" in args else ["--dump_folder", str(tmp_path)]))


def test_unwritable_dump_folder(tokenizer_dir, tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="--dump_folder <writable folder>"):
        check(DEBUG + ["--dump_folder", str(tmp_path / "file" / "out")])


def test_mlp_lm_seq_len_beyond_its_context(tokenizer_dir, tmp_path):
    with pytest.raises(UserError, match="max_seq_len 4096"):
        check(["--module", "train_configs.mlp_lm", "--config", "mlp_lm_debug", "--training.seq_len", "8192",
               "--dump_folder", str(tmp_path)])


def test_mela_sequence_too_short_for_memory_writes_to_reach_the_loss(tokenizer_dir, tmp_path):
    mela = ["--module", "train_configs.mela", "--config", "mela_debug", "--dump_folder", str(tmp_path)]
    with pytest.raises(UserError, match="pass --training.seq_len 65 or more"):  # P * C = 64: one chunk
        check(mela + ["--training.seq_len", "64"])
    check(mela + ["--training.seq_len", "65"])


def test_tokenizer_larger_than_model_vocabulary(tokenizer_dir, tmp_path):
    subprocess.run([f"{REPO}/.venv/bin/python", f"{REPO}/scripts/build_tokenizer.py", "--out", str(tmp_path / "tok"),
                    "--vocab-size", "5000"], check=True, capture_output=True)
    with pytest.raises(UserError, match="5000 tokens but the model's vocabulary is 4096"):
        check(DEBUG + ["--hf_assets_path", str(tmp_path / "tok"), "--dump_folder", str(tmp_path)])


def test_launcher_exits_2_with_one_line_and_leaves_checkpoints_alone(tokenizer_dir, tmp_path):
    step = tmp_path / "checkpoint" / "step-10"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"last good")
    run = train(DEBUG + ["--dump_folder", str(tmp_path), "--training.seq_len", "999999"], preflight=True)
    assert run.returncode == 2
    errors = [line for line in run.output.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: training.seq_len 999999"), run
    assert (step / ".metadata").read_bytes() == b"last good"


def test_config_module_with_a_missing_dependency_names_the_dependency(tmp_path, monkeypatch):
    (tmp_path / "configs_needing_x.py").write_text("import no_such_dependency_x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match="No module named 'no_such_dependency_x'"):
        cli.parse(["--module", "configs_needing_x", "--config", "anything"])


PAPER_CONFIGS = [("train_configs.transformer", "transformer_400m"), ("train_configs.mela", "mela_400m"),
                 ("train_configs.titans", "titans_mac_400m")]


@pytest.mark.parametrize("ranks", [1, 2, 8, 32, 64, 128])
@pytest.mark.parametrize("module,config", PAPER_CONFIGS, ids=[c for _, c in PAPER_CONFIGS])
def test_paper_recipes_keep_the_global_batch_on_any_rank_count_dividing_it(module, config, ranks):
    """0.5M tokens = 128 sequences of 4096 per step on 1 to 128 ranks: the recipe's local
    batch (a ceiling: 8, Titans' 2) is lowered to fit, torchtitan accumulates the rest."""
    parsed = cli.parse(["--module", module, "--config", config])
    ceiling = parsed.training.local_batch_size
    local = preflight.fitted_local_batch(parsed, ranks, explicit=False)
    assert parsed.training.global_batch_size * parsed.training.seq_len == 2**19
    accumulation, remainder = divmod(parsed.training.global_batch_size, local * ranks)
    assert remainder == 0 and accumulation >= 1 and local == min(ceiling, 128 // ranks)


def test_batch_arithmetic_that_cannot_work_is_one_clear_error():
    parsed = cli.parse(["--module", "train_configs.mela", "--config", "mela_400m"])
    with pytest.raises(UserError, match="does not split over 3 data-parallel ranks"):
        preflight.fitted_local_batch(parsed, 3, explicit=False)
    parsed = cli.parse(["--module", "train_configs.mela", "--config", "mela_400m",
                              "--training.local_batch_size", "3"])
    with pytest.raises(UserError, match="local_batch_size 3 does not divide the 64 sequences per rank"):
        preflight.fitted_local_batch(parsed, 2, explicit=True)
    parsed = cli.parse(["--module", "train_configs.mela", "--config", "mela_400m",
                              "--parallelism.tensor_parallel_degree", "4"])
    with pytest.raises(UserError, match="6 ranks do not split into tensor x pipeline x context parallel degree 4"):
        preflight.fitted_local_batch(parsed, 6, explicit=False)
    assert preflight.batch_degree(parsed, 32) == 8


def test_the_offline_default_tokenizer_is_built_on_first_use(tmp_path, monkeypatch):
    """A fresh clone trains with no separate build step: preflight trains the default
    tokenizer when the config points at its (missing) folder, and only that folder."""
    import torchtitan_ext.paths as paths

    folder = tmp_path / "default-tokenizer"
    monkeypatch.setattr(paths, "default_tokenizer_dir", lambda: folder)
    config = cli.parse(DEBUG + ["--hf_assets_path", str(folder), "--dump_folder", str(tmp_path / "run")])
    preflight.check_tokenizer(config)
    assert (folder / "tokenizer.model").is_file()
    config = cli.parse(DEBUG + ["--hf_assets_path", str(tmp_path / "other"), "--dump_folder", str(tmp_path / "run")])
    with pytest.raises(UserError, match="no tokenizer.model or tokenizer.json"):
        preflight.check_tokenizer(config)


def test_the_readmes_32_gpu_run_passes_preflight(tokenizer_dir, tmp_path, monkeypatch):
    """The README's multi-node command, as 32 ranks (the Llama-2 tokenizer cannot ship: the
    offline one stands in for it)."""
    import re
    import shlex

    readme = (REPO / "README.md").read_text()
    command = re.search(r"NNODES=4 NPROC_PER_NODE=8 [^\n]*\\\n\s*bash scripts/train.sh ([^\n]*--config mela_400m[^\n]*)",
                        readme)
    assert command, "the README's real-run command is missing"
    args = shlex.split(command.group(1))
    args[args.index("--dump_folder") + 1] = str(tmp_path / "mela_400m")
    config = cli.parse(args + ["--hf_assets_path", str(tokenizer_dir)])
    preflight.check(config, world=32)
    assert preflight.fitted_local_batch(config, 32, explicit=False) == 4  # as the README says


def bad_data_files(folder):
    """{case: (file, expected message part)}: one bad row each, in files the test writes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir()
    good = '{"text": "a good row"}\n'
    cases = {
        "not_json": ("rows.jsonl", good + '{"text": "cut here\n', "line 2: not JSON"),
        "no_text": ("rows.jsonl", good + good + '{"body": "no text"}\n', "line 3: no string 'text' field"),
        "not_utf8": ("rows.jsonl", good.encode() + b'{"text": "caf\xe9"}\n', "line 2: byte 13 is not UTF-8"),
        "empty": ("rows.jsonl", "", "is empty"),
        "txt_not_utf8": ("doc.txt", b"plain \xff text", "byte 6: not UTF-8"),
        "json_array": ("rows.json", '[{"text": "a"}, {"title": "b"}]', "element 1: no string 'text' field"),
    }
    paths = {}
    for case, (name, content, expected) in cases.items():
        (folder / case).mkdir()
        path = folder / case / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        paths[case] = (path, expected)
    (folder / "no_column").mkdir()
    pq.write_table(pa.table({"body": ["x", "y"]}), folder / "no_column" / "rows.parquet")
    paths["no_column"] = (folder / "no_column" / "rows.parquet", "has no 'text' column")
    return paths


def test_bad_data_rows_are_named_by_file_and_row(tmp_path):
    from torchtitan_ext.data.datasets import check_local_rows

    for case, (path, expected) in bad_data_files(tmp_path / "data").items():
        with pytest.raises(UserError) as raised:
            check_local_rows(path.parent)
        message = str(raised.value)
        assert expected in message and str(path) in message and "\n" not in message, (case, message)
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "one"}\n\n{"text": "two", "id": 3}\n')
    check_local_rows(good)


def test_the_launchers_preflight_stops_on_a_bad_row_with_one_line_and_exit_2(tokenizer_dir, tmp_path):
    path, expected = bad_data_files(tmp_path / "data")["not_json"]
    run = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-m", "torchtitan_ext.training.preflight", *DEBUG,
                          "--dataloader.dataset", "local", "--dataloader.dataset_path", str(path),
                          "--dump_folder", str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: dataset file '{path}' {expected} (")
    assert lines[0].endswith("fix or remove it, or pass another --dataloader.dataset_path")


def preflight_code(argv) -> int:
    """`preflight.main(argv)` run in this process: its exit code, 0 when it accepts."""
    import logging

    try:
        return exit_code(preflight.main, argv)
    finally:
        logging.disable(logging.NOTSET)  # preflight.main silences torchtitan's warnings for the process


def environment_error(capsys, argv=DEBUG) -> str:
    """The one line (and exit code 2) of `preflight.main(argv)` run in this process."""
    code = preflight_code(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    return lines[0]


def test_torch_older_than_2_11_is_one_line(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch, "__version__", "2.10.1+cu128")
    line = environment_error(capsys)
    assert line.startswith("error: torch 2.10.1+cu128 is older than 2.11, the oldest this project supports (2.11-2.13)")
    monkeypatch.setattr(torch, "__version__", "2.11.0a0+git1234")  # a 2.11 build counts as 2.11
    preflight.check_environment()


def test_missing_distributions_are_named_together_with_both_fixes(capsys, monkeypatch):
    import importlib.util

    hidden = {"torchtitan", "tyro", "sentencepiece"}
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in hidden else find_spec(name, *a))
    line = environment_error(capsys)
    assert line.startswith(f"error: torchtitan, tyro, sentencepiece are not installed for {sys.executable}: ")
    assert "run `bash scripts/setup.sh`" in line
    # sentencepiece is not among the script's default wheels: the command names it
    assert f"`bash scripts/gpu_wheels.sh DIR sentencepiece` and install them there with `{preflight.WHEELS_INSTALL}`" in line


def test_wandb_enabled_but_missing_is_one_line(tokenizer_dir, tmp_path, capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    args = DEBUG + ["--dump_folder", str(tmp_path), "--metrics.enable-wandb"]
    assert environment_error(capsys, args) == ("error: wandb is not installed: pass --metrics.no-enable-wandb, or fetch "
                                               "it with `bash scripts/gpu_wheels.sh DIR --wandb` (installed as that "
                                               "script prints)")
    preflight.check_wandb(cli.parse(args[:-1] + ["--metrics.no-enable-wandb"]))


def test_launcher_check_names_packages_missing_from_the_python_it_runs(tmp_path):
    """End to end on a real environment without tyro and datasets: the .venv's site-packages
    linked entry by entry except theirs, run with `python -S` (no site-packages of its own)."""
    import site

    packages = tmp_path / "site-packages"
    packages.mkdir()
    (venv_site,) = [p for p in site.getsitepackages() if p.startswith(str(REPO / ".venv"))]
    for entry in Path(venv_site).iterdir():
        if not entry.name.startswith(("tyro", "datasets")):
            (packages / entry.name).symlink_to(entry)
    run = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-S", "-m", "torchtitan_ext.training.preflight",
                          *DEBUG], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": f"{packages}:{REPO}"})
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert lines[0].startswith("error: datasets, tyro are not installed for ") and "gpu_wheels.sh DIR`" in lines[0]


def test_gpu_wheels_pins_the_venvs_versions_once_each(tmp_path):
    """scripts/gpu_wheels.sh asks pip for each wheel once, at the .venv's version, for CPython
    3.12 manylinux; its default list is the one preflight's message counts on; then it packs the
    ptxas of the pinned nvidia-cuda-nvcc wheel as ptxas.xz (a stand-in pip records each request
    and makes the files, as the real one needs network)."""
    import importlib.metadata
    import lzma
    import re

    pip = tmp_path / "pip"
    pip.write_text(f"#!{sys.executable}\n" + '''import pathlib, sys, zipfile
args = sys.argv[1:]
with open(pathlib.Path(__file__).parent / "requests", "a") as log:
    log.write(" ".join(args) + "\\n")
dest = pathlib.Path(args[args.index("-d") + 1])
if any(a.startswith("nvidia-cuda-nvcc==") for a in args):
    with zipfile.ZipFile(dest / "nvidia_cuda_nvcc-13.5.37-py3-none-manylinux2014_x86_64.whl", "w") as wheel:
        wheel.writestr("nvidia/cu13/bin/ptxas", "stand-in ptxas")
else:
    (dest / "x.whl").touch()
''')
    pip.chmod(0o755)
    run = subprocess.run(["bash", str(REPO / "scripts" / "gpu_wheels.sh"), str(tmp_path / "wheels"), "--wandb", "tyro",
                          "sentencepiece"], env={**os.environ, "PIP": str(pip)}, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "1 wheels" in run.stdout and "--target /tmp/site" in run.stdout
    requests = (tmp_path / "requests").read_text().splitlines()
    assert len(requests) == 2 and "nvidia-cuda-nvcc==13.5.37" in requests[1].split()
    assert lzma.open(tmp_path / "wheels" / "ptxas.xz").read() == b"stand-in ptxas"
    request = requests[0].split()
    assert " ".join(request).startswith("download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp")
    pins = [arg for arg in request if "==" in arg]
    names = [re.sub(r"[-_.]+", "-", pin.split("==")[0]).lower() for pin in pins]
    assert len(names) == len(set(names)) and {"wandb", "pydantic-core", "sentencepiece"} <= set(names)
    assert all(pin.split("==")[1] == importlib.metadata.version(pin.split("==")[0]) for pin in pins)
    script = (REPO / "scripts" / "gpu_wheels.sh").read_text()
    base = re.search(r"^BASE=\((.*?)\)", script, re.S | re.M).group(1)
    assert {pin.split("==")[0] for pin in base.split()} == preflight.GPU_WHEELS
