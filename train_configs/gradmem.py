"""GradMem configs (paper 001): `--module train_configs.gradmem`.

From scratch on KV-retrieval (section 3, appendix C, the public code's recipe): the 4-layer,
4-head, 128-wide Llama with a 70-token character vocabulary, m = 8 memory vectors, K = 2
gradient steps of alpha = 0.04, a separate WRITE head, AdamW (0.9, 0.999) at lr 1e-4 without
weight decay, 10,000 warmup steps then constant, 64 samples per step, fp32; outer loss = the
answer's cross-entropy + 0.5 x the last inner step's write loss. The curriculum over the number
of pairs runs one stage per call, each initialised from the last checkpoint of the one before
(the paper's GradMem starts at 32 pairs; its RMT baseline at 4):

    bash scripts/train.sh --module train_configs.gradmem --config gradmem_kv --dump_folder outputs/gradmem_kv_32
    bash scripts/train.sh --module train_configs.gradmem --config gradmem_kv --dump_folder outputs/gradmem_kv_64 \\
        --dataloader.pairs 64 --validator.dataloader.pairs 64 --training.seq_len 457 \\
        --checkpoint.initial_load_path $PWD/outputs/gradmem_kv_32/checkpoint/step-<N>

A row of n pairs takes 7 n + 9 tokens (`--training.seq_len`). The public runs train each stage
until validation exact match reaches 1 or stops improving (up to 1M steps); `steps` here is
that budget's cap. What the write loop cannot run under (compile, activation checkpointing)
is refused at preflight (torchtitan_ext/gradmem.py).
"""

import dataclasses

from torchtitan.components.optimizer import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import default_adamw
from torchtitan.trainer import Trainer

from models.grafts.graft import GraftConfig
from models.grafts.lora import LoRAConfig
from torchtitan_ext.gradmem import GradMemLoss, model_spec
from torchtitan_ext.kv_tokenizer import kv_tokenizer_dir
from torchtitan_ext.task_data import TaskDataLoader
from train_configs.backbone import LLAMA3_2_1B
from train_configs.recipe import debug_recipe, paper_recipe


def kv_row(pairs: int) -> int:
    """Input tokens of a KV-retrieval row: BOS, 7 characters a pair, `|`, the 5-character query, 2 value characters."""
    return 7 * pairs + 9


def _task_data(config: Trainer.Config, *, name: str, tasks: str, pairs: str, seq_len: int) -> Trainer.Config:
    """Rows of [context | query + answer] (loss on the answer), the GradMem loss, no AC."""
    config.dump_folder = f"./outputs/{name}"
    config.loss = GradMemLoss.Config()
    config.activation_checkpoint = None
    config.dataloader = TaskDataLoader.Config(tasks=tasks, pairs=pairs, split_context=True)
    config.validator = dataclasses.replace(config.validator, dataloader=TaskDataLoader.Config(
        tasks=tasks, pairs=pairs, split_context=True, validation=True, infinite=False, samples=64))
    config.training = dataclasses.replace(config.training, seq_len=seq_len)
    return config


def _kv(flavor: str, name: str, write: str, steps: int, pairs: int, **gradmem) -> Trainer.Config:
    spec = model_spec(flavor, gradmem={"write": write, **gradmem})
    config = _task_data(debug_recipe(spec, name=name, steps=steps), name=name, tasks="kv_retrieval", pairs=str(pairs),
                        seq_len=kv_row(pairs))
    config.hf_assets_path = str(kv_tokenizer_dir())
    return config


def _paper_kv(name: str, write: str, pairs: int, **gradmem) -> Trainer.Config:
    config = _kv("kv", name, write, 1_000_000, pairs, **gradmem)
    config.optimizer = default_adamw(lr=1e-4, weight_decay=0.0, betas=(0.9, 0.999))
    config.lr_scheduler = LRSchedulersContainer.Config(warmup_steps=10_000, decay_ratio=0.0)
    config.training = dataclasses.replace(config.training, local_batch_size=64, global_batch_size=64)
    config.validator = dataclasses.replace(config.validator, freq=500)
    config.checkpoint = dataclasses.replace(config.checkpoint, interval=500, keep_latest_k=2)
    config.metrics = dataclasses.replace(config.metrics, log_freq=50)
    return config


def gradmem_kv() -> Trainer.Config:
    """The paper's KV-retrieval GradMem (K = 2, alpha = 0.04, m = 8), the 32-pair stage (module docstring)."""
    return _paper_kv("gradmem_kv", "gradient", 32)


def gradmem_kv_forward() -> Trainer.Config:
    """The paper's forward-WRITE baseline (RMT, one forward write of [M; C; M]), the 4-pair stage."""
    return _paper_kv("gradmem_kv_forward", "forward", 4, write_steps=1)


def gradmem_kv_debug() -> Trainer.Config:
    """GradMem (K = 2) on 8-pair KV-retrieval at debug size, CPU, a minute."""
    return _kv("kv_debug", "gradmem_kv_debug", "gradient", 60, 8)


def gradmem_kv_forward_debug() -> Trainer.Config:
    """The forward-WRITE baseline of gradmem_kv_debug."""
    return _kv("kv_debug", "gradmem_kv_forward_debug", "forward", 60, 8, write_steps=1)


# Grafted on a pretrained backbone (appendix B's setting): the backbone frozen, LoRA on every
# block, the memory, its init and the write head trained, on the synthetic tasks with the
# context removed at read time. The tasks' queries follow their own BOS-less encoding.
GRAFT_TASKS = "kv_retrieval"


def gradmem_qwen3_debug_tasks() -> Trainer.Config:
    """GradMem (m = 8, K = 2, alpha 0.4: the paper's NLP default) on the debug Qwen3 + LoRA r8,
    KV-retrieval of 4 and 8 pairs (sentencepiece tokens); start it from a Hugging Face folder
    with --checkpoint.initial_load_in_hf --checkpoint.initial_load_path <folder>."""
    graft = GraftConfig(kind="lora", layers="all", lora=LoRAConfig(rank=8, alpha=16.0, dropout=0.0))
    spec = model_spec("qwen3_debug", graft=graft, gradmem={"inner_lr": 0.4})
    config = debug_recipe(spec, name="gradmem_qwen3_debug_tasks", lr=3e-3)
    return _task_data(config, name="gradmem_qwen3_debug_tasks", tasks=GRAFT_TASKS, pairs="4,8", seq_len=128)


def gradmem_llama3_2_1b_tasks() -> Trainer.Config:
    """GradMem (m = 32, K = 2, alpha 0.4) on Llama-3.2-1B from its Hugging Face folder + LoRA
    r16 on every block, KV-retrieval of 16 to 64 pairs, 16 per step, lr 1e-4, bf16."""
    graft = GraftConfig(kind="lora", layers="all", lora=LoRAConfig(rank=16, alpha=32.0, dropout=0.0))
    spec = model_spec("llama3_2_1b", graft=graft, gradmem={"n_mem": 32, "inner_lr": 0.4})
    config = paper_recipe(spec, name="gradmem_llama3_2_1b_tasks", lr=1e-4, local_batch_size=4)
    config.training = dataclasses.replace(config.training, global_batch_size=16, steps=20_000)
    config.compile = dataclasses.replace(config.compile, enable=False)
    config.hf_assets_path = LLAMA3_2_1B
    config.checkpoint = dataclasses.replace(config.checkpoint, initial_load_path=LLAMA3_2_1B, initial_load_in_hf=True)
    return _task_data(config, name="gradmem_llama3_2_1b_tasks", tasks=GRAFT_TASKS, pairs="16,32,64",
                      seq_len=1024)
