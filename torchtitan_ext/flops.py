"""The FLOP counts behind MFU (torchtitan's `get_nparams_and_flops`): each family's own count
lives beside its registry entry, as `flops_per_token(config, seq_len)` in
`torchtitan_ext/families/<family>.py` (e.g. `torchtitan_ext.families.titans.flops_per_token`);
the torchtitan model class (`families/plain_model.py`) calls it, or counts 6 x parameters where a
family has none. A graft kind's count lives beside its model code, in the FLOP column of
`models/grafts/graft.py`'s `GRAFT_KINDS`.

torchtitan's dense estimate (6N + attention) fits a Transformer, not a memory model: Mela's
HMM runs at patch rate through H*L + H module steps (the first H-1 cycles forward only), and
a neural memory spends per chunk on MLP reads, explicit gradients and Newton-Schulz what its
parameter count does not show. The per-product primitives and their conventions (matmul
FLOPs per token, x3 with gradients, x1 forward only) are `models/layers/flops.py`'s, named
here for the families; this module adds the SDPA mapping FlopCounterMode needs on CPU.
tests/test_flops.py checks each count against torch's FlopCounterMode over a training step.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from models.layers.flops import (attention_span, decoder_block_linears, FORWARD_AND_INPUT_GRAD, FORWARD_ONLY, linear,
                                 lora, memory_mlp, neural_memory, newton_schulz, TRAIN)

__all__ = ["attention_span", "CPU_ATTENTION_FLOPS", "decoder_block_linears", "FORWARD_AND_INPUT_GRAD", "FORWARD_ONLY",
           "linear", "lora", "memory_mlp", "neural_memory", "newton_schulz", "TRAIN"]

# FlopCounterMode's `custom_mapping` for the CPU attention kernel, which it does not count by itself.
CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda grad, q, k, v, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(grad, q, k, v),
}
