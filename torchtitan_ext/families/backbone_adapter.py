"""torchtitan's StateDictAdapter for the backbone family and the grafts on it (so
`--checkpoint.initial_load_in_hf` and the exporter work): keys renamed by
`backbone.to_hf_keys` / `from_hf_keys`, nothing permuted. A module of its own so that the
backbone and GradMem families' plain models build where torchtitan cannot be imported
(scripts/bench_models.py on an image whose torch is older than the pin); the families name it
as "torchtitan_ext.families.backbone_adapter:HFBackboneAdapter" (`Family.adapter_class`).
"""

from __future__ import annotations

from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from torchtitan_ext.families.backbone import from_hf_keys, to_hf_keys


class HFBackboneAdapter(StateDictAdapter):
    """torchtitan StateDictAdapter: our keys <-> Hugging Face Llama / Qwen2 / Qwen3 keys (graft weights
    left out: an initial load from a Hugging Face folder leaves them at their init; a grafted
    backbone's own export is remote code, read through `hf_export.hf_form`)."""

    def _tied(self) -> bool:
        return bool(self.model_config.model.tie_embeddings)

    def to_hf(self, state_dict):
        return to_hf_keys(state_dict, self._tied())

    def from_hf(self, hf_state_dict):
        return from_hf_keys(hf_state_dict, self._tied())
