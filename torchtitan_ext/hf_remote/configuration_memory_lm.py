"""Hugging Face config of an exported project model (shipped with the export, remote code).

`family` names the model class (mlp_lm, titans, mela); `model` holds its config dataclass
as a dict (nested dataclasses as dicts). The usual top-level fields that tools built on
transformers read (`vocab_size`, `hidden_size`, `num_hidden_layers`, `num_attention_heads`,
`max_position_embeddings`) are copied from it."""

from transformers import PretrainedConfig

# Hugging Face field -> field of the project's config dataclasses
STANDARD_FIELDS = {"vocab_size": "vocab_size", "hidden_size": "dim", "num_hidden_layers": "n_layers",
                   "num_attention_heads": "n_heads", "max_position_embeddings": "max_seq_len"}


class MemoryLMConfig(PretrainedConfig):
    model_type = "memory_lm"

    def __init__(self, family: str = "mela", model: dict | None = None, **kwargs):
        self.family = family
        self.model = dict(model or {})
        for hf_name, name in STANDARD_FIELDS.items():
            if name in self.model:
                kwargs[hf_name] = self.model[name]
        super().__init__(**kwargs)
        for hf_name, name in STANDARD_FIELDS.items():
            if name in self.model:
                setattr(self, hf_name, self.model[name])
