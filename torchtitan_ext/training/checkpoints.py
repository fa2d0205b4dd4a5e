"""Models from training configs and DCP checkpoints, outside a training run (one process, no
process group): what evaluation and conversion scripts start from.

- `build_model(module, function)`: the model of a `train_configs` function, on CPU, fp32,
  eval mode, with its torchtitan config (tokenizer path, sequence length, ...).
- `load_dcp_model(model, step_dir)`: the model weights of a DCP checkpoint step folder
  (`<dump_folder>/checkpoint/step-N`, full or model-only), checked first: a checkpoint of
  another family or size, a `.metadata` that does not parse, or a shard file missing or
  shorter than its metadata says is a `UserError` naming it, not a silent partial load.
- `resume_step(folder, model_state)`: the newest undamaged step of a run's checkpoint folder,
  with the damaged newer ones and why; `resume_plan(config)` applies it to a training run's
  folder (the launcher's preflight and the training entry call it).
- `causal_logits(model, tokens)`: logits of one document per row for any project model
  (torchtitan decoders need their attention masks built; plain models build their own).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from torchtitan_ext.errors import UserError
from torchtitan_ext.training.cli import parse


def build_model(module: str, function: str, device: str = "cpu"):
    """(model, trainer config) for `--module module --config function`, fp32, eval mode.
    device "meta" builds the structure only (instant at any size: for checking shapes)."""
    from torchtitan_ext.training import cpu

    cpu.apply()
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # torchtitan's training-config warnings mean nothing outside a run
    try:
        config = parse(["--module", module, "--config", function])
    finally:
        logging.disable(previous)
    with torch.device(device):
        model = config.model_spec.model.build()
    if device != "meta" and hasattr(model, "init_states"):
        model.init_states()
    return model.float().eval(), config


def _checkpoint_tensors(step_dir: Path) -> dict:
    """{key: TensorStorageMetadata} of a DCP checkpoint's tensors, or UserError: no
    `.metadata`, one that does not parse, or a shard file missing or shorter than the bytes
    the metadata places in it (a node that died mid-write)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not (step_dir / ".metadata").is_file():
        raise UserError(f"'{step_dir}' is not a DCP checkpoint step folder (no .metadata): pass "
                        "<dump_folder>/checkpoint/step-<N>")
    try:
        metadata = FileSystemReader(str(step_dir)).read_metadata()
        placed = {}  # shard file -> bytes the metadata places in it
        for info in metadata.storage_data.values():
            placed[info.relative_path] = max(placed.get(info.relative_path, 0), info.offset + info.length)
    except Exception as e:  # pickle or attribute errors of a damaged file
        raise UserError(f"checkpoint '{step_dir}': .metadata does not parse ({type(e).__name__}): the step was "
                        "damaged while written; use an earlier step") from None
    for name, needed in sorted(placed.items()):
        shard = step_dir / name
        if not shard.is_file():
            raise UserError(f"checkpoint '{step_dir}': shard '{name}' is missing: the step is incomplete; use an "
                            "earlier step")
        if shard.stat().st_size < needed:
            raise UserError(f"checkpoint '{step_dir}': shard '{name}' is truncated ({shard.stat().st_size} of "
                            f"{needed} bytes): the step is incomplete; use an earlier step")
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


def dcp_steps(folder: str | Path) -> list[int]:
    """The N of `folder`'s `step-N` folders holding a `.metadata`, newest first (torchtitan loads
    no other)."""
    return sorted((int(p.name.split("-")[1]) for p in Path(folder).glob("step-*")
                   if p.name.split("-")[1].isdigit() and (p / ".metadata").is_file()), reverse=True)


def resume_step(folder: str | Path, model_state: dict) -> tuple[int | None, list[str]]:
    """(newest step of `folder`'s `step-N` DCP checkpoints whose files are whole and hold
    this model's weights, or None when no step is whole, [one reason per damaged newer step]).
    Folders without `.metadata` are not steps (torchtitan never loads them either)."""
    steps = dcp_steps(folder)
    damaged = []
    for step in steps:
        step_dir = Path(folder) / f"step-{step}"
        try:
            check_compatible(model_state, _checkpoint_tensors(step_dir), step_dir, "model of this config")
        except UserError as e:
            damaged.append(f"step-{step}: {e}")
            continue
        return step, damaged
    return None, damaged


def resume_plan(config) -> tuple[int | None, list[str]]:
    """(step a training run of `config` resumes from, the damaged newer steps and why) for its
    dump folder's checkpoints: (None, []) when it starts afresh or the user chose the step
    (`--checkpoint.load_step`); UserError when steps exist and none is whole."""
    folder = Path(config.dump_folder) / config.checkpoint.folder
    if not config.checkpoint.enable or config.checkpoint.load_step != -1 or not folder.is_dir():
        return None, []
    with torch.device("meta"):
        model_state = config.model_spec.model.build().state_dict()
    step, damaged = resume_step(folder, model_state)
    if step is None and damaged:
        raise UserError(f"no whole checkpoint to resume from in '{folder}' ({'; '.join(damaged)}): move the folder "
                        "aside to start afresh")
    return step, damaged


def is_disk_full(error: BaseException) -> bool:
    """Whether a save failed for want of space: ENOSPC itself or inside DCP's
    CheckpointException (which carries every rank's failure)."""
    import errno

    if isinstance(error, OSError):
        return error.errno == errno.ENOSPC
    failures = getattr(error, "failures", None) or {}
    return any(is_disk_full(failure[0]) for failure in failures.values())


def disk_full_message(config) -> str:
    """One line for a save that ran out of space: where, how many bytes a checkpoint takes
    here (the newest whole step's size) and the step a rerun resumes from."""
    folder = Path(config.dump_folder) / config.checkpoint.folder
    steps = dcp_steps(folder)
    if not steps:
        return (f"disk full while writing a checkpoint under '{folder}': free space there and rerun the same command "
                "(no whole checkpoint yet: it starts afresh)")
    size = sum(f.stat().st_size for f in (folder / f"step-{steps[0]}").iterdir() if f.is_file())
    return (f"disk full while writing a checkpoint under '{folder}': a checkpoint takes {size:,} bytes here "
            f"(step-{steps[0]}); free that much and rerun the same command to resume from step-{steps[0]}")


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
