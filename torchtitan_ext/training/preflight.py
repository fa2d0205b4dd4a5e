"""Check a parsed Trainer config before any work, turning bad input into one-line UserErrors."""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

from torchtitan_ext.errors import UserError
from torchtitan_ext.training.cli import option_value, parse


# The modules the training entry (train.py -> torchtitan.train) imports that a GPU image with
# its own torch may lack, as {module: distribution}: torchtitan 0.3.0 and its requirements
# (tyro's typeguard and docstring-parser, datasets' dill and multiprocess, imported lazily or
# transitively) and our tokenizer's sentencepiece. transformers serves only the HF conversion
# scripts; triton comes with every CUDA torch (and must match it: no wheel of ours can fix it).
REQUIRED = {"torchtitan": "torchtitan", "datasets": "datasets", "tyro": "tyro", "typeguard": "typeguard",
            "docstring_parser": "docstring-parser", "torch_checkpointing": "torch-checkpointing",
            "spmd_types": "spmd-types", "torchdata": "torchdata", "multiprocess": "multiprocess", "dill": "dill",
            "tensorboard": "tensorboard", "safetensors": "safetensors", "tokenizers": "tokenizers",
            "sentencepiece": "sentencepiece"}
# What `scripts/gpu_wheels.sh DIR` fetches without extra names (its BASE list).
GPU_WHEELS = {"torchtitan", "datasets", "tyro", "typeguard", "docstring-parser", "torch-checkpointing", "spmd-types",
              "torchdata", "multiprocess", "dill", "typing-extensions"}
WHEELS_INSTALL = ("python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site DIR/*.whl && "
                  "export PYTHONPATH=/tmp/site")


def check_environment() -> None:
    """This Python has a torch this project supports and every distribution the training
    path imports. Runs before anything imports torchtitan, so that an image's own python
    (`PYTHON=python3 bash scripts/train.sh`) without them gets one line naming all of them
    and the fix, not the first ImportError's traceback. `find_spec` imports nothing."""
    import torch

    from torchtitan_ext.torch_compat import OLDEST_TORCH, torch_version

    version, oldest = torch.__version__, ".".join(map(str, OLDEST_TORCH))
    if torch_version() < OLDEST_TORCH:
        raise UserError(f"torch {version} is older than {oldest}, the oldest this project supports ({oldest}-2.13): use a "
                        "python with a newer torch, or the pinned environment (unset PYTHON; bash scripts/setup.sh)")
    missing = [dist for module, dist in REQUIRED.items() if importlib.util.find_spec(module) is None]
    if missing:
        extra = "".join(f" {dist}" for dist in missing if dist not in GPU_WHEELS)
        raise UserError(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed for "
                        f"{sys.executable}: with the pinned environment run "
                        f"`bash scripts/setup.sh`; on an image with its own torch fetch them where pip has network "
                        f"with `bash scripts/gpu_wheels.sh DIR{extra}` and install them there with `{WHEELS_INSTALL}`")


def check_wandb(config) -> None:
    """wandb is importable when the config logs to it (torchtitan imports it only when the
    logger is built, after the model: a late traceback otherwise). Our recipes enable it;
    GPU images seldom have it (a dozen dependencies), hence the flag that turns it off."""
    if config.metrics.enable_wandb and importlib.util.find_spec("wandb") is None:
        raise UserError("wandb is not installed: pass --metrics.no-enable-wandb, or fetch it with "
                        "`bash scripts/gpu_wheels.sh DIR --wandb` (installed as that script prints)")


def world_size() -> int:
    """Processes of the run: torchrun's WORLD_SIZE (the launcher sets it for its own preflight)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def batch_degree(config, world: int) -> int:
    """Data-parallel degree (replicate x shard) of `world` ranks under the config's parallelism."""
    p = config.parallelism
    other = p.tensor_parallel_degree * p.pipeline_parallel_degree * p.context_parallel_degree
    if world % other:
        raise UserError(f"{world} ranks do not split into tensor x pipeline x context parallel degree {other}: "
                        "use a multiple of it")
    shard = p.data_parallel_shard_degree
    if shard == -1:
        if (world // other) % p.data_parallel_replicate_degree:
            raise UserError(f"{world // other} data-parallel ranks do not split into replicate degree "
                            f"{p.data_parallel_replicate_degree}: pass --parallelism.data_parallel_replicate_degree "
                            "dividing them")
        shard = world // other // p.data_parallel_replicate_degree
    return p.data_parallel_replicate_degree * shard


def fitted_local_batch(config, world: int, explicit: bool) -> int:
    """The local batch (sequences per rank per micro-step) for `world` ranks. The global batch
    is the fixed quantity: a recipe's local batch is a ceiling, lowered to the largest size
    that divides the global batch per data-parallel rank (torchtitan then accumulates the
    rest). An `explicit` (user-passed) local batch is kept and must fit."""
    training, degree = config.training, batch_degree(config, world)
    if training.global_batch_size < 0:
        return training.local_batch_size
    per_rank, remainder = divmod(training.global_batch_size, degree)
    if remainder or not per_rank:
        raise UserError(f"global batch {training.global_batch_size} sequences does not split over {degree} data-parallel "
                        f"ranks: use a rank count dividing it, or pass --training.global_batch_size <multiple of {degree}>")
    if explicit:
        if per_rank % training.local_batch_size:
            raise UserError(f"--training.local_batch_size {training.local_batch_size} does not divide the "
                            f"{per_rank} sequences per rank ({training.global_batch_size} over {degree} ranks): "
                            "pass a divisor of it, or leave it out to fit it automatically")
        return training.local_batch_size
    return max(n for n in range(1, min(training.local_batch_size, per_rank) + 1) if per_rank % n == 0)


def check_dump_folder(folder: str) -> None:
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise UserError(f"dump folder '{folder}' is not writable ({e.strerror}): pass --dump_folder <writable folder>") from None


def check_dataset(dataloader_config, flag: str, rows: bool = False) -> None:
    """The dataset is registered and its local path exists; with `rows`, every row of a local
    dataset is readable (`datasets.check_local_rows`: the launcher's check, run once), or with
    `skip_bad_rows` one line says how many rows training will skip."""
    from torchtitan.hf_datasets.text_datasets import DATASETS

    import torchtitan_ext.data.datasets as datasets

    name = dataloader_config.dataset.lower()
    if name not in DATASETS:
        raise UserError(f"unknown dataset '{name}': pass --{flag}.dataset one of {sorted(DATASETS)}")
    path = dataloader_config.dataset_path or DATASETS[name].path
    if name.startswith("local"):
        if not path:
            raise UserError(f"dataset '{name}' needs a path: pass --{flag}.dataset_path <file or folder>")
        datasets._local_files(Path(path))
    elif name.startswith("fineweb_edu") and path.startswith(("/", ".", "~")) and not os.path.exists(path):
        raise UserError(f"dataset path '{path}' does not exist: pass --{flag}.dataset_path <existing folder of parquet shards>")
    if not rows or not (name.startswith("local") or (name.startswith("fineweb_edu") and os.path.exists(path))):
        return
    if not getattr(dataloader_config, "skip_bad_rows", False):
        datasets.check_local_rows(Path(path))
    elif bad := sum(1 for _ in datasets.bad_local_rows(Path(path))):
        print(f"preflight: {bad} bad rows in '{path}' will be skipped (--{flag}.skip_bad_rows)", flush=True)


def check_tokenizer(config) -> None:
    from torchtitan_ext.data import default_tokenizer
    from torchtitan_ext.paths import default_tokenizer_dir
    from torchtitan_ext.data.tokenizer import AssetsTokenizer

    if Path(config.hf_assets_path).resolve() == default_tokenizer_dir().resolve():
        default_tokenizer.build(Path(config.hf_assets_path))  # the offline default: trained once, on first use

    tokenizer = AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=config.hf_assets_path)
    vocab = config.model_spec.model.vocab_size
    if tokenizer.get_vocab_size() > vocab:
        raise UserError(
            f"tokenizer in '{config.hf_assets_path}' has {tokenizer.get_vocab_size()} tokens but the model's "
            f"vocabulary is {vocab}: use a matching --hf_assets_path or flavor"
        )


def check_initial_hf_checkpoint(config) -> None:
    """With `--checkpoint.initial_load_in_hf`, checkpointing is on (torchtitan loads nothing
    otherwise), the folder exists and (for families that can tell, `Family.check_hf_folder`)
    holds a model of the flavor's shape."""
    from torchtitan_ext.families import family_of_spec

    checkpoint = config.checkpoint
    if not (checkpoint.initial_load_in_hf and checkpoint.initial_load_path):
        return
    if not checkpoint.enable:
        raise UserError("--checkpoint.initial_load_path is ignored while checkpointing is off (the model would start "
                        "from random weights): drop --checkpoint.no-enable (set --checkpoint.interval to save rarely)")
    folder = Path(checkpoint.initial_load_path)
    if not folder.is_dir():
        raise UserError(f"--checkpoint.initial_load_path '{folder}' does not exist: pass a Hugging Face model folder")
    try:
        family = family_of_spec(config.model_spec.name)
    except ValueError:
        return
    if family.check_hf_folder is not None:
        family.check_hf_folder(config.model_spec.model.model, folder)


def check_family(config) -> None:
    """The family's own checks of the trainer config (`Family.check_config`)."""
    from torchtitan_ext.families import family_of_spec

    try:
        family = family_of_spec(config.model_spec.name)
    except ValueError:
        return
    if family.check_config is not None:
        family.check_config(config)


def check_model_builds(config) -> None:
    """The model builds (on the meta device: no memory, no time); a shape its config cannot
    take (e.g. MoNe heads that do not divide the widths) is one line."""
    import torch

    try:
        with torch.device("meta"):
            config.model_spec.model.build()
    except ValueError as e:
        raise UserError(f"the model of {config.model_spec.name} does not build: {e}") from None


def warn_memory_budget(config, world: int) -> str | None:
    """With `MEMORY_BUDGET=1` on a CUDA machine, one warning line when the predicted peak
    memory of a rank (`memory_budget.warning_line`, FSDP over `world` ranks) exceeds 90% of
    device 0's memory, printed and returned; else None. Opt-in: the meta-device simulation
    takes 1.5 minutes (transformer_400m, titans_mac_400m) to 13 minutes (mela_400m) at the
    papers' shapes. A warning, not an error: the prediction leaves out allocator overheads."""
    import torch

    if os.environ.get("MEMORY_BUDGET") != "1" or not torch.cuda.is_available():
        return None
    from torchtitan_ext.training.memory_budget import warning_line

    line = warning_line(config, torch.cuda.get_device_properties(0).total_memory, ranks=world)
    if line:
        print(line, file=sys.stderr)
    return line


def check(config, world: int | None = None, explicit_local_batch: bool = False, rows: bool = False) -> None:
    """Raise a one-line UserError for the first problem of `config` run on `world` ranks
    (default: `world_size()`); `rows`: the launcher's check, which also reads every row of a
    local dataset and the checkpoints a run would resume from (the ranks skip both here)."""
    from torchtitan_ext.families.plain_model import check_seq_len
    from torchtitan_ext.training.checkpoints import resume_plan

    world = world_size() if world is None else world
    check_wandb(config)
    fitted_local_batch(config, world, explicit_local_batch)
    check_seq_len(config)
    check_model_builds(config)
    check_dump_folder(config.dump_folder)
    check_dataset(config.dataloader, "dataloader", rows)
    if config.validator.enable:
        check_dataset(config.validator.dataloader, "validator.dataloader", rows)
    check_family(config)
    check_tokenizer(config)
    check_initial_hf_checkpoint(config)
    if rows:  # the launcher's: steps exist, none whole (the ranks' entry calls resume_plan itself)
        resume_plan(config)
        warn_memory_budget(config, world)


def main(argv: list[str] | None = None) -> None:
    """`python -m torchtitan_ext.training.preflight <train args>`: exit 0 if the config is usable, else
    print one line and exit 2. The launcher runs it before torchrun. The environment is checked
    first: `cpu.apply` and `parse` import torchtitan."""
    import logging

    from torchtitan_ext.training import cpu

    logging.disable(logging.WARNING)  # the check speaks in one line; torchtitan's config warnings wait for the run
    argv = sys.argv[1:] if argv is None else argv
    try:
        check_environment()
        cpu.apply()
        check(parse(argv), explicit_local_batch=option_value(argv, "--training.local_batch_size") is not None, rows=True)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
