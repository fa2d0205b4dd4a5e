"""torchtitan 0.3.0 on the torch releases around it: 2.11 and 2.12 (clusters' and GPU images'
torch) besides the pinned 2.13. Each mend is applied only when the running torch lacks what
it stands in for, so on a torch that has it the mend switches itself off.

`apply()` runs when `torchtitan_ext` is imported (`torchtitan_ext/__init__.py`, and
`train_configs/__init__.py` imports that package first), so the names are in place before
torchtitan's modules bind them with `from torch... import ...`:

1. `torch.distributed.set_timeout` (torchtitan calls it after the first step; torch 2.13 has
   only the private `distributed_c10d._set_pg_timeout` it was made from): aliased.
2. `torch.distributed.fsdp.DataParallelMeshDims` (new in torch 2.13; torchtitan imports it at
   module level in `distributed/fsdp.py` and `full_dtensor.py`, but hands it to `fully_shard`
   only under `--parallelism.spmd_backend full_dtensor` / `spmd_types`): a stand-in whose
   construction stops with one line naming `partial_dtensor`, the backend our recipes use.
3. FSDP2 groups of several modules (`fully_shard([norm, lm_head])`, the tied
   `[tok_embeddings, norm, lm_head]`): before torch 2.13 a group's post-forward (reshard,
   and the hook that all-gathers again before backward) fires only once *every* module of
   the group has run. torchtitan's ChunkedLossWrapper runs the decoder with `_skip_lm_head`
   and drives `lm_head` itself afterwards, so `norm`'s backward read a freed weight
   (SIGSEGV on CPU, an illegal access or wrong gradients on a GPU), and a tied group was left
   half-finished (the validator's next forward: "mixed torch.Tensor and DTensor"). torch
   2.13 completes unfinished groups from the root's post-forward
   (`FSDPState._force_complete_incomplete_states`); where that is missing, `fully_shard`
   given a list shards each module that shares no parameter with another on its own, and
   leaves modules that share parameters (tied weights) to the enclosing `fully_shard(model)`
   that torchtitan always applies last: the root group is never resharded after forward, so
   the tied weight stays gathered until the root's post-backward, exactly as torchtitan's
   tied group (`reshard_after_forward=False`) keeps it. Numerics are unchanged; only the
   grouping of all-gathers differs.
4. `create_block_mask(..., separate_full_blocks=...)` (the keyword is new in torch 2.13;
   torchtitan's decoders pass `separate_full_blocks=not is_in_batch_invariant_mode()` when
   they build flex-attention masks, a GPU-only path, so CPU runs never meet it): the keyword
   is dropped when True, which is what older torch always does (full blocks kept apart so the
   kernel skips their mask_mod); False (batch-invariant mode) stops with one line asking for
   torch >= 2.13. Found on the H100 lease of 2026-11-26 (torch 2.11.0+cu130): transformer_400m
   failed at its first mask with "unexpected keyword argument 'separate_full_blocks'".
5. torchtitan 0.3.0 captures each eager training step in a CUDA graph (on unless
   `--training.disable_cuda_graphs`) and requires the flattened structure of the step's
   flex-attention BlockMasks to stay the same across steps. torch 2.13 flattens a mask_mod's
   captured tensors (the documents of the batch) out of that structure; older torch keeps
   the closure itself, new at every step, so step 2 stopped with "CUDA graph BlockMask
   structure must remain constant across training steps" (same lease, transformer_400m). The
   launcher (`training/train.py`) adds `--training.disable_cuda_graphs` where
   `cuda_graph_args` says so: a model with flex attention on a torch whose masks do not
   flatten alike (`block_masks_flatten_alike`). Not a name to bind, so not part of `apply()`.
   Titans' MAC / MAG / MAL use flex attention too, but build their masks inside the step
   (MAC once per segment length, `models.layers.attention.flex_block_mask`), so no mask is a
   step input and their CUDA graphs stay on (tests/test_torch_compat.py).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

import torch
from torch import nn

OLDEST_TORCH = (2, 11)  # the oldest torch these mends make work; older stops at the launcher's check


def torch_version() -> tuple[int, int]:
    """(major, minor) of the running torch."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


MESH_DIMS_MESSAGE = (
    "torch {version} has no DataParallelMeshDims (torch >= 2.13), which torchtitan's spmd_backend "
    "'full_dtensor' / 'spmd_types' needs: pass --parallelism.spmd_backend partial_dtensor"
)


class DataParallelMeshDimsStandIn:
    """Stand-in for torch 2.13's `torch.distributed.fsdp.DataParallelMeshDims` on older torch:
    importable (torchtitan imports the name at module level), not constructible."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(MESH_DIMS_MESSAGE.format(version=torch.__version__))


def groups_complete_from_root() -> bool:
    """Whether this torch's FSDP2 finishes a module group whose modules did not all run
    forward (torch >= 2.13)."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    return hasattr(FSDPState, "_force_complete_incomplete_states")


def split_by_shared_parameters(modules: Sequence[nn.Module]) -> list[list[nn.Module]]:
    """`modules` partitioned so that modules holding one parameter object (tied weights),
    directly or through a chain of such modules, land in one part; parts in the order of
    their first module."""
    parts: list[tuple[list[nn.Module], set[int]]] = []  # (modules, ids of their parameters)
    for module in modules:
        ids = {id(p) for p in module.parameters()}
        hits = [i for i, (_, part_ids) in enumerate(parts) if part_ids & ids]
        if not hits:
            parts.append(([module], ids))
            continue
        members, member_ids = parts[hits[0]]
        for i in hits[1:]:
            members.extend(parts[i][0])
            member_ids |= parts[i][1]
        members.append(module)
        member_ids |= ids
        parts = [part for i, part in enumerate(parts) if i not in hits[1:]]
    return [members for members, _ in parts]


def fully_shard_untied_apart(fully_shard: Callable) -> Callable:
    """`fully_shard` that, given a list of modules, shards each part of
    `split_by_shared_parameters` that is one module on its own and leaves parts of several
    (tied weights) to the enclosing `fully_shard(model)` (mend 3 of the module docstring).
    A single module goes straight through. Returns what `fully_shard` returns for a single
    module (`modules` itself for a list, as torch does)."""

    @functools.wraps(fully_shard)
    def wrapper(module, *args, **kwargs):
        if isinstance(module, nn.Module):
            return fully_shard(module, *args, **kwargs)
        for part in split_by_shared_parameters(list(module)):
            if len(part) == 1:
                fully_shard(part[0], *args, **kwargs)
        return module

    wrapper.untied_apart = True
    return wrapper


def create_block_mask_without_separate_full_blocks(create_block_mask: Callable) -> Callable:
    """`create_block_mask` taking torch 2.13's `separate_full_blocks` keyword on a torch
    without it (mend 4 of the module docstring)."""

    @functools.wraps(create_block_mask)
    def wrapper(*args, separate_full_blocks: bool = True, **kwargs):
        if not separate_full_blocks:
            raise RuntimeError(f"torch {torch.__version__} cannot build a flex-attention mask without separate full "
                               "blocks (torchtitan's batch-invariant mode): use torch >= 2.13")
        return create_block_mask(*args, **kwargs)

    wrapper.drops_separate_full_blocks = True
    return wrapper


def block_masks_flatten_alike() -> bool:
    """Whether two BlockMasks of one structure whose mask_mods capture different tensors (the
    documents of two batches) flatten to the same context, as torchtitan's CUDA-graph step
    needs across steps (torch >= 2.13). Checked on two small CPU masks."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document(documents: torch.Tensor):
        return lambda b, h, q, kv: documents[q] == documents[kv]

    masks = [create_block_mask(same_document(torch.zeros(128, dtype=torch.long)), None, None, 128, 128, device="cpu")
             for _ in range(2)]
    try:
        return bool(masks[0]._flatten()[1] == masks[1]._flatten()[1])
    except (RuntimeError, AttributeError):  # older torch compares the captured tensors (or has no
        return False  # _flatten, which torchtitan's CUDA-graph step needs): never alike


def cuda_graph_args(config) -> list[str]:
    """["--training.disable_cuda_graphs"] when a run of `config` (a parsed Trainer config)
    would capture flex-attention masks this torch cannot replay across steps (mend 5 of the
    module docstring), else []."""
    if config.training.disable_cuda_graphs:
        return []
    from torchtitan.models.common.attention import FlexAttention

    if not any(config.model_spec.model.traverse(FlexAttention.Config)) or block_masks_flatten_alike():
        return []
    return ["--training.disable_cuda_graphs"]


def apply() -> list[str]:
    """Apply the mends this torch needs (idempotent). Returns the names of those applied; none
    below `OLDEST_TORCH`, whose modules may lack what the mends patch (the launcher's check
    then names the torch in one line)."""
    if torch_version() < OLDEST_TORCH:
        return []
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp

    applied = []
    if dist.is_available() and not hasattr(dist, "set_timeout"):
        from torch.distributed import distributed_c10d

        dist.set_timeout = distributed_c10d._set_pg_timeout
        applied.append("set_timeout")
    if not hasattr(fsdp, "DataParallelMeshDims"):
        fsdp.DataParallelMeshDims = DataParallelMeshDimsStandIn
        applied.append("DataParallelMeshDims")
    if not groups_complete_from_root() and not getattr(fsdp.fully_shard, "untied_apart", False):
        fsdp.fully_shard = fully_shard_untied_apart(fsdp.fully_shard)
        applied.append("fully_shard_untied_apart")
    from torch.nn.attention import flex_attention

    mask_builder = flex_attention.create_block_mask
    if not getattr(mask_builder, "drops_separate_full_blocks", False) and \
            "separate_full_blocks" not in inspect.signature(mask_builder).parameters:
        flex_attention.create_block_mask = create_block_mask_without_separate_full_blocks(mask_builder)
        applied.append("create_block_mask_without_separate_full_blocks")
    return applied
