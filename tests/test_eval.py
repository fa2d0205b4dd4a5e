"""scripts/eval_long_ppl.py (torchtitan_ext/eval/long_ppl.py) on tiny checkpoints written here (DCP, model
weights only)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import load_script, REPO
from torchtitan_ext.training.checkpoints import build_model, causal_logits
from torchtitan_ext.eval.long_ppl import Entry, token_nll, window_nll

MELA = "train_configs.mela:mela_debug"
TRANSFORMER = "train_configs.transformer:transformer_small"


def save_checkpoint(config: str, folder):
    """A DCP step folder holding a freshly initialised model of `config` (as torchtitan's
    model-only checkpoints do); returns (folder, model)."""
    torch.manual_seed(0)
    model, _ = build_model(*config.split(":"))
    dcp.save(model.state_dict(), checkpoint_id=str(folder), no_dist=True)
    return folder, model


@pytest.fixture(scope="module")
def long_docs(tmp_path_factory, tokenizer_dir):
    """A jsonl of 3 documents of ~700 tokens each."""
    path = tmp_path_factory.mktemp("docs") / "docs.jsonl"
    words = ["memory", "recall", "gradient", "token", "chunk", "state", "write", "read", "layer", "model"]
    with open(path, "w") as f:
        for d in range(3):
            f.write(json.dumps({"text": " ".join(words[(i * (d + 3)) % 10] for i in range(700))}) + "\n")
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("ckpt")
    return {config: save_checkpoint(config, root / config.split(":")[1])[0] for config in (MELA, TRANSFORMER)}


def eval_cli(*args):
    return subprocess.run([sys.executable, str(REPO / "scripts" / "eval_long_ppl.py"), *map(str, args)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)


def test_writes_json_table_and_plot_and_streaming_equals_one_pass(checkpoints, long_docs, tmp_path):
    """In float64, so that streaming and one pass must agree to 1e-9: any difference is the
    streaming machinery's, not rounding (a memory that amplifies rounding, as Mela's at
    eq. 10's unit step does, would otherwise hide or fake one)."""
    out = tmp_path / "eval"
    run = eval_cli("--checkpoint", checkpoints[MELA], "--config", MELA, "--mode", "full",
                   "--checkpoint", checkpoints[MELA], "--config", MELA, "--mode", "streaming",
                   "--checkpoint", checkpoints[TRANSFORMER], "--config", TRANSFORMER, "--mode", "sliding", "--window", "128",
                   "--context-lengths", "128,512", "--dataset", long_docs, "--split", "all", "--bucket", "128",
                   "--dtype", "float64", "--out", out)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    full, streaming, sliding = results["runs"]
    for length in ("128", "512"):
        assert full["results"][length]["tokens"] == 3 * (int(length) - 1)
        assert abs(full["results"][length]["nll"] - streaming["results"][length]["nll"]) < 1e-9
        cell = full["results"][length]
        assert len(cell["doc_nll"]) == 3 and abs(sum(cell["doc_nll"]) / 3 - cell["nll"]) < 1e-5  # equal-length docs
        streamed = streaming["results"][length]  # the same model: ratio 1 to the first run
        assert abs(streamed["ratio_to_first"] - 1) < 1e-9 and "ratio_to_first" not in cell
        low, high = cell["ppl_ci95"]
        assert min(map(math.exp, cell["doc_nll"])) <= low <= cell["ppl"] <= high <= max(map(math.exp, cell["doc_nll"]))
    assert len(full["results"]["512"]["buckets"]) == 4
    assert "| mela_debug | streaming |" in (out / "results.md").read_text()
    assert (out / "perplexity_vs_context.png").read_bytes()[:4] == b"\x89PNG"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".eval-")]  # staging folder moved away


def test_truncated_and_sliding_windows_see_only_their_span(checkpoints):
    model, _ = build_model(*TRANSFORMER.split(":"))
    tokens = torch.randint(0, 4096, (2, 40), generator=torch.Generator().manual_seed(0))
    entry = lambda mode, window: Entry("t", model, mode, window, 0, 10**6)  # noqa: E731
    with torch.no_grad():
        full = window_nll(entry("full", 0), tokens)
        assert torch.allclose(token_nll(entry("sliding", 64), tokens), full)  # window >= length: one pass
        truncated = token_nll(entry("truncated", 16), tokens)
        sliding = token_nll(entry("sliding", 16), tokens)
        # truncated: targets 16..30 are scored from the block tokens[15:31] alone
        block = window_nll(entry("full", 0), tokens[:, 15:31])
        assert truncated.shape == sliding.shape == full.shape
        assert torch.allclose(truncated[:, 15:30], block, atol=1e-6)
        # sliding (stride 8): target 39 is scored from the last 16 tokens
        last = torch.nn.functional.cross_entropy(causal_logits(model, tokens[:, 24:39])[:, -1], tokens[:, 39], reduction="none")
        assert torch.allclose(sliding[:, -1], last, atol=1e-6)
        assert not torch.allclose(sliding[:, -1], full[:, -1])


@pytest.mark.parametrize("case,message", [
    ("wrong_family", "does not hold a transformer_small model"),
    ("missing_tokenizer", "no tokenizer.model or tokenizer.json"),
    ("too_long", "takes at most 131072 tokens in one pass"),
    ("stream_transformer", "has no memory state to stream"),
    ("no_long_document", "no document of at least 4096 tokens"),
])
def test_bad_input_one_line_exit_2_nothing_written(case, message, checkpoints, long_docs, tmp_path, capsys):
    args = {
        "wrong_family": ["--checkpoint", checkpoints[MELA], "--config", TRANSFORMER],
        "missing_tokenizer": ["--checkpoint", checkpoints[MELA], "--config", "bad_configs:mela_missing_tokenizer"],
        "too_long": ["--checkpoint", checkpoints[TRANSFORMER], "--config", TRANSFORMER, "--context-lengths", "200000"],
        "stream_transformer": ["--checkpoint", checkpoints[TRANSFORMER], "--config", TRANSFORMER, "--mode", "streaming"],
        "no_long_document": ["--checkpoint", checkpoints[MELA], "--config", MELA, "--context-lengths", "4096"],
    }[case]
    with pytest.raises(SystemExit) as exited:  # the script's main in this process
        load_script("eval_long_ppl").main([*map(str, args), "--dataset", str(long_docs), "--split", "all",
                                           "--out", str(tmp_path / "out")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and message in lines[-1], lines
    assert not (tmp_path / "out").exists()


def test_a_hugging_face_export_evaluates_exactly_as_its_dcp_checkpoint(checkpoints, long_docs, tmp_path):
    from torchtitan_ext.training.checkpoints import model_from_checkpoint
    from torchtitan_ext.hf_export import export

    model, trainer_config = model_from_checkpoint(*MELA.split(":"), checkpoints[MELA])
    export(model, trainer_config, tmp_path / "hf")
    common = ["--config", MELA, "--mode", "streaming", "--context-lengths", "128,256", "--dataset", long_docs,
              "--split", "all", "--device", "cpu", "--dtype", "float32"]
    for name, source in (("dcp", checkpoints[MELA]), ("hf", tmp_path / "hf")):
        run = eval_cli("--checkpoint", source, *common, "--out", tmp_path / name)
        assert run.returncode == 0, run.stderr[-3000:]
    dcp_runs, hf_runs = (json.loads((tmp_path / n / "results.json").read_text())["runs"] for n in ("dcp", "hf"))
    assert [r["results"] for r in dcp_runs] == [r["results"] for r in hf_runs]


def test_local_evaluation_reads_only_documents_training_never_reads(tmp_path):
    """The held-out split of a local dataset is the validation hash split: disjoint from the
    documents the `local` training dataset yields, and what the results name."""
    from torchtitan_ext.data import datasets
    from torchtitan_ext.eval.long_ppl import dataset_split, documents

    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(600)))
    held_out = set(documents(str(path)))
    trained = set(datasets.load_local(str(path), validation=False)["text"])
    assert held_out and not held_out & trained and len(held_out) + len(trained) == 600
    assert set(documents(str(path), "all")) == held_out | trained
    assert "never read by training" in dataset_split(str(path), "heldout")
