"""Hugging Face format <-> the project's models, for every family.

Weights are mapped by each family's torchtitan state-dict adapter (the one its ModelSpec
names): Transformer++ through torchtitan's `Llama3StateDictAdapter` (a standard
`LlamaForCausalLM`, loadable by plain `transformers`), the other families through
`WrapperStateDictAdapter` (keys `model.<plain key>`). Those families export as remote code:
`MemoryLMForCausalLM` (`torchtitan_ext/hf_remote/`) plus the model's own source, copied at
export time from `models/` and `kernels/` with their imports made relative, and an
`auto_map`, so `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` needs only
torch, transformers and safetensors. The Triton kernels are not shipped (the export runs the
torch paths).

Writes go to a temporary sibling folder that is moved into place at the end.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import torch

from torchtitan_ext.errors import UserError
from torchtitan_ext.paths import staged_folder

REPO = Path(__file__).resolve().parents[1]
REMOTE_CODE = Path(__file__).resolve().parent / "hf_remote"
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# family -> (module in models/, model class, config class, {config field: (module, dataclass)})
REMOTE_FAMILIES = {
    "mlp_lm": ("mlp_lm", "MLPLM", "MLPLMConfig", {}),
    "titans": ("titans", "TitansLM", "TitansConfig", {"memory": ("neural_memory", "NeuralMemoryConfig")}),
    "mela": ("mela", "Mela", "MelaConfig", {"memory": ("neural_memory", "NeuralMemoryConfig")}),
}
PROJECT_IMPORT = re.compile(r"^(\s*)from (models|kernels)((?:\.\w+)?) import ", re.MULTILINE)


def family(spec_name: str) -> str:
    """ModelSpec name -> export family: transformer, mlp_lm, titans (any variant), mela."""
    name = "titans" if spec_name.startswith("titans_") else spec_name
    if name != "transformer" and name not in REMOTE_FAMILIES:
        raise UserError(f"model '{spec_name}' has no Hugging Face export")
    return name


def flat_name(package: str, module: str) -> str:
    """models.mela -> mela; kernels -> kernels; kernels.newton_schulz -> kernels_newton_schulz."""
    if package == "models":
        return module.lstrip(".")
    return "kernels" + module.replace(".", "_")


def model_sources(module: str) -> dict[str, str]:
    """{file name: source} of `models.<module>` and every project module it imports,
    flattened into one folder with relative imports."""
    sources, todo = {}, [("models", "." + module)]
    while todo:
        package, sub = todo.pop()
        name = flat_name(package, sub)
        if name + ".py" in sources:
            continue
        path = REPO / package / (sub.lstrip(".") + ".py" if sub else "__init__.py")
        text = path.read_text()
        todo += [(m.group(2), m.group(3)) for m in PROJECT_IMPORT.finditer(text)]
        sources[name + ".py"] = PROJECT_IMPORT.sub(lambda m: f"{m.group(1)}from .{flat_name(m.group(2), m.group(3))} import ", text)
    return sources


def save_safetensors(state: dict[str, torch.Tensor], folder: Path, max_shard_size: str | int) -> None:
    """Sharded safetensors files, and model.safetensors.index.json when there are several."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
    for filename, keys in split.filename_to_tensors.items():
        save_file({k: state[k].contiguous() for k in keys}, str(folder / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": split.tensor_to_filename}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def load_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"no *.safetensors in '{folder}': pass a Hugging Face model folder")
    state = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def _llama_config(spec):
    from transformers import LlamaConfig

    from torchtitan_ext.transformer import FLAVORS

    s = FLAVORS[spec.flavor]
    return LlamaConfig(vocab_size=s.vocab_size, hidden_size=s.dim, intermediate_size=s.ffn_hidden,
                       num_hidden_layers=s.n_layers, num_attention_heads=s.n_heads, num_key_value_heads=s.n_kv_heads,
                       rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=s.max_seq_len,
                       tie_word_embeddings=False, architectures=["LlamaForCausalLM"])


def _remote_code(name: str, plain_config, folder: Path):
    """Write the remote code and return the HF config of a remote-code family."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("configuration_memory_lm", REMOTE_CODE / "configuration_memory_lm.py")
    configuration = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(configuration)
    MemoryLMConfig = configuration.MemoryLMConfig  # noqa: N806 (a class)

    module, cls, config_cls, nested = REMOTE_FAMILIES[name]
    for filename, text in model_sources(module).items():
        (folder / filename).write_text(text)
    lines = [f"from .{module} import {cls} as PlainModel, {config_cls} as PlainConfig"]
    lines += [f"from .{m} import {c}" for m, c in nested.values()]
    lines.append("NESTED = {" + ", ".join(f"{field!r}: {c}" for field, (_, c) in nested.items()) + "}")
    (folder / "family.py").write_text('"""Which model this export holds (written by the exporter)."""\n\n' + "\n".join(lines) + "\n")
    for file in REMOTE_CODE.glob("*.py"):
        shutil.copy(file, folder / file.name)
    config = MemoryLMConfig(family=name, model=dataclasses.asdict(plain_config), architectures=["MemoryLMForCausalLM"],
                            tie_word_embeddings=bool(getattr(plain_config, "tie_embeddings", False)))
    config.auto_map = {"AutoConfig": "configuration_memory_lm.MemoryLMConfig",
                       "AutoModelForCausalLM": "modeling_memory_lm.MemoryLMForCausalLM"}
    return config


def export(model: torch.nn.Module, trainer_config, out: Path, max_shard_size: str | int = "2GB") -> None:
    """Write `model` (built from `trainer_config`) as a Hugging Face folder at `out`."""
    from transformers import GenerationConfig

    spec = trainer_config.model_spec
    name = family(spec.name)
    with staged_folder(out) as staging:
        adapter = spec.state_dict_adapter(spec.model, None)
        state = {k: v.detach().clone() for k, v in adapter.to_hf(model.state_dict()).items()}
        save_safetensors(state, staging, max_shard_size)
        config = _llama_config(spec) if name == "transformer" else _remote_code(name, model.cfg, staging)
        config.save_pretrained(staging)
        GenerationConfig(do_sample=False, use_cache=False).save_pretrained(staging)
        tokenizer_dir = Path(trainer_config.hf_assets_path)
        for filename in TOKENIZER_FILES:
            if (tokenizer_dir / filename).is_file():
                shutil.copy(tokenizer_dir / filename, staging / filename)


def import_weights(module: str, function: str, hf_folder: Path):
    """(model, trainer config) of `module:function` with the weights of a Hugging Face
    folder (an export, or a `transformers` Llama), names and shapes checked first."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from torchtitan_ext.checkpoints import build_model, check_compatible

    meta, config = build_model(module, function, "meta")
    spec = config.model_spec
    family(spec.name)
    state = spec.state_dict_adapter(spec.model, None).from_hf(load_safetensors(hf_folder))
    stored = {k: TensorStorageMetadata(None, v.shape, []) for k, v in state.items()}
    expected = meta.state_dict()
    check_compatible(expected, stored, hf_folder, f"{spec.name} {spec.flavor} model")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise UserError(f"'{hf_folder}' holds {len(unexpected)} weights a {spec.name} {spec.flavor} model does not have "
                        f"(e.g. '{unexpected[0]}'): pass the --module/--config it was exported from")
    model, config = build_model(module, function)
    model.load_state_dict(state)
    return model, config
