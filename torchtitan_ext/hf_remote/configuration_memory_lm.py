"""Hugging Face config of an exported project model (shipped with the export, remote code).

`family` names the model class (mlp_lm, titans, mela); `model` holds its config dataclass
as a dict (nested dataclasses as dicts)."""

from transformers import PretrainedConfig


class MemoryLMConfig(PretrainedConfig):
    model_type = "memory_lm"

    def __init__(self, family: str = "mela", model: dict | None = None, **kwargs):
        self.family = family
        self.model = dict(model or {})
        super().__init__(**kwargs)
