"""The training recipes every family's config functions share.

`paper_recipe` is the Mela paper's section 5.1 (also used for the baselines): FineWeb-Edu,
4K context, AdamW (0.9, 0.95), weight decay 0.1, cosine to 10% of the peak with 500
warmup steps, clip 1.0, 0.5M-token global batches through gradient accumulation, bf16
mixed precision, FSDP2, selective activation checkpointing, torch.compile.
`debug_recipe` trains a debug flavor in minutes on CPU, on the embedded corpus.
"""

from __future__ import annotations

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import default_adamw, LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig
from torchtitan.components.validate import Validator
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

from torchtitan_ext.training.trainer import MemoryTrainer

from torchtitan_ext.data.dataloader import TextDataLoader
from torchtitan_ext.paths import default_tokenizer_dir
from torchtitan_ext.data.tokenizer import AssetsTokenizer

PAPER_SEQ_LEN = 4096
PAPER_GLOBAL_BATCH_TOKENS = 2**19  # 0.5M tokens
PAPER_TRAIN_TOKENS = 5 * 10**9  # Mela section 5.1: 5B FineWeb-Edu tokens
ABLATION_TRAIN_TOKENS = 10**9  # Mela section 5.3: every ablation trains on a 1B-token subset


def _trainer_config(model_spec: ModelSpec, *, name: str, **fields) -> Trainer.Config:
    vocab_size = model_spec.model.vocab_size
    return MemoryTrainer.Config(
        model_spec=model_spec,
        dump_folder=f"./outputs/{name}",
        tokenizer=AssetsTokenizer.Config(),
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=vocab_size)),
        # partial_dtensor: torchtitan 0.3.0's default "spmd_types" needs a newer
        # fully_shard than torch 2.13 has ("all parameters must be DTensors" on 2+ ranks).
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        activation_checkpoint=SelectiveAC.Config(),
        **fields,
    )


def grouped_adamw(groups: list[tuple[str, float]]) -> OptimizersContainer.Config:
    """The recipes' AdamW with one learning rate per parameter-name regex, first match wins
    (torchtitan's param_groups; `--optimizer.param-groups.<i>.optimizer-kwargs.lr` sets one)."""
    base = default_adamw().param_groups[0]
    return OptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=pattern, optimizer_name=base.optimizer_name,
                         optimizer_kwargs={**base.optimizer_kwargs, "lr": lr}) for pattern, lr in groups])


def paper_recipe(model_spec: ModelSpec, *, name: str, lr: float = 1e-3, local_batch_size: int = 8,
                 train_tokens: int = PAPER_TRAIN_TOKENS) -> Trainer.Config:
    """Section 5.1's recipe for `train_tokens` tokens (0.5M-token batches of 4K sequences)."""
    global_batch = PAPER_GLOBAL_BATCH_TOKENS // PAPER_SEQ_LEN
    steps = train_tokens // PAPER_GLOBAL_BATCH_TOKENS
    return _trainer_config(
        model_spec,
        name=name,
        hf_assets_path="./assets/tokenizer/llama2",
        optimizer=default_adamw(lr=lr),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=500, decay_type="cosine", min_lr_factor=0.1),
        training=TrainingConfig(
            local_batch_size=local_batch_size, global_batch_size=global_batch, seq_len=PAPER_SEQ_LEN,
            steps=steps, max_norm=1.0, mixed_precision_param="bfloat16",
        ),
        dataloader=TextDataLoader.Config(dataset="fineweb_edu"),
        validator=Validator.Config(
            enable=True, freq=500, steps=100,
            dataloader=TextDataLoader.Config(dataset="fineweb_edu_validation", infinite=False),
        ),
        compile=CompileConfig(enable=True),
        checkpoint=CheckpointManager.Config(enable=True, interval=500, keep_latest_k=3, last_save_model_only=False),
        metrics=MetricsProcessor.Config(log_freq=10, enable_wandb=True),
    )


def debug_recipe(model_spec: ModelSpec, *, name: str, lr: float = 3e-3, steps: int = 60) -> Trainer.Config:
    return _trainer_config(
        model_spec,
        name=name,
        hf_assets_path=str(default_tokenizer_dir()),
        optimizer=default_adamw(lr=lr),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=max(1, steps // 10), decay_type="cosine", min_lr_factor=0.1),
        training=TrainingConfig(
            local_batch_size=4, seq_len=256, steps=steps, max_norm=1.0,
            mixed_precision_param="float32",  # bf16 matmuls are ~400x slower on these CPUs
        ),
        dataloader=TextDataLoader.Config(dataset="embedded", shard_by="sequence"),
        validator=Validator.Config(
            enable=True, freq=steps // 2, steps=4,
            dataloader=TextDataLoader.Config(dataset="embedded_validation", infinite=False),
        ),
        compile=CompileConfig(enable=False),
        checkpoint=CheckpointManager.Config(enable=True, interval=steps // 2, keep_latest_k=2, last_save_model_only=False),
        metrics=MetricsProcessor.Config(log_freq=5, enable_wandb=True),
    )
