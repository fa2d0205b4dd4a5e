"""The family registry: a family added as one entry (tests/toy_family.py, tests/toy_model.py) reaches the
catalogue, parameter counts, FLOPs, the Hugging Face export and evaluation with no other edit."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import load_script
from test_hf import load_without_project, run_script
from toy_family import TOY
from toy_model import ToyLM
from torchtitan_ext.catalogue import config_functions
from torchtitan_ext.training.checkpoints import build_model, causal_logits
from torchtitan_ext.families import families, family_of_config_function, family_of_spec, register, unregister


@pytest.fixture
def toy():
    register(TOY)
    yield TOY
    unregister(TOY.name)


def test_every_built_in_family_resolves_from_its_spec_and_config_names():
    for family in families().values():
        for spec_name, flavor, overrides in family.specs():
            assert family_of_spec(family.model_spec(flavor, **overrides).name) is family
        for function, _ in config_functions()[family.config_module]:
            assert family_of_config_function(function) is family
    with pytest.raises(ValueError, match="no registered family"):
        family_of_spec("gpt2")


def test_a_family_registers_once():
    with pytest.raises(ValueError, match="already registered"):
        register(families()["mela"])


def test_a_toy_family_reaches_catalogue_counts_flops_export_and_eval(toy, tokenizer_dir, tmp_path):
    assert ("toy_debug", "The toy decoder at debug size.") in config_functions()["toy_family"]
    size = sum(p.numel() for p in ToyLM(toy.config("debug")).parameters())
    assert ("toy", "debug", size) in load_script("param_counts").counts()
    spec = toy.model_spec("debug").model
    with torch.device("meta"):
        n_params, flops = spec.get_nparams_and_flops(spec.build(), 64)
    assert n_params == size and flops == 6 * size  # no count of its own: the dense estimate

    torch.manual_seed(0)
    model, _ = build_model("toy_family", "toy_debug")
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert run_script("convert_to_hf.py", "--module", "toy_family", "--config", "toy_debug",
                      "--checkpoint", tmp_path / "dcp", "--out", tmp_path / "hf") == 0
    x = torch.randint(0, 4096, (2, 40), generator=torch.Generator().manual_seed(1))
    torch.save(x, tmp_path / "x.pt")
    hf = load_without_project(tmp_path / "hf", tmp_path / "x.pt", tmp_path)  # a Python without the project
    assert hf["class"] == "MemoryLMForCausalLM" and hf["config"]["vocab_size"] == 4096
    with torch.no_grad():
        assert (hf["logits"] - causal_logits(model, x)).abs().max() < 1e-5

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": "memory " * 300}) + "\n" for _ in range(2)))
    nll = {}
    for source in ("dcp", "hf"):
        load_script("eval_long_ppl").main(["--checkpoint", str(tmp_path / source), "--config", "toy_family:toy_debug",
                                           "--dataset", str(docs), "--split", "all", "--context-lengths", "128",
                                           "--out", str(tmp_path / f"eval_{source}")])
        nll[source] = json.loads((tmp_path / f"eval_{source}" / "results.json").read_text())["runs"][0]["results"]["128"]
    assert nll["dcp"] == nll["hf"] and nll["dcp"]["tokens"] == 2 * 127
