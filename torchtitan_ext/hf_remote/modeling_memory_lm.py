"""Hugging Face wrapper of an exported project model (shipped with the export, remote code).

The export writes `family.py` (`PlainModel`, `PlainConfig`, `NESTED`: the family's model
class, its config dataclass and the config fields that are dataclasses) next to the model
code copied from the project's `models/` and `kernels/`. This wrapper adds what
`transformers` expects: `from_pretrained` / `save_pretrained`, a loss, and `generate()`.

Generation with memory: models with a `stream(tokens, state)` method (Mela, Titans) carry
their memory state from one generation step to the next: the state at the last stream
boundary (`cfg.stream_segment`: a Mela chunk, a MAC window, any token for MAG/MAL/LMM) and
the logits before it are kept, and each step reads only the tokens after that boundary
(exactly the one-pass logits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_memory_lm import MemoryLMConfig
from .family import NESTED, PlainConfig, PlainModel


def plain_config(fields: dict):
    """The model's config dataclass from its dict form."""
    fields = dict(fields)
    for name, cls in NESTED.items():
        if isinstance(fields.get(name), dict):
            fields[name] = cls(**fields[name])
    return PlainConfig(**fields)


class MemoryLMForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MemoryLMConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    # Applies when config.tie_word_embeddings is set (the exporter sets it from the model's config).
    _tied_weights_keys = {"model.lm_head.weight": "model.tok_embeddings.weight"}

    def __init__(self, config: MemoryLMConfig):
        super().__init__(config)
        self.model = PlainModel(plain_config(config.model))
        self._stream_cache = None  # (token prefix, memory state after it, logits of the prefix)
        self.post_init()

    def _init_weights(self, module):
        """Weights come from the checkpoint; the plain model initialises itself."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' load, then the plain model's buffers that checkpoints do not hold
        (`reset_buffers`, e.g. the backbone's RoPE frequencies: a load materialises them empty)."""
        model = super().from_pretrained(*args, **kwargs)
        if hasattr(model.model, "reset_buffers"):
            model.model.reset_buffers()
        return model

    def get_input_embeddings(self):
        return self.model.tok_embeddings

    def get_output_embeddings(self):
        return self.model.lm_head

    def _streamed_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits of input_ids (B, T), continuing from the cached chunk boundary when the
        cache holds a prefix of input_ids."""
        span = self.model.cfg.stream_segment
        prefix, state, logits = self._stream_cache or (input_ids[:, :0], None, None)
        start = prefix.shape[1]
        if start > input_ids.shape[1] or not torch.equal(input_ids[:, :start], prefix):
            start, state, logits = 0, None, None
        boundary = input_ids.shape[1] // span * span
        if boundary > start:
            new, state = self.model.stream(input_ids[:, start:boundary], state)
            logits = new if logits is None else torch.cat([logits, new], 1)
            start = boundary
            self._stream_cache = (input_ids[:, :boundary], state, logits)
        if start == input_ids.shape[1]:
            return logits
        tail, _ = self.model.stream(input_ids[:, start:], state)
        return tail if logits is None else torch.cat([logits, tail], 1)

    def forward(self, input_ids: torch.Tensor, attention_mask=None, labels: torch.Tensor | None = None, **kwargs):
        """input_ids (B, T) -> logits (B, T, vocab); loss when labels are given (shifted
        inside, -100 ignored). `attention_mask` must be all ones: rows are not padded."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("padded batches are not supported: pass rows of equal length without padding")
        if hasattr(self.model, "stream") and not torch.is_grad_enabled() and not self.training:
            logits = self._streamed_logits(input_ids)
        else:
            logits = self.model(input_ids)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        """No key/value cache: generation state lives in the memory (see the module docstring)."""
        return False

    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        return {"input_ids": input_ids}
