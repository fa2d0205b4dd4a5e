"""One memory config, one owner: a model that sets fields of its nested NeuralMemoryConfig
fills only the fields left unset and refuses a conflicting explicit value."""

from __future__ import annotations

import dataclasses

import pytest

from models.lms.mela import Mela, MelaConfig, mela_memory
from models.lms.titans import TitansConfig, TitansLM
from models.memory.neural_memory import NeuralMemoryConfig

TITANS = dict(vocab_size=64, dim=32, n_layers=1, n_heads=2, window=8)
MELA = dict(vocab_size=64, dim=32, n_layers=2, n_heads=2, memory_heads=2, patch_size=2, chunk_size=2)


def test_titans_fills_the_memory_width_and_keeps_the_memory_own_options():
    cfg = TitansConfig(**TITANS, memory=NeuralMemoryConfig(chunk_size=4, expansion=2))
    built = TitansLM(cfg).layers["0"].memory.cfg
    assert (built.dim, built.n_heads, built.head_dim) == (32, 2, 16)
    assert (built.chunk_size, built.expansion) == (4, 2)
    assert cfg.memory.dim is None  # the stored config keeps the field unset


def test_titans_refuses_a_conflicting_memory_width_and_accepts_the_same_one():
    with pytest.raises(ValueError, match=r"memory.dim = 48 conflicts with TitansConfig's 32"):
        TitansConfig(**TITANS, memory=NeuralMemoryConfig(dim=48))
    assert TitansConfig(**TITANS, memory=NeuralMemoryConfig(dim=32)).block_memory.dim == 32


def test_a_rebuilt_config_with_a_new_width_gives_its_memory_the_new_width():
    """A config rebuilt from an existing one's fields (as tyro and `dataclasses.replace` do)
    carries the unset memory fields, so the new width wins instead of a stale filled one."""
    wide = dataclasses.replace(TitansConfig(**TITANS), dim=64, n_heads=4)
    assert (wide.block_memory.dim, wide.block_memory.head_dim) == (64, 16)
    mela = dataclasses.replace(MelaConfig(**MELA), chunk_size=4, memory_step_scale=0.5)
    assert (mela.block_memory.chunk_size, mela.block_memory.step_scale) == (4, 0.5)


def test_mela_sets_chunk_step_and_read_order_and_refuses_a_conflicting_one():
    cfg = MelaConfig(**MELA, memory=mela_memory(expansion=2), memory_step_scale=0.25)
    built = Mela(cfg).hmm.l_module.blocks[0].memory.cfg
    assert (built.chunk_size, built.step_scale, built.newton_schulz_steps, built.read_after_write) == (2, 0.25, 5, True)
    with pytest.raises(ValueError, match=r"memory.chunk_size = 8 conflicts with MelaConfig's 2"):
        MelaConfig(**MELA, memory=mela_memory(chunk_size=8))


def test_a_memory_built_alone_must_be_given_its_width():
    from models.memory.neural_memory import NeuralMemory

    with pytest.raises(ValueError, match=r"\['dim', 'n_heads', 'head_dim'\] are unset"):
        NeuralMemory(NeuralMemoryConfig())
