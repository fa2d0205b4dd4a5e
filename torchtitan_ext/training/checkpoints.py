"""Models from training configs and DCP checkpoints, outside a training run (one process, no
process group): what evaluation and conversion scripts start from.

- `build_model(module, function)`: the model of a `train_configs` function, on CPU, fp32,
  eval mode, with its torchtitan config (tokenizer path, sequence length, ...).
- `load_dcp_model(model, step_dir)`: the model weights of a DCP checkpoint step folder
  (`<dump_folder>/checkpoint/step-N`, full or model-only), checked first: a checkpoint of
  another family or size is a `UserError` naming the mismatch, not a silent partial load.
- `causal_logits(model, tokens)`: logits of one document per row for any project model
  (torchtitan decoders need their attention masks built; plain models build their own).
"""

from __future__ import annotations

from pathlib import Path

import torch

from torchtitan_ext.errors import UserError
from torchtitan_ext.training.cli import parse


def build_model(module: str, function: str, device: str = "cpu"):
    """(model, trainer config) for `--module module --config function`, fp32, eval mode.
    device "meta" builds the structure only (instant at any size: for checking shapes)."""
    from torchtitan_ext.training import cpu

    cpu.apply()
    config = parse(["--module", module, "--config", function])
    with torch.device(device):
        model = config.model_spec.model.build()
    if device != "meta" and hasattr(model, "init_states"):
        model.init_states()
    return model.float().eval(), config


def _checkpoint_tensors(step_dir: Path) -> dict:
    """{key: TensorStorageMetadata} of a DCP checkpoint's tensors, or UserError."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not (step_dir / ".metadata").is_file():
        raise UserError(f"'{step_dir}' is not a DCP checkpoint step folder (no .metadata): pass "
                        "<dump_folder>/checkpoint/step-<N>")
    metadata = FileSystemReader(str(step_dir)).read_metadata()
    return {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def check_compatible(model_state: dict, stored: dict, step_dir: Path, what: str) -> None:
    """UserError unless every model weight is stored with the model's shape; the one line
    names the missing weights and the first shape that differs."""
    missing = [k for k in model_state if k not in stored]
    resized = [k for k in model_state if k in stored and tuple(stored[k].size) != tuple(model_state[k].shape)]
    if not (missing or resized):
        return
    problems = []
    if missing:
        problems.append(f"{len(missing)} of {len(model_state)} weights missing (e.g. '{missing[0]}')")
    if resized:
        key = resized[0]
        problems.append(f"'{key}' has shape {tuple(stored[key].size)}, not {tuple(model_state[key].shape)}")
    raise UserError(f"checkpoint '{step_dir}' does not hold a {what} ({'; '.join(problems)}): another family or "
                    "size, pass the --module/--config it was trained with")


def load_dcp_model(model: torch.nn.Module, step_dir: str | Path, what: str = "model of this config") -> None:
    """Load the model weights of a DCP checkpoint into `model` (in place, no process group)."""
    import torch.distributed.checkpoint as dcp

    step_dir = Path(step_dir)
    state = model.state_dict()
    check_compatible(state, _checkpoint_tensors(step_dir), step_dir, what)
    dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
    model.load_state_dict(state)


def model_from_checkpoint(module: str, function: str, step_dir: str | Path):
    """(model, trainer config) with the weights of a DCP step folder, checked against the
    config's shapes before the model is materialised (a wrong size fails at once)."""
    meta, _ = build_model(module, function, "meta")
    check_compatible(meta.state_dict(), _checkpoint_tensors(Path(step_dir)), Path(step_dir), f"{function} model")
    model, config = build_model(module, function)
    load_dcp_model(model, step_dir, f"{function} model")
    return model, config


def causal_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """tokens (B, L), one document per row -> logits (B, L, vocab)."""
    if hasattr(model, "get_attention_masks"):
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return model(tokens, attention_masks=model.get_attention_masks(positions))
    return model(tokens)
