"""The precondition for capturing a training step in a CUDA graph: every memory family's
step (forward and backward) compiles with fullgraph=True on the whole-sequence path, the
memory kernels opaque custom ops in the graphs (kernels/whole_sequence.py). On the meta
device (shapes only: dynamo and AOT autograd trace exactly what they would on a GPU), at
debug width with the papers' ratios: Titans' T = 8 segments of 8 memory chunks (paper: 4096 /
512 / 64), Mela's T = 2 decoder chunks of P*C tokens (paper: 4096 = 2 x 2048); the block grafts
(MemoryLlama on its neural memory, MoNe) on a Qwen3-shaped backbone, 8 memory chunks or segments. GradMem
is left out: its write differentiates the model's backward, which torch.compile cannot (its
family refuses compile); Locas writes at test time only (no training step)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from compile_checks import cache_checked

from models.backbones.decoder_lm import DecoderLM, DecoderLMConfig
from models.grafts.graft import GraftConfig
from models.lms.mela import Mela
from models.lms.titans import TitansConfig, TitansLM, VARIANTS
from models.memory.neural_memory import NeuralMemory, NeuralMemoryConfig, use_whole_sequence
from torchtitan_ext.families import family_and_overrides


def titans(variant: str) -> tuple[torch.nn.Module, int]:
    chunk = 4
    cfg = TitansConfig(variant=variant, vocab_size=64, dim=32, n_layers=1, n_heads=2, window=8 * chunk, n_persistent=2,
                       memory=NeuralMemoryConfig(chunk_size=chunk, expansion=2))
    return TitansLM(cfg), 8 * cfg.window


def mela() -> tuple[torch.nn.Module, int]:
    cfg = family_and_overrides("mela")[0].config("debug")
    return Mela(cfg), 2 * cfg.chunk_tokens


def graft(kind: str) -> tuple[torch.nn.Module, int]:
    chunk = 16
    memory = {"chunk_size": chunk} if kind == "memoryllama" else {"segment": chunk}
    cfg = DecoderLMConfig(architecture="qwen3", vocab_size=64, dim=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=24,
                          ffn_hidden=96, qk_norm=True, graft=GraftConfig(kind=kind, layers="all", memory=memory))
    return DecoderLM(cfg), 8 * chunk


MODELS = {**{f"titans_{v}": (lambda v=v: titans(v)) for v in VARIANTS}, "mela": mela,
          **{kind: (lambda kind=kind: graft(kind)) for kind in ("memoryllama", "mone")}}


def recording_backend(ops: dict[str, set], refusals: list[str]):
    """AOT autograd whose forward and backward graphs run as traced, their ops noted in `ops`,
    and what AOTAutograd's cache would refuse in the Dynamo graph in `refusals` (`cache_checked`)."""

    def compiler(phase: str):
        def compile_graph(gm: torch.fx.GraphModule, example_inputs):
            ops[phase] |= {str(node.target) for node in gm.graph.nodes if node.op == "call_function"}
            return make_boxed_func(gm.forward)

        return compile_graph

    return cache_checked(aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward")), refusals)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_training_step_compiles_as_one_graph_on_the_whole_sequence_path(name):
    torch.manual_seed(0)
    with torch.device("meta"):
        model, length = MODELS[name]()
    memories = use_whole_sequence(model)
    assert memories == sum(isinstance(m, NeuralMemory) for m in model.modules())
    assert (memories > 0) == (name != "mone")  # MoNe's memory is its own (models/grafts/mone.py)
    tokens = torch.randint(0, 64, (2, length), device="meta")
    ops, refusals = {"forward": set(), "backward": set()}, []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=recording_backend(ops, refusals), fullgraph=True)
    logits = compiled(tokens)
    F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()
    kernels = {"memory_kernels.whole_sequence_fwd.default", "memory_kernels.whole_sequence_bwd.default"}
    assert (kernels <= ops["forward"] | ops["backward"]) == (memories > 0)
    assert "memory_kernels.whole_sequence_bwd.default" not in ops["forward"]
    # every memory prepares its kernel inputs in one op (kernels/memory_inputs.py): Mela's and MemoryLlama's
    # chunk rule without conv, and Titans' per-token rule after its conv
    rules = {(m.cfg.gates, bool(m.cfg.conv_kernel)) for m in model.modules() if isinstance(m, NeuralMemory)}
    assert rules == ({("token", True)} if name.startswith("titans") else {("chunk", False)} if memories else set())
    assert ("memory_inputs.chunk_inputs.default" in ops["forward"]) == (memories > 0)
    assert refusals == []  # a graph AOTAutograd's cache stores (a launch loads it instead of tracing it again)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
