"""Hugging Face conversion (scripts/convert_to_hf.py, convert_from_hf.py) for every family.

The exports are loaded in a child Python that sees only site-packages without this project
(`python -S`, no editable-install hook, cwd elsewhere): what a user with torch, transformers
and safetensors has."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import exit_code, load_script, train
from torchtitan_ext.training.checkpoints import build_model, causal_logits, load_dcp_model
from torchtitan_ext.data.tokenizer import AssetsTokenizer
from torchtitan_ext.families.transformer import FAMILY as TRANSFORMER

FAMILIES = {
    "transformer": "train_configs.transformer:transformer_small",
    "mlp_lm": "train_configs.mlp_lm:mlp_lm_debug",
    "titans": "train_configs.titans:titans_mac_debug",  # the variants share the model class and code
    "mela": "train_configs.mela:mela_debug",
    "backbone": "train_configs.backbone:backbone_qwen3_debug",  # a standard Qwen3ForCausalLM
    "backbone_qwen2": "train_configs.backbone:backbone_qwen2_debug",  # a standard Qwen2ForCausalLM (q/k/v biases)
    "memoryllama": "train_configs.backbone:memoryllama_alma_debug",  # a grafted backbone: remote code
    "mone": "train_configs.backbone:mone_debug",
}
EXPORTED_CLASS = {"transformer": "LlamaForCausalLM", "backbone": "Qwen3ForCausalLM",
                  "backbone_qwen2": "Qwen2ForCausalLM"}  # others: remote code
# Text the export's tokenizer must encode as training does (not starting with whitespace:
# sentencepiece puts its dummy prefix before leading spaces, transformers does not).
TEXTS = ["def f(x):\n    return x**2\n", "Memory is written at test time, 2026.", "Ünïcödé 東京 🙂"]
# transformers 5 reads any model_type "qwen2" folder's tokenizer as its byte-level Qwen2Tokenizer,
# whatever tokenizer_config.json names: the debug export's sentencepiece tokenizer is read with
# LlamaTokenizer explicitly (tests/test_backbone.py), not through AutoTokenizer.
NO_AUTO_TOKENIZER = {"backbone_qwen2"}
LENGTH = 80  # longer than one memory chunk (Titans: 16 tokens) and one Mela chunk (64 tokens)
NEW_TOKENS = 32

LOAD_IN_PLAIN_TRANSFORMERS = """
import json, sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
folder, inputs, out = sys.argv[1:4]
texts = json.loads(sys.argv[4]) if len(sys.argv) > 4 else []
token_ids = [AutoTokenizer.from_pretrained(folder)(t)["input_ids"] for t in texts]
config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
fields = {k: getattr(config, k, None) for k in ("vocab_size", "hidden_size", "num_hidden_layers")}
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
x = torch.load(inputs)
with torch.no_grad():
    logits = model(x).logits
    generated = model.generate(x[:, :24], max_new_tokens=32, do_sample=False, min_new_tokens=32)
project = [m for m in sys.modules if m.split(".")[0] in ("models", "kernels", "torchtitan", "torchtitan_ext")]
torch.save({"logits": logits, "generated": generated, "class": type(model).__name__, "project": project,
            "config": fields, "token_ids": token_ids}, out)
"""


def run_script(name: str, *args) -> int:
    """Run scripts/<name>'s main in this process; its exit code (0 when it returns)."""
    return exit_code(load_script(name.removesuffix(".py")).main, [str(a) for a in args])


def native(config: str, folder):
    """A model of `config` with random weights saved as a DCP step folder."""
    torch.manual_seed(0)
    model, _ = build_model(*config.split(":"))
    with torch.no_grad():  # break the symmetry of zero-initialised parts
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    dcp.save(model.state_dict(), checkpoint_id=str(folder), no_dist=True)
    return model


def greedy(model, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    seq = prompt
    with torch.no_grad():
        for _ in range(steps):
            seq = torch.cat([seq, causal_logits(model, seq)[:, -1:].argmax(-1)], 1)
    return seq


def load_without_project(folder, inputs, tmp_path, texts: list[str] = ()) -> dict:
    """Logits, greedy generation, standard config fields and (for `texts`) the export
    tokenizer's ids, from a Python that has transformers but not this project."""
    out = tmp_path / "hf_outputs.pt"
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": site.getsitepackages()[0], "HF_HUB_OFFLINE": "1"}
    child = subprocess.run([sys.executable, "-S", "-c", LOAD_IN_PLAIN_TRANSFORMERS, str(folder), str(inputs), str(out),
                            json.dumps(list(texts))],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    return torch.load(out)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_export_matches_native_and_round_trips_bit_for_bit(family, tokenizer_dir, tmp_path):
    config = FAMILIES[family]
    module, function = config.split(":")
    model = native(config, tmp_path / "dcp")
    assert run_script("convert_to_hf.py", "--module", module, "--config", function, "--checkpoint", tmp_path / "dcp",
                      "--out", tmp_path / "hf", "--max-shard-size", "1MB") == 0
    files = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.model"} <= files
    assert len([f for f in files if f.endswith(".safetensors")]) > 1  # sharded

    x = torch.randint(0, 4096, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    torch.save(x, tmp_path / "x.pt")
    texts = [] if family in NO_AUTO_TOKENIZER else TEXTS
    hf = load_without_project(tmp_path / "hf", tmp_path / "x.pt", tmp_path, texts)
    assert hf["project"] == []
    ours = AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=str(tokenizer_dir))
    assert hf["token_ids"] == [ours.encode(t, add_bos=True, add_eos=False) for t in texts]  # the export's tokenizer
    shape = model.cfg if family != "transformer" else TRANSFORMER.config("small")  # AutoConfig's standard fields
    assert hf["config"] == {"vocab_size": shape.vocab_size, "hidden_size": shape.dim, "num_hidden_layers": shape.n_layers}
    assert hf["class"] == EXPORTED_CLASS.get(family, "MemoryLMForCausalLM")
    with torch.no_grad():
        assert (hf["logits"] - causal_logits(model, x)).abs().max() < 1e-4
    assert torch.equal(hf["generated"], greedy(model, x[:, :24], NEW_TOKENS))

    assert run_script("convert_from_hf.py", "--module", module, "--config", function, "--hf", tmp_path / "hf",
                      "--out", tmp_path / "dcp_back") == 0
    reloaded, _ = build_model(module, function)
    load_dcp_model(reloaded, tmp_path / "dcp_back")
    original, restored = model.state_dict(), reloaded.state_dict()
    assert original.keys() == restored.keys() and all(torch.equal(original[k], restored[k]) for k in original)


def test_a_transformers_llama_converts_to_dcp_and_back_with_identical_logits(tokenizer_dir, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    s = TRANSFORMER.config("small")
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=s.vocab_size, hidden_size=s.dim, intermediate_size=s.ffn_hidden,
                                         num_hidden_layers=s.n_layers, num_attention_heads=s.n_heads,
                                         num_key_value_heads=s.n_kv_heads, rms_norm_eps=1e-5, rope_theta=500000.0,
                                         tie_word_embeddings=False)).eval()
    llama.save_pretrained(tmp_path / "llama")
    args = ["--module", "train_configs.transformer", "--config", "transformer_small"]
    assert run_script("convert_from_hf.py", *args, "--hf", tmp_path / "llama", "--out", tmp_path / "dcp") == 0
    model, _ = build_model("train_configs.transformer", "transformer_small")
    load_dcp_model(model, tmp_path / "dcp")
    x = torch.randint(0, s.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (causal_logits(model, x) - llama(x).logits).abs().max() < 1e-4
    assert run_script("convert_to_hf.py", *args, "--checkpoint", tmp_path / "dcp", "--out", tmp_path / "again") == 0
    again = LlamaForCausalLM.from_pretrained(tmp_path / "again").eval()
    with torch.no_grad():
        assert torch.equal(again(x).logits, llama(x).logits)


@pytest.fixture(scope="module")
def mlp_lm_export(tmp_path_factory, tokenizer_dir):
    folder = tmp_path_factory.mktemp("mlp_lm")
    native(FAMILIES["mlp_lm"], folder / "dcp")
    assert run_script("convert_to_hf.py", "--module", "train_configs.mlp_lm", "--config", "mlp_lm_debug",
                      "--checkpoint", folder / "dcp", "--out", folder / "hf") == 0
    return folder


@pytest.mark.parametrize("case,message", [
    ("wrong_family", "does not hold a mela debug model"),
    ("wrong_size", "does not hold a mlp_lm_600m model"),
    ("no_checkpoint", "is not a DCP checkpoint step folder"),
    ("no_weights", "no *.safetensors in"),
])
def test_bad_input_one_line_exit_2_nothing_written(case, message, mlp_lm_export, tmp_path, capsys):
    mela = ["--module", "train_configs.mela", "--config", "mela_debug"]
    out = ["--out", tmp_path / "out"]
    code = {
        "wrong_family": lambda: run_script("convert_from_hf.py", *mela, "--hf", mlp_lm_export / "hf", *out),
        "wrong_size": lambda: run_script("convert_to_hf.py", "--module", "train_configs.mlp_lm", "--config", "mlp_lm_600m",
                                         "--checkpoint", mlp_lm_export / "dcp", *out),
        "no_checkpoint": lambda: run_script("convert_to_hf.py", *mela, "--checkpoint", tmp_path / "missing", *out),
        "no_weights": lambda: run_script("convert_from_hf.py", *mela, "--hf", tmp_path, *out),
    }[case]()
    assert code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_training_starts_from_converted_weights_seed_or_initial_load_in_hf(tokenizer_dir, tmp_path):
    """A seed checkpoint written by convert_from_hf.py and torchtitan's own HF initial load
    give the same first losses. The seed's load is DCP's, strict (a missing tensor fails), and
    convert_from_hf.py restores mela's weights bit for bit (the round trip above): so the HF
    load matches only by loading every weight."""
    native(FAMILIES["mela"], tmp_path / "dcp")
    args = ["--module", "train_configs.mela", "--config", "mela_debug"]
    assert run_script("convert_to_hf.py", *args, "--checkpoint", tmp_path / "dcp", "--out", tmp_path / "hf") == 0
    assert run_script("convert_from_hf.py", *args, "--hf", tmp_path / "hf",
                      "--out", tmp_path / "seeded" / "checkpoint" / "step-0") == 0
    short = ["--training.steps", "2", "--validator.no-enable", "--debug.seed", "0", "--checkpoint.interval", "2"]
    runs = {
        "seeded": train(args + short + ["--dump_folder", str(tmp_path / "seeded")]),
        "hf": train(args + short + ["--dump_folder", str(tmp_path / "hf_run"), "--checkpoint.initial_load_path",
                                    str(tmp_path / "hf"), "--checkpoint.initial_load_in_hf"]),
    }
    assert all(r.returncode == 0 and len(r.losses) == 2 for r in runs.values()), runs
    assert "step-0" in runs["seeded"].output and "Loading from HF safetensors" in runs["hf"].output
    assert runs["seeded"].losses == runs["hf"].losses
