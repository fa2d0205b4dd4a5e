"""The GradMem family (`models/grafts/gradmem.py`): flavors and the checks a run must pass (its
outer loss: torchtitan_ext/families/gradmem_loss.py (its KV-retrieval scoring: torchtitan_ext/eval/gradmem_kv.py; its FLOP count: the "gradmem"
row of `models/grafts/graft.py`'s `GRAFT_KINDS`, `models/memory/gradmem.py`'s `gradmem_flops`).

Flavors:

| flavor | what | shape | params |
| --- | --- | --- | --- |
| kv | the paper's KV-retrieval model (appendix C, Table 4; the public code's Llama config) | Llama, 4 layers, 4 heads (head_dim 32), dim 128, FFN 512, tied, 70-token character vocabulary, m = 8 | 0.79M + 8.9K write head |
| kv_debug | CPU debug size | 2 layers, dim 64, FFN 256 | 0.11M |
| qwen3_debug, llama3_2_1b, qwen3_0_6b | grafted on the pretrained backbones (`torchtitan_ext/families/backbone.py`) | theirs | theirs + m x dim + the write head |

What the second-order write supports (`check_config`, exit 2 at preflight otherwise):
- Data parallelism: DDP, not FSDP2 (`parallelize_gradmem`); 1 vs 2 processes from one seed
  agree (tests/test_gradmem.py).
- torch.compile: no. AOTAutograd has no double backward, and the write differentiates
  the blocks' backward; `--compile.enable` is refused.
- Activation checkpointing: no. torchtitan's checkpoint wrappers recompute a block in the
  outer backward, but the inner gradient (create_graph) holds references into the block's
  saved tensors that the recomputation does not restore; `activation-checkpoint:none`.
- Rows must be [context | query] documents: `--dataloader.split_context` (the configs set it).
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

from models.grafts.gradmem import GradMemLM, GradMemLMConfig
from models.grafts.graft import GRAFT_KINDS
from models.memory.gradmem import gradmem_diagnostics
from torchtitan_ext.errors import UserError
from torchtitan_ext.families import backbone, Family

# The public KV scripts' model: Llama-3.2-1B's config with 4 layers, 4 heads, width 128, FFN 4 x 128, so
# theta 500,000 and Llama 3's RoPE scaling come with it (the paper names only "a 4-layer Llama").
KV = dict(vocab_size=70, dim=128, n_layers=4, n_heads=4, n_kv_heads=4, ffn_hidden=512, tie_embeddings=True,
          rope_scaling=backbone.LLAMA3_2_ROPE, max_seq_len=1024)  # 96 pairs take 681 tokens
FLAVORS = {
    "kv": KV,
    "kv_debug": dict(KV, dim=64, n_layers=2, ffn_hidden=256),
    **{name: dict(backbone.FLAVORS[name], train_backbone=False) for name in ("qwen3_debug", "llama3_2_1b", "qwen3_0_6b")},
}
def check_config(config) -> None:
    """UserError for what the second-order write cannot run under (module docstring)."""
    from torchtitan_ext.data.kv_tokenizer import build, kv_tokenizer_dir
    from torchtitan_ext.families.gradmem_loss import GradMemLoss

    if config.compile.enable:
        raise UserError("GradMem's write differentiates the model's backward, which torch.compile cannot "
                        "(no double backward): drop --compile.enable")
    if config.activation_checkpoint is not None:
        raise UserError("GradMem's second-order write does not survive activation checkpointing's recomputation: "
                        "pass activation-checkpoint:none")
    for name, loader in (("dataloader", config.dataloader), ("validator.dataloader", config.validator.dataloader)):
        if not getattr(loader, "split_context", False):
            raise UserError(f"GradMem reads rows of [context | query]: use the task data with --{name}.split_context")
    if type(config.loss) is not GradMemLoss.Config:
        raise UserError("GradMem's model returns (hidden states, write loss): use the loss GradMemLoss.Config")
    model = config.model_spec.model.model
    seq_len = config.training.seq_len
    if seq_len + model.gradmem.n_mem > model.max_seq_len:
        raise UserError(f"a row of {seq_len} tokens after {model.gradmem.n_mem} memory vectors exceeds the model's "
                        f"max_seq_len {model.max_seq_len}: pass --training.seq_len "
                        f"{model.max_seq_len - model.gradmem.n_mem} or less")
    if Path(config.hf_assets_path).resolve() == kv_tokenizer_dir().resolve():
        build()  # the character tokenizer: written on first use
    loader = config.dataloader
    if loader.pairs:  # the largest sample must fit a row
        from torchtitan_ext.data.task_data import encode_sample
        from torchtitan_ext.data.tokenizer import AssetsTokenizer

        tokenizer = AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=config.hf_assets_path)
        pairs = max(int(n) for n in loader.pairs.split(","))
        encode_sample("kv_retrieval", random.Random(0), tokenizer, seq_len + 1, True, pairs)


def _sum_gradients(_state, bucket):
    """DDP comm hook: gradients summed over ranks (torchtitan divides the loss by the global
    token count itself, as its FSDP2 does with a gradient divide factor of 1)."""
    import torch.distributed as dist

    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])


def parallelize_gradmem(model, *, parallel_dims, training, parallelism, compile_config, ac_config, dump_folder):
    """Data parallelism by DDP (torch's composable `replicate`, static graph: the chunked loss
    and the write both reach the LM head, gradients summed over ranks);
    FSDP2 is not used: its backward hooks fire inside the write's inner autograd.grad and the
    process dies (segmentation fault, torch 2.13; tests/test_gradmem.py). Compile and AC are
    refused at preflight (`check_config`); tensor / context / pipeline parallelism here."""
    unsupported = [name for name, on in (("tensor parallel", parallel_dims.tp_enabled),
                                         ("context parallel", parallel_dims.cp_enabled),
                                         ("pipeline parallel", parallel_dims.pp_enabled)) if on]
    if unsupported:
        raise UserError(f"{', '.join(unsupported)} is not supported for GradMem: use data parallelism only")
    if parallel_dims.dp_enabled:
        from torch.distributed._composable import replicate

        replicate(model, device_mesh=parallel_dims.get_mesh("fsdp"), static_graph=True)
        model.register_comm_hook(None, _sum_gradients)
    return model


def gradmem_spec(flavor: str, **overrides):
    """The family's ModelSpec: the plain-model spec with `parallelize_gradmem`."""
    from torchtitan_ext.families.plain_model import plain_model_spec, torchtitan_model

    spec = plain_model_spec("gradmem", flavor, torchtitan_model(GradMemLM, GradMemLMConfig, FAMILY.flops_per_token),
                            FAMILY.config(flavor, **overrides), backbone.FAMILY.adapter_class())
    return dataclasses.replace(spec, parallelize_fn=parallelize_gradmem)


FAMILY = Family(name="gradmem", summary="GradMem: a prefix memory written by test-time gradient descent (from "
                "scratch on KV-retrieval, or grafted on a pretrained Llama / Qwen3)", flavors=FLAVORS,
                config_class=GradMemLMConfig, plain_class=GradMemLM, build_spec=gradmem_spec,
                state_dict_adapter=backbone.ADAPTER,
                check_hf_folder=backbone.FAMILY.check_hf_folder, check_config=check_config,
                diagnostics=gradmem_diagnostics, flops_per_token=GRAFT_KINDS["gradmem"].flops)
model_config, model_spec = FAMILY.config, FAMILY.model_spec
