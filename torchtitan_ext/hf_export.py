"""Hugging Face format <-> the project's models, for every family.

Weights are mapped by each family's torchtitan state-dict adapter (the one its ModelSpec
names). Families with a `Family.hf_config` export as a standard transformers class
(Transformer++ through torchtitan's `Llama3StateDictAdapter` as `LlamaForCausalLM`; the
pretrained backbone as `LlamaForCausalLM` / `Qwen2ForCausalLM` / `Qwen3ForCausalLM`), loadable by plain
`transformers`; the other families and configs without such a class (a grafted backbone:
its `hf_config` says None), through `WrapperStateDictAdapter` (keys `model.<plain key>`),
export as remote code:
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
from torchtitan_ext.families import Family, family_of_spec
from torchtitan_ext.paths import staged_folder
from torchtitan_ext.families.plain_model import WrapperStateDictAdapter

REPO = Path(__file__).resolve().parents[1]
REMOTE_CODE = Path(__file__).resolve().parent / "hf_remote"
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# A bare sentencepiece model (the offline default) read by transformers' LlamaTokenizer: the
# same ids as the training tokenizer (bos, no eos) for text that does not start with whitespace
# (sentencepiece adds its dummy prefix before leading spaces, transformers does not).
# transformers 5 ignores it in a Qwen2 folder (model_type "qwen2": always its byte-level
# Qwen2Tokenizer); LlamaTokenizer.from_pretrained(folder) reads it there.
SENTENCEPIECE_TOKENIZER_CONFIG = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
                                  "legacy": False, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
PROJECT_IMPORT = re.compile(r"^(\s*)from (models|kernels)((?:\.\w+)*) import ", re.MULTILINE)


def export_family(spec_name: str) -> Family:
    """The registered family of a ModelSpec name, or UserError."""
    try:
        return family_of_spec(spec_name)
    except ValueError as e:
        raise UserError(f"model '{spec_name}' has no Hugging Face export: {e}") from None


def flat_name(package: str, module: str) -> str:
    """The export's file name (no .py) for `package` + `module`: models.lms.mela -> mela;
    models.grafts.lora -> grafts_lora; kernels -> kernels; kernels.reference -> kernels_reference."""
    parts = [part for part in module.split(".") if part]
    return "_".join(parts if package == "models" else ["kernels", *parts])


def project_file(package: str, module: str) -> Path:
    """models/<a>/<b>.py (or the package's __init__.py) of `from <package><module> import`."""
    base = REPO / package / Path(*[part for part in module.split(".") if part])
    return base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"


def class_module(cls: type) -> tuple[str, Path]:
    """(export file name, source file) of the module defining `cls`: `models/` modules are
    flattened (`flat_name`); a module elsewhere (a plugin, a test) keeps its own name."""
    import inspect

    package, _, module = cls.__module__.partition(".")
    if package in ("models", "kernels"):
        return flat_name(package, "." + module), Path(inspect.getsourcefile(cls))
    return cls.__module__.rpartition(".")[2], Path(inspect.getsourcefile(cls))


def model_sources(classes: list[type]) -> dict[str, str]:
    """{file name: source} of the modules defining `classes` and every `models`/`kernels`
    module they import (at any package depth), flattened into one folder with relative imports."""
    sources, todo = {}, [class_module(cls) for cls in classes]
    while todo:
        name, path = todo.pop()
        if name + ".py" in sources:
            continue
        text = path.read_text()
        todo += [(flat_name(m.group(2), m.group(3)), project_file(m.group(2), m.group(3)))
                 for m in PROJECT_IMPORT.finditer(text)]
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


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's *.safetensors files, or UserError."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"no *.safetensors in '{folder}': pass a Hugging Face model folder")
    return files


def load_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = {}
    for file in safetensors_files(folder):
        state.update(load_file(str(file)))
    return state


def safetensors_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """{key: shape} of every tensor in the folder's safetensors, from the headers (no tensor
    is read)."""
    from safetensors import safe_open

    shapes = {}
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            shapes |= {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    return shapes


def _remote_code(family: Family, plain_config, folder: Path):
    """Write the remote code and return the HF config of a remote-code family."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("configuration_memory_lm", REMOTE_CODE / "configuration_memory_lm.py")
    configuration = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(configuration)
    MemoryLMConfig = configuration.MemoryLMConfig  # noqa: N806 (a class)

    nested = family.nested_configs()
    for filename, text in model_sources([family.plain_class, family.config_class, *nested.values()]).items():
        (folder / filename).write_text(text)
    lines = [f"from .{class_module(family.plain_class)[0]} import {family.plain_class.__name__} as PlainModel",
             f"from .{class_module(family.config_class)[0]} import {family.config_class.__name__} as PlainConfig"]
    lines += [f"from .{class_module(c)[0]} import {c.__name__}" for c in nested.values()]
    lines.append("NESTED = {" + ", ".join(f"{field!r}: {c.__name__}" for field, c in nested.items()) + "}")
    (folder / "family.py").write_text('"""Which model this export holds (written by the exporter)."""\n\n' + "\n".join(lines) + "\n")
    for file in REMOTE_CODE.glob("*.py"):
        shutil.copy(file, folder / file.name)
    config = MemoryLMConfig(family=family.name, model=dataclasses.asdict(plain_config), architectures=["MemoryLMForCausalLM"],
                            tie_word_embeddings=bool(getattr(plain_config, "tie_embeddings", False)))
    config.auto_map = {"AutoConfig": "configuration_memory_lm.MemoryLMConfig",
                       "AutoModelForCausalLM": "modeling_memory_lm.MemoryLMForCausalLM"}
    return config


def hf_form(family: Family, spec, model: torch.nn.Module):
    """(transformers config, state-dict adapter) of `model`'s Hugging Face form: a standard
    transformers class (its config, from the model's own config or its flavor's, and the
    family's adapter) or remote code (None, the `model.` prefix adapter)."""
    config = None if family.remote_export else family.hf_config(getattr(model, "cfg", None) or family.config(spec.flavor))
    return config, (WrapperStateDictAdapter if config is None else spec.state_dict_adapter)(spec.model, None)


def export(model: torch.nn.Module, trainer_config, out: Path, max_shard_size: str | int = "2GB",
           merge_lora: bool = False) -> None:
    """Write `model` (built from `trainer_config`) as a Hugging Face folder at `out`; with
    `merge_lora`, LoRA factors are folded into the weights first (a LoRA-only finetune of a
    backbone then exports as the plain transformers class)."""
    from transformers import GenerationConfig

    from models.grafts.graft import GraftConfig
    from models.grafts.lora import merge_lora as merge

    spec = trainer_config.model_spec
    family = export_family(spec.name)
    if merge_lora:
        graft = getattr(getattr(model, "cfg", None), "graft", None)
        if graft is None or graft.kind != "lora":
            raise UserError(f"--merge-lora: {spec.name} {spec.flavor} has no LoRA graft to merge")
        merge(model)
        model.cfg = dataclasses.replace(model.cfg, graft=GraftConfig())
    config, adapter = hf_form(family, spec, model)
    with staged_folder(out) as staging:
        state = {k: v.detach().clone() for k, v in adapter.to_hf(model.state_dict()).items()}
        save_safetensors(state, staging, max_shard_size)
        if config is None:
            config = _remote_code(family, model.cfg, staging)
        config.save_pretrained(staging)
        GenerationConfig(do_sample=False, use_cache=False).save_pretrained(staging)
        tokenizer_dir = Path(trainer_config.hf_assets_path)
        for filename in TOKENIZER_FILES:
            if (tokenizer_dir / filename).is_file():
                shutil.copy(tokenizer_dir / filename, staging / filename)
        if (staging / "tokenizer.model").is_file() and not (staging / "tokenizer_config.json").is_file():
            (staging / "tokenizer_config.json").write_text(json.dumps(SENTENCEPIECE_TOKENIZER_CONFIG, indent=1))


def import_weights(module: str, function: str, hf_folder: Path):
    """(model, trainer config) of `module:function` with the weights of a Hugging Face
    folder (an export, or a `transformers` Llama), names and shapes checked first."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from torchtitan_ext.training.checkpoints import build_model, check_compatible

    meta, config = build_model(module, function, "meta")
    spec = config.model_spec
    _, adapter = hf_form(export_family(spec.name), spec, meta)
    state = adapter.from_hf(load_safetensors(hf_folder))
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
