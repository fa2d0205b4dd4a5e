"""MemoryLlama (models/grafts/memory_llama.py): the thesis' block equations against a plain
reference, exact init, causality, that the memory is read and written, gradients of the
zero-initialised paths, parameter counts at the thesis' shape, bad configs."""

from __future__ import annotations

import pytest
import torch

from models.backbones.decoder_lm import DecoderLM, DecoderLMConfig
from models.grafts.graft import apply_graft, graft_diagnostics, GraftConfig
from models.grafts.memory_llama import MemoryLlamaBlock, MemoryLlamaConfig
from torchtitan_ext.backbone import FAMILY, load_hf_backbone

VOCAB, LENGTH, CHUNK = 256, 96, 16
# Two documents packed in each row (the attention is document-masked, the memory is not reset).
PACKED = torch.cat([torch.arange(37), torch.arange(LENGTH - 37)]).expand(2, LENGTH)


def tiny(architecture: str = "qwen3", layers: str = "alma", init: str = "exact", chunk: int = CHUNK,
         update: str = "muon", **fields):
    """A 3-block backbone (Qwen3: head_dim 24 != 48 / 4, q/k norm, GQA) with MemoryLlama."""
    memory = {"init": init, "chunk_size": chunk, "update": update}
    graft = GraftConfig(kind="memoryllama", layers=layers, memory=memory, **fields)
    return DecoderLM(DecoderLMConfig(architecture=architecture, vocab_size=VOCAB, dim=48, n_layers=3, n_heads=4,
                                     n_kv_heads=2, head_dim=24 if architecture == "qwen3" else None, ffn_hidden=96,
                                     qk_norm=architecture == "qwen3", graft=graft))


def awaken(model: DecoderLM, seed: int = 0) -> DecoderLM:
    """Random values for the zero-initialised graft paths, so the memory matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.layers.values():
            if isinstance(block, MemoryLlamaBlock):
                for p in (block.memory_down_proj.weight, block.memory_gate.weight):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
                if hasattr(block, "memory_gate_scale"):
                    block.memory_gate_scale.fill_(1.0)
                block.memory.to_gates.bias.copy_(torch.randn(block.memory.to_gates.bias.shape, generator=g))
    return model


def tokens(seed: int = 1, length: int = LENGTH) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))


def reference_block(block: MemoryLlamaBlock, x, positions, doc_positions):
    """Eq. 4.1-4.10 chunk by chunk, written plainly: each chunk's attention is the block's
    full attention recomputed over every x_DP so far (no cache), its last rows kept."""
    exact = block.cfg.init == "exact"
    xn = block.attention_norm(x)
    state = block.memory.empty_state(x.shape[0], dtype=x.dtype)
    x_dp_so_far, out = [], []
    for start in range(0, x.shape[1], block.cfg.chunk_size):
        end = min(start + block.cfg.chunk_size, x.shape[1])
        h = block.memory.retrieve(xn[:, start:end], state)  # eq. 4.2, M_{c-1}
        w_dp = block.memory_down_proj.weight
        x_dp = torch.cat([xn[:, start:end], h], -1) @ w_dp.T + (xn[:, start:end] if exact else 0)  # eq. 4.4
        x_dp_so_far.append(x_dp)
        prefix = torch.cat(x_dp_so_far, 1)
        a = block.attention(prefix, positions[:, :end], None if doc_positions is None else doc_positions[:, :end])
        a = a[:, start:end]  # eq. 4.5
        m, state = block.memory(block.memory_norm(a), state)  # eq. 4.6-4.7 on RMSNorm(a), read before the write
        g = torch.sigmoid(a @ block.memory_gate.weight.T + block.memory_gate.bias)  # eq. 4.8
        if exact:
            g = block.memory_gate_scale * g
        y = (1 - g) * a + g * m  # eq. 4.9
        o = (x[:, start:end] if exact else x_dp) + y  # eq. 4.10 (exact: the identity residual)
        out.append(o + block.feed_forward(block.ffn_norm(o)))
    return torch.cat(out, 1)


@pytest.mark.parametrize("init,update", [("exact", "muon"), ("thesis", "titans")])
@pytest.mark.parametrize("chunk", [16, 5])
def test_the_block_equals_the_plain_reference_in_float64(init, update, chunk):
    model = awaken(tiny(init=init, chunk=chunk, update=update)).double()
    block = model.layers["2"]
    x = torch.randn(2, LENGTH, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for doc_positions in (None, PACKED):
            rope = PACKED if doc_positions is not None else torch.arange(LENGTH).expand(2, LENGTH)
            got = block(x, rope, doc_positions)
            torch.testing.assert_close(got, reference_block(block, x, rope, doc_positions), rtol=0, atol=1e-10)


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_exact_init_is_the_backbone_bit_for_bit(architecture):
    """Chunk sizes that are multiples of 16 keep CPU's attention and matmul kernels on the
    same blocking as the full-sequence backbone: 0 difference."""
    grafted = tiny(architecture, layers="all", chunk=32)
    backbone = DecoderLM(grafted.cfg.__class__(**{**vars(grafted.cfg), "graft": GraftConfig()}))
    backbone.load_state_dict(grafted.state_dict(), strict=False)
    with torch.no_grad():
        for positions in (None, PACKED):
            assert torch.equal(grafted(tokens(), positions), backbone(tokens(), positions))
        assert not torch.equal(awaken(grafted)(tokens()), backbone(tokens()))  # the graft can change it


def test_exact_init_from_a_hugging_face_folder(tmp_path):
    from test_backbone import hf_checkpoint

    hf_checkpoint("qwen3_head_dim_32_tied", tmp_path)
    backbone = load_hf_backbone(tmp_path).eval()
    grafted = load_hf_backbone(tmp_path).eval()
    apply_graft(grafted, GraftConfig(kind="memoryllama", layers="1", memory={"chunk_size": 16}, lora={"rank": 4},
                                     lora_layers="all"))
    with torch.no_grad():
        assert torch.equal(grafted(tokens(length=80)), backbone(tokens(length=80)))
    trainable = {k for k, p in grafted.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in k or k.startswith("layers.1.memory") for k in trainable)


def test_thesis_init_has_the_printed_values_and_is_not_the_backbone():
    model = tiny(init="thesis")
    block = model.layers["2"]
    assert torch.equal(block.memory_down_proj.weight, torch.cat([torch.eye(48), torch.zeros(48, 48)], 1))
    assert torch.equal(block.memory_gate.weight, torch.zeros(48, 48))
    assert torch.equal(block.memory_gate.bias, torch.full((48,), -6.0))
    backbone = DecoderLM(model.cfg.__class__(**{**vars(model.cfg), "graft": GraftConfig()}))
    backbone.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        assert (model(tokens()) - backbone(tokens())).abs().max() > 1e-3  # eq. 4.10's residual is RMSNorm(x)


@pytest.mark.parametrize("init,update,chunk", [("exact", "muon", CHUNK), ("thesis", "titans", CHUNK),
                                               ("thesis", "titans", 1)])
def test_causality_in_float64(init, update, chunk):
    model = awaken(tiny(layers="0,2", init=init, update=update, chunk=chunk)).double()
    changed = tokens().clone()
    t = 50  # inside the fourth chunk
    changed[:, t] = (changed[:, t] + 1) % VOCAB
    with torch.no_grad():
        for positions in (None, PACKED):
            before, after = model(tokens(), positions), model(changed, positions)
            assert torch.equal(before[:, :t], after[:, :t])
            assert (before[:, t:] - after[:, t:]).abs().max() > 1e-6


@pytest.mark.parametrize("update", ["muon", "titans"])
def test_the_memory_is_written_and_read(update):
    """Zeroing the written fast weights after every chunk's write changes the later chunks'
    predictions and never the first chunk's (it reads the initial weights either way)."""
    model = awaken(tiny(layers="2", update=update))
    block = model.layers["2"]
    with torch.no_grad():
        normal = model(tokens())
        write = block.memory.forward

        def forgetting_write(a, state):
            read, written = write(a, state)
            return read, written._replace(weights=tuple(torch.zeros_like(w) for w in written.weights))

        block.memory.forward = forgetting_write
        ablated = model(tokens())
    assert torch.equal(normal[:, :CHUNK], ablated[:, :CHUNK])
    assert (normal[:, CHUNK:] - ablated[:, CHUNK:]).abs().max() > 1e-3


def test_zero_initialised_paths_get_gradient_from_the_second_step():
    model = tiny(layers="2")
    block = model.layers["2"]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == {id(p) for p in block.graft_parameters()}
    optimizer = torch.optim.SGD(trainable, lr=0.5)
    model(tokens()).logsumexp(-1).mean().backward()
    assert block.memory_gate_scale.grad.abs().max() > 0 and block.memory_down_proj.weight.grad.abs().max() > 0
    assert block.memory_gate.weight.grad.abs().max() == 0 and block.memory.to_qkv.weight.grad.abs().max() == 0
    optimizer.step()
    optimizer.zero_grad()
    model(tokens()).logsumexp(-1).mean().backward()
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in trainable)


def test_diagnostics_follow_the_gate():
    model = tiny(layers="alma")
    with torch.no_grad():
        model(tokens())
    stats = graft_diagnostics(model)
    for layer in (1, 2):
        assert stats[f"memory/layer{layer}/gate_max"] == 0 == stats[f"memory/layer{layer}/contribution_global"]
        assert stats[f"memory/layer{layer}/w_h_norm"] == 0 and "memory/layer{layer}/theta_mean"
    with torch.no_grad():
        awaken(model)(tokens())
    stats = graft_diagnostics(model)
    assert 0 < stats["memory/layer2/gate_min"] <= stats["memory/layer2/gate_mean"] <= stats["memory/layer2/gate_max"] < 1
    assert stats["memory/layer2/contribution_global"] > 0 and stats["memory/layer2/contribution_per_token"] > 0


def test_a_memory_block_at_the_thesis_shape_has_its_46_million_parameters():
    """Section 4.2.1: one module on Llama-3.2-1B (dim 2048, hidden 4096) with its gating and
    q, k, v projections is "approximately 46 million"; two (ALMA) are its 92M."""
    with torch.device("meta"):
        model = DecoderLM(FAMILY.config("llama3_2_1b", graft=GraftConfig(kind="memoryllama", layers="alma",
                                                                          memory={"init": "thesis"})))
    per_module = sum(p.numel() for p in model.layers["15"].graft_parameters())
    assert round(per_module / 1e6, 1) == 46.1
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 2 * per_module


def test_bad_graft_configs_name_the_problem():
    with pytest.raises(ValueError, match="graft layer 3 is out of range: the backbone has blocks 0..2"):
        tiny(layers="1,3")
    with pytest.raises(ValueError, match="MemoryLlama init 'identity' unknown"):
        tiny(init="identity")
    with pytest.raises(ValueError, match="MemoryLlama update 'sgd' unknown"):
        tiny(update="sgd")
    with pytest.raises(ValueError, match="graft kind 'lora' takes no memory config, got dict"):
        GraftConfig(kind="lora", memory={"chunk_size": 8})
    with pytest.raises(ValueError, match="graft kind 'mone' takes MoNeConfig config, got MemoryLlamaConfig"):
        GraftConfig(kind="mone", memory=MemoryLlamaConfig())


@pytest.mark.parametrize("update,chunk,stable", [("muon", 64, True), ("titans", 1, True), ("titans", 64, False)])
def test_the_write_rule_stays_finite_on_alike_tokens(update, chunk, stable):
    """512 identical (normed) attention outputs, fast weights at twice their init scale,
    theta near max_lr, eta near 1: the default rule and the thesis' token-by-token one stay
    bounded; Titans' rule over chunks of 64 diverges (why "muon" is the default)."""
    from models.grafts.memory_llama import memory_config
    from models.memory.neural_memory import NeuralMemory

    torch.manual_seed(0)
    memory = NeuralMemory(memory_config(48, MemoryLlamaConfig(update=update, chunk_size=chunk)))
    with torch.no_grad():
        memory.to_gates.bias.copy_(torch.tensor([4.0, 4.0, -4.0]))  # theta, eta logits high; alpha's low
        for w in memory.initial():
            w.mul_(2)
        a = torch.nn.functional.rms_norm(torch.randn(1, 1, 48).expand(2, 512, 48), (48,))
        state = memory.empty_state(2)
        start = torch.stack([w.norm() for w in state.weights]).norm()
        _, state = memory(a, state)
        end = torch.stack([w.norm() for w in state.weights]).norm()
    assert (bool(torch.isfinite(end)) and end < 2 * start) == stable, (start, end)


def ablated_logits(model: DecoderLM, x: torch.Tensor) -> torch.Tensor:
    """Logits with every MemoryLlama memory's written fast weights zeroed after each write."""
    blocks = [b for b in model.layers.values() if isinstance(b, MemoryLlamaBlock)]
    writes = [b.memory.forward for b in blocks]

    def forgetting(write):
        def forward(a, state):
            read, written = write(a, state)
            return read, written._replace(weights=tuple(torch.zeros_like(w) for w in written.weights))
        return forward

    try:
        for block, write in zip(blocks, writes):
            block.memory.forward = forgetting(write)
        with torch.no_grad():
            return model(x)
    finally:
        for block in blocks:
            del block.memory.forward


MEMORYLLAMA = ["--module", "train_configs.backbone", "--config", "memoryllama_alma_debug"]
FROM_HF = ["--checkpoint.initial_load_in_hf", "--validator.no-enable", "--debug.seed", "0"]


@pytest.mark.slow
def test_a_finetune_from_hugging_face_starts_exact_keeps_the_backbone_uses_the_memory_and_exports(tmp_path):
    """Through scripts/train.sh from a random tiny Qwen3 folder: the grafted model's first
    loss is the backbone's; 20 steps lower it; every backbone tensor of the step-20
    checkpoint is the Hugging Face file's bit for bit; the optimizer holds only graft
    tensors; zeroing the written fast weights changes the trained model's predictions; the
    remote-code export reloads without the project with the same logits."""
    from conftest import train
    from graft_checks import assert_exports_as_remote_code, trained_from_hf
    from test_backbone import qwen3_debug_checkpoint

    qwen3_debug_checkpoint(tmp_path / "hf")
    source = ["--checkpoint.initial_load_path", str(tmp_path / "hf")]
    plain = train(["--module", "train_configs.backbone", "--config", "backbone_qwen3_debug"] + FROM_HF + source +
                  ["--training.steps", "1", "--checkpoint.interval", "100", "--dump_folder", str(tmp_path / "plain")])
    run = train(MEMORYLLAMA + FROM_HF + source + ["--training.steps", "20", "--checkpoint.interval", "20",
                                                  "--dump_folder", str(tmp_path / "run")])
    assert plain.returncode == 0 and run.returncode == 0, (plain, run)
    assert run.losses[1] == plain.losses[1]  # exact init: the backbone's loss on the same batch
    assert run.losses[20] < run.losses[1] - 0.2
    summaries = [line for line in run.output.splitlines() if " - memory: " in line]  # eq. 4.12-4.13 and the gate
    assert summaries and all(f"{name}: " in summaries[-1] for name in ("gate_mean", "w_h_norm", "contribution_global"))

    step = tmp_path / "run" / "checkpoint" / "step-20"
    model = trained_from_hf("memoryllama_alma_debug", step, tmp_path / "hf")
    x = torch.randint(0, 4096, (2, 256), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(x)
    assert (ablated_logits(model, x) - logits)[:, 32:].abs().max() > 1e-3  # the memory memorises
    hf = assert_exports_as_remote_code("memoryllama_alma_debug", step, x[:, :80], logits[:, :80], tmp_path)
    assert hf["class"] == "MemoryLMForCausalLM"


@pytest.mark.slow
def test_the_compiled_block_equals_eager():
    """Two chunks and a partial one through the compiled block (float32)."""
    from graft_checks import assert_compiled_block_equals_eager

    x = torch.randn(2, 2 * CHUNK + 5, 48, generator=torch.Generator().manual_seed(4), requires_grad=True)
    assert_compiled_block_equals_eager(awaken(tiny()).layers["2"], x, torch.arange(x.shape[1]).expand(2, -1), None)


@pytest.mark.slow
def test_one_and_two_processes_and_full_ac_from_one_seed_agree_and_keep_the_backbone(tmp_path):
    from graft_checks import assert_seeded_runs_agree

    assert_seeded_runs_agree("memoryllama_alma_debug", tmp_path, ["--training.steps", "10", "--validator.no-enable",
                                                           "--debug.seed", "0", "--training.global_batch_size", "4"])


@pytest.mark.parametrize("update,chunk", [("muon", CHUNK), ("titans", 1)])
def test_streaming_in_segments_equals_one_pass_in_float64(update, chunk):
    """Segments that cut chunks anywhere: the caches (keys, values, memory state) carry
    everything, and chunks stay aligned to the stream's positions."""
    model = awaken(tiny(layers="0,2", update=update, chunk=chunk)).double()
    x = tokens()
    with torch.no_grad():
        outputs, state, start = [], None, 0
        for length in (37, 50, 9):
            out, state = model.stream(x[:, start:start + length], state)
            outputs.append(out)
            start += length
        torch.testing.assert_close(torch.cat(outputs, 1), model(x), rtol=0, atol=1e-10)
    assert state.seen == LENGTH and state.caches[0][0].shape[2] == LENGTH  # every key kept
