"""Plug a plain-`nn.Module` decoder from `models/` into torchtitan's Trainer.

The pattern every project model follows (torchtitan's transformers backend does the
same for Hugging Face models):
- the torchtitan model class inherits from `BaseModel` and the plain model, so
  checkpoint keys are exactly the plain model's (no wrapper prefix);
- `verify_module_protocol` is a no-op (the submodules are plain `nn.Module`s);
- `init_states` re-runs the plain model's `reset_parameters` (weights are
  re-materialised after FSDP wrapping, so tying is redone there);
- parallelism reuses torchtitan's own AC, per-block compile and FSDP2 helpers, which
  need only `tok_embeddings`, `layers`, `norm`, `lm_head`, `enable_weight_tying`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch
from torchtitan.models.llama3 import parallelize_llama
from torchtitan.protocols import BaseModel
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from torchtitan_ext.errors import UserError


@functools.cache
def torchtitan_model(plain_cls: type, plain_config_cls: type, flops_per_token=None) -> type:
    """The torchtitan model class for a plain decoder class and its config dataclass.

    The plain config needs `vocab_size` and `max_seq_len`. FLOPs per token (for MFU):
    `flops_per_token(plain config, seq_len)`, the family's count of what runs (a memory's
    update work, Mela's recursion at patch rate; `Family.flops_per_token`), or torchtitan's
    dense 6 x parameters where it is None.
    """

    class TorchtitanModel(BaseModel, plain_cls):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseModel.Config):
            model: plain_config_cls = field(default_factory=plain_config_cls)

            @property
            def vocab_size(self) -> int:
                return self.model.vocab_size

            @property
            def max_seq_len(self) -> int:
                return self.model.max_seq_len

            def update_from_config(self, *, config, **kwargs) -> None:
                check_seq_len(config)

            def get_nparams_and_flops(self, model, seq_len: int) -> tuple[int, int]:
                n_params = sum(p.numel() for p in model.parameters())
                return n_params, flops_per_token(self.model, seq_len) if flops_per_token else 6.0 * n_params

        def __init__(self, config):
            plain_cls.__init__(self, config.model)

        def verify_module_protocol(self) -> None:
            pass  # plain nn.Modules by design

        def init_states(self, *, buffer_device: torch.device | None = None) -> None:
            self.reset_parameters()

    TorchtitanModel.__name__ = TorchtitanModel.__qualname__ = f"Torchtitan{plain_cls.__name__}"
    return TorchtitanModel


def check_seq_len(config) -> None:
    """UserError unless the trainer config's training.seq_len fits the model: at most its
    max_seq_len, at least the shortest length whose memory writes reach the loss."""
    model = config.model_spec.model
    seq_len = config.training.seq_len
    if seq_len > model.max_seq_len:
        raise UserError(
            f"training.seq_len {seq_len} exceeds the model's max_seq_len {model.max_seq_len}: "
            f"pass --training.seq_len {model.max_seq_len} or less"
        )
    shortest = getattr(getattr(model, "model", None), "min_trainable_seq_len", 1)
    if seq_len < shortest:
        raise UserError(
            f"training.seq_len {seq_len} is too short for the memory's writes to reach the loss "
            f"(they are read by later chunks only): pass --training.seq_len {shortest} or more"
        )


def plain_model_spec(name: str, flavor: str, model_cls: type, plain_config, state_dict_adapter: type | None = None) -> ModelSpec:
    """ModelSpec for a plain model; the config is copied (callers may edit theirs).
    `state_dict_adapter` (default `WrapperStateDictAdapter`) maps to Hugging Face keys."""
    return ModelSpec(
        name=name,
        flavor=flavor,
        model=model_cls.Config(model=dataclasses.replace(plain_config)),
        parallelize_fn=parallelize_plain_decoder,
        pipelining_fn=None,
        post_optimizer_build_fn=None,
        state_dict_adapter=state_dict_adapter or WrapperStateDictAdapter,
    )


def parallelize_plain_decoder(model, *, parallel_dims, training, parallelism, compile_config, ac_config, dump_folder):
    """AC -> per-block compile -> FSDP2 (data parallel over any number of ranks/nodes)."""
    unsupported = [
        name for name, on in (
            ("tensor parallel", parallel_dims.tp_enabled),
            ("context parallel", parallel_dims.cp_enabled),
            ("pipeline parallel", parallel_dims.pp_enabled),
        ) if on
    ]
    if unsupported:
        raise UserError(f"{', '.join(unsupported)} is not supported for this model: use data parallelism (FSDP2) only")
    if parallelism.spmd_backend != "partial_dtensor":
        raise UserError(
            f"parallelism.spmd_backend '{parallelism.spmd_backend}' needs torchtitan's own modules: "
            "pass --parallelism.spmd_backend partial_dtensor"
        )
    return parallelize_llama(
        model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
        compile_config=compile_config, ac_config=ac_config, dump_folder=dump_folder,
    )


class WrapperStateDictAdapter(StateDictAdapter):
    """HF keys = `model.` + the plain model's keys: the layout of the Hugging Face export
    (`torchtitan_ext/hf_export.py`), whose wrapper holds the plain model as `model`. A tied
    `lm_head.weight` is dropped on export (safetensors refuses shared tensors) and
    re-linked on import."""

    PREFIX = "model."

    def _tied(self) -> bool:
        return bool(getattr(self.model_config.model, "tie_embeddings", False))

    def to_hf(self, state_dict):
        return {self.PREFIX + k: v for k, v in state_dict.items() if not (self._tied() and k == "lm_head.weight")}

    def from_hf(self, hf_state_dict):
        state = {k.removeprefix(self.PREFIX): v for k, v in hf_state_dict.items()}
        if self._tied() and "tok_embeddings.weight" in state:
            state["lm_head.weight"] = state["tok_embeddings.weight"]
        return state
