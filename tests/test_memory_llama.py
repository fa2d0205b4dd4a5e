"""MemoryLlama (models/grafts/memory_llama.py): the block against an independent per-token
reference of the thesis' eq. 4.1-4.10 (o = x + y) under every option, exact init, the thesis
init's step-0 change, causality, that the memory is read and written, gradients of the
zero-initialised paths, parameter counts at the thesis' shape, the thesis-run configs, bad
configs."""

from __future__ import annotations

import pytest
import torch

from models.backbones.decoder_lm import DecoderLM, DecoderLMConfig
from models.grafts.graft import apply_graft, graft_diagnostics, GraftConfig
from models.layers.diagnostics import recording
from models.grafts.memory_llama import MemoryLlamaBlock, MemoryLlamaConfig, THESIS_MEMORY
from models.memory.neural_memory import NeuralMemoryConfig
from torchtitan_ext.families.backbone import FAMILY, load_hf_backbone

VOCAB, LENGTH, CHUNK = 256, 96, 16
# Two documents packed in each row (the attention is document-masked, the memory is not reset).
PACKED = torch.cat([torch.arange(37), torch.arange(LENGTH - 37)]).expand(2, LENGTH)


def tiny(architecture: str = "qwen3", layers: str = "alma", init: str = "exact", chunk: int = CHUNK,
         update: str = "muon", memory: dict | None = None, **fields):
    """A 3-block backbone (Qwen3: head_dim 24 != 48 / 4, q/k norm, GQA) with MemoryLlama;
    `memory` overrides the memory fields."""
    memory = {"init": init, "chunk_size": chunk, "update": update} | (memory or {})
    graft = GraftConfig(kind="memoryllama", layers=layers, memory=memory, **fields)
    return DecoderLM(DecoderLMConfig(architecture=architecture, vocab_size=VOCAB, dim=48, n_layers=3, n_heads=4,
                                     n_kv_heads=2, head_dim=24 if architecture == "qwen3" else None, ffn_hidden=96,
                                     qk_norm=architecture == "qwen3", graft=graft))


def awaken(model: DecoderLM, seed: int = 0) -> DecoderLM:
    """Random values for the zero-initialised graft paths and the gate bias, so the memory matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.layers.values():
            if isinstance(block, MemoryLlamaBlock):
                for p in (block.memory_down_proj.weight, block.memory_gate.weight, block.memory_gate.bias):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
                if hasattr(block, "memory_gate_scale"):
                    block.memory_gate_scale.fill_(1.0)
                block.memory.to_gates.bias.copy_(torch.randn(block.memory.to_gates.bias.shape, generator=g))
    return model


def tokens(seed: int = 1, length: int = LENGTH) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))


def silu(z):
    return z * torch.sigmoid(z)


def unit(z):
    return z / z.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def rms_norm(z, weight, eps):
    return weight * z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps)


def memory_mlp(weights, z, residual):
    """The memory network on z (B, d) with per-row weights [(B, in, out)]: SiLU between the
    matrices, plus z with the residual (sections 2.3, 4.2.1)."""
    out = z
    for i, w in enumerate(weights):
        out = torch.einsum("bi,bio->bo", out, w)
        out = silu(out) if i < len(weights) - 1 else out
    return z + out if residual else out


def reference_block(block: MemoryLlamaBlock, x, positions, doc_positions):
    """Eq. 4.1-4.10 token by token with o = x + y, from the block's weights with plain
    tensors (the graft shares no code with it). Attn (eq. 4.5) and the block's norms and
    SwiGLU are the pretrained layer's own modules (tests/test_backbone.py checks them against
    transformers), Attn called on each whole prefix of x_DP. The memory module: q, k = L2(SiLU(.
    W)), v = SiLU(. W) (the public code's), theta = max_lr sigmoid, eta = sigmoid, alpha =
    sigmoid(logit - 4) (models/memory/neural_memory.py's offset), eq. 2.38-2.40 with the
    gradient from autograd. With chunk_size C, token t reads (h, and m unless
    read_after_write) the state at its chunk's start and every token's gradient is taken
    there (Titans' chunked rule; C = 1: M_{t-1}). The options' defaults are written as the
    module docstring states them: h's query from RMSNorm(x), the write on RMSNorm(a), a
    final projection of the reads, read before the write."""
    cfg, memory = block.cfg, block.memory
    batch, length, _ = x.shape
    w_q, w_k, w_v = memory.to_qkv.weight.chunk(3, 0)
    exact = cfg.init == "exact"

    def read(weights, inputs):  # M*(q) for the queries of `inputs`, then the projection if any
        y = memory_mlp(weights, unit(silu(inputs @ w_q.T)), cfg.residual)
        return y @ memory.out.weight.T if cfg.output_proj else y

    weights = [w[0].expand(batch, -1, -1).clone() for w in memory.initial_weights]  # M_0, one head
    momentum = [torch.zeros_like(w) for w in weights]
    xn = block.attention_norm(x)
    x_dp, outputs = [], []
    for t in range(length):
        if t % cfg.chunk_size == 0:
            chunk_start = [w.clone() for w in weights]
        h = read(chunk_start, xn[:, t] if cfg.query_norm else x[:, t])  # eq. 4.1-4.2
        x_dp.append(torch.cat([xn[:, t], h], -1) @ block.memory_down_proj.weight.T + (xn[:, t] if exact else 0))
        docs = None if doc_positions is None else doc_positions[:, :t + 1]
        a = block.attention(torch.stack(x_dp, 1), positions[:, :t + 1], docs)[:, t]  # eq. 4.3-4.5
        u = rms_norm(a, block.memory_norm.weight, block.memory_norm.eps) if cfg.write_norm else a
        k, v = unit(silu(u @ w_k.T)), silu(u @ w_v.T)
        theta_logit, eta_logit, alpha_logit = (u @ memory.to_gates.weight.T + memory.to_gates.bias).unbind(-1)
        theta, eta, alpha = (g[:, None, None] for g in (cfg.max_lr * torch.sigmoid(theta_logit),
                                                        torch.sigmoid(eta_logit), torch.sigmoid(alpha_logit - 4)))
        at = [w.detach().requires_grad_() for w in chunk_start]
        with torch.enable_grad():
            surprise = torch.autograd.grad((memory_mlp(at, k, cfg.residual) - v).pow(2).sum(), at)  # eq. 2.38
        momentum = [eta * s - theta * g for s, g in zip(momentum, surprise)]  # eq. 2.39
        weights = [(1 - alpha) * w + s for w, s in zip(weights, momentum)]  # eq. 2.40 (4.6)
        m = read(weights if cfg.read_after_write else chunk_start, u)  # eq. 4.7
        g = torch.sigmoid(a @ block.memory_gate.weight.T + block.memory_gate.bias)  # eq. 4.8
        g = block.memory_gate_scale * g if exact else g
        o = x[:, t] + (1 - g) * a + g * m  # eq. 4.9-4.10
        outputs.append(o + block.feed_forward(block.ffn_norm(o)))
    return torch.stack(outputs, 1)


# The printed block, the defaults' departures under Titans' rule over chunks that cut the
# documents and the sequence's end, and mixes of the options.
REFERENCE_CASES = {
    "thesis": THESIS_MEMORY,
    "exact_defaults_chunk_5": dict(init="exact", update="titans", chunk_size=5),
    "thesis_init_chunk_16_residual_depth_3": dict(init="thesis", update="titans", chunk_size=16, depth=3,
                                                  residual=True, output_proj=False),
    "exact_token_by_token_raw_query_and_write": dict(init="exact", update="titans", chunk_size=1, depth=1,
                                                     query_norm=False, write_norm=False),
}


@pytest.mark.parametrize("case", REFERENCE_CASES)
def test_the_block_equals_an_independent_per_token_reference_in_float64(case):
    model = awaken(tiny(memory=REFERENCE_CASES[case])).double()
    block = model.layers["2"]
    x = torch.randn(2, LENGTH, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for doc_positions in (None, PACKED):
            rope = PACKED if doc_positions is not None else torch.arange(LENGTH).expand(2, LENGTH)
            got = block(x, rope, doc_positions)
            torch.testing.assert_close(got, reference_block(block, x, rope, doc_positions), rtol=0, atol=1e-10)


@pytest.mark.parametrize("option,value", [("read_after_write", False), ("query_norm", True), ("write_norm", True),
                                          ("output_proj", True), ("residual", False), ("depth", 2)])
def test_each_printed_option_changes_the_block(option, value):
    """The reference comparison above can tell the options apart: turning any one of the
    thesis' values changes the block's output."""
    x = torch.randn(2, 40, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(40).expand(2, 40)
    outputs = []
    for memory in (THESIS_MEMORY, THESIS_MEMORY | {option: value}):
        torch.manual_seed(0)
        block = awaken(tiny(memory=memory)).double().layers["2"]
        with torch.no_grad():
            outputs.append(block(x, positions, None))
    assert (outputs[0] - outputs[1]).abs().max() > 1e-6


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


def test_thesis_init_has_the_printed_values():
    block = tiny(memory=THESIS_MEMORY).layers["2"]
    assert torch.equal(block.memory_down_proj.weight, torch.cat([torch.eye(48), torch.zeros(48, 48)], 1))
    assert torch.equal(block.memory_gate.weight, torch.zeros(48, 48))
    assert torch.equal(block.memory_gate.bias, torch.full((48,), -6.0))


def relative_change_at_step_0(memory: dict, length: int = 128) -> float:
    """||logits - backbone logits|| / ||backbone logits|| of the random-weight debug Qwen3
    (4 blocks, dim 128) with ALMA at `memory`, on 2 x `length` random tokens."""
    torch.manual_seed(0)
    grafted = DecoderLM(FAMILY.config("qwen3_debug", graft=GraftConfig(kind="memoryllama", layers="alma",
                                                                        memory=memory)))
    backbone = DecoderLM(FAMILY.config("qwen3_debug"))
    backbone.load_state_dict(grafted.state_dict(), strict=False)
    x = torch.randint(0, 4096, (2, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = backbone(x)
        return float((grafted(x) - reference).norm() / reference.norm())


def test_the_thesis_init_moves_the_debug_qwen3_step_0_logits_by_at_most_2_percent():
    """Section 4.1.3: the block should behave as the backbone's at init. With o = x + y the
    thesis' init (ALMA, the per-token update) departs only by g (m - a), g = sigmoid(-6); the
    exact init by rounding."""
    thesis = relative_change_at_step_0(THESIS_MEMORY)
    assert 0 < thesis <= 0.02, thesis
    assert relative_change_at_step_0(THESIS_MEMORY | {"init": "exact"}) < 1e-6


@pytest.mark.parametrize("init,update,chunk,memory", [("exact", "muon", CHUNK, None), ("thesis", "titans", CHUNK, None),
                                                      ("thesis", "titans", 1, None), (None, None, None, THESIS_MEMORY)])
def test_causality_in_float64(init, update, chunk, memory):
    model = awaken(tiny(layers="0,2", init=init, update=update, chunk=chunk, memory=memory)).double()
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
    """The block's gate statistics and, recorded (`models.layers.diagnostics`), its memory's own."""
    model = tiny(layers="alma")
    with torch.no_grad(), recording():
        model(tokens())
    stats = graft_diagnostics(model)
    for layer in (1, 2):
        assert stats[f"memory/layer{layer}/gate_max"] == 0 == stats[f"memory/layer{layer}/contribution_global"]
        assert stats[f"memory/layer{layer}/w_h_norm"] == 0
        assert 0 < stats[f"memory/layer{layer}/theta_mean"] < 0.01  # the memory's own statistics: theta < max_lr
    with torch.no_grad(), recording():
        awaken(model)(tokens())
    stats = graft_diagnostics(model)
    assert 0 < stats["memory/layer2/gate_min"] <= stats["memory/layer2/gate_mean"] <= stats["memory/layer2/gate_max"] < 1
    assert stats["memory/layer2/contribution_global"] > 0 and stats["memory/layer2/contribution_per_token"] > 0


def test_a_memory_module_at_the_thesis_shape_has_its_46_million_parameters():
    """Section 4.2.1: one memory module on Llama-3.2-1B (dim 2048; appendix B: a depth-3 MLP
    of hidden width 4096) "including its gating layers and q, k, v projections" is
    "approximately 46 million"; two (ALMA) are its 92M. W_DP (2 d^2) and W_g (d^2 + d) come
    on top in each block."""
    d = 2048
    with torch.device("meta"):
        model = DecoderLM(FAMILY.config("llama3_2_1b", graft=GraftConfig(kind="memoryllama", layers="alma",
                                                                          memory=THESIS_MEMORY)))
    block = model.layers["15"]
    module = sum(p.numel() for p in block.memory.parameters())
    assert round(module / 1e6, 1) == 46.1
    assert module == (d * 2 * d + 2 * d * 2 * d + 2 * d * d) + 3 * d * d + 3 * d + 3  # MLP, q/k/v, gates
    assert sum(p.numel() for p in block.graft_parameters()) == module + 2 * d * d + d * d + d
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 2 * (module + 3 * d * d + d)


def test_bad_graft_configs_name_the_problem():
    with pytest.raises(ValueError, match="graft layer 3 is out of range: the backbone has blocks 0..2"):
        tiny(layers="1,3")
    with pytest.raises(ValueError, match="MemoryLlama init 'identity' unknown"):
        tiny(init="identity")
    with pytest.raises(ValueError, match="MemoryLlama update 'sgd' unknown"):
        tiny(update="sgd")
    with pytest.raises(ValueError, match="read_after_write reads M_t after token t's write, causal only token by "
                                         "token: set chunk_size 1 \\(got 16\\)"):
        tiny(update="titans", memory={"read_after_write": True})
    with pytest.raises(ValueError, match="a memory without output projection reads n_heads \\* head_dim = 32 "
                                         "features: set it to dim 48"):
        NeuralMemoryConfig(dim=48, n_heads=2, head_dim=16, output_proj=False)
    with pytest.raises(ValueError, match="graft kind 'lora' takes no memory config, got dict"):
        GraftConfig(kind="lora", memory={"chunk_size": 8})
    with pytest.raises(ValueError, match="graft kind 'mone' takes MoNeConfig config, got MemoryLlamaConfig"):
        GraftConfig(kind="mone", memory=MemoryLlamaConfig())


THESIS_RUNS = ["memoryllama_alma_1b_thesis", "memoryllama_elma_1b_thesis", "memoryllama_alma_1b_thesis_no_lora",
               "memoryllama_finetune_1b_thesis"]
# LoRA r16 on Llama-3.2-1B's 16 blocks: r (in + out) for q, o (2048 x 2048), k, v (2048 x 512),
# gate, up, down (2048 x 8192).
LLAMA_1B_LORA_R16 = 16 * 16 * (2 * (2048 + 2048) + 2 * (2048 + 512) + 3 * (2048 + 8192))


@pytest.mark.parametrize("name", THESIS_RUNS)
def test_the_thesis_run_configs_train_its_budget_unclipped_and_build_on_meta(name):
    """Section 4.2: 12-20K sequences of 2048 tokens (20K here), no gradient clipping, one
    AdamW group (bitsandbytes' defaults (0.9, 0.999), wd 0.1) at lr 1e-3 constant (the
    finetune baseline: the public code's 4e-4, cosine). On meta, what trains: the thesis'
    memories in ALMA's blocks 14, 15 or ELMA's 1, 2 (appendix B), LoRA r16 on every block
    except in the "-LoRA" ablation, no memory in the finetune baseline."""
    from train_configs import backbone as configs

    config = getattr(configs, name)()
    training = config.training
    assert training.steps * training.global_batch_size == 20000 and training.seq_len == 2048
    gradient = torch.tensor([3e6, -4e6, 0.0])
    parameter = torch.nn.Parameter(torch.zeros(3))
    parameter.grad = gradient.clone()
    torch.nn.utils.clip_grads_with_norm_([parameter], training.max_norm, gradient.norm())  # torchtitan's clip
    assert torch.equal(parameter.grad, gradient)
    finetune = name == "memoryllama_finetune_1b_thesis"
    [group] = config.optimizer.param_groups
    assert group.optimizer_name == "AdamW" and group.optimizer_kwargs["betas"] == (0.9, 0.999)
    assert group.optimizer_kwargs["weight_decay"] == 0.1
    assert group.optimizer_kwargs["lr"] == (4e-4 if finetune else 1e-3)
    assert config.lr_scheduler.warmup_steps == 0
    assert (config.lr_scheduler.decay_type, config.lr_scheduler.min_lr_factor) == ("cosine", 0.0) if finetune \
        else config.lr_scheduler.decay_ratio == 0.0  # no decay phase: constant
    with torch.device("meta"):
        model = config.model_spec.model.build()
    memories = {i: block for i, block in model.layers.items() if isinstance(block, MemoryLlamaBlock)}
    assert sorted(memories, key=int) == {"alma": ["14", "15"], "elma": ["1", "2"]}.get(name.split("_")[1], [])
    assert all(block.cfg == MemoryLlamaConfig(**THESIS_MEMORY) for block in memories.values())
    trainable = {key: p.numel() for key, p in model.named_parameters() if p.requires_grad}
    lora = sum(n for key, n in trainable.items() if ".lora_" in key)
    assert lora == (0 if name.endswith("_no_lora") else LLAMA_1B_LORA_R16)
    assert sum(trainable.values()) - lora == sum(p.numel() for b in memories.values() for p in b.graft_parameters())


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
    loss is the backbone's; 10 steps lower it; every backbone tensor of the step-10
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
    run = train(MEMORYLLAMA + FROM_HF + source + ["--training.steps", "10", "--checkpoint.interval", "10",
                                                  "--dump_folder", str(tmp_path / "run")])
    assert plain.returncode == 0 and run.returncode == 0, (plain, run)
    assert run.losses[1] == plain.losses[1]  # exact init: the backbone's loss on the same batch
    assert run.losses[10] < run.losses[1] - 0.2
    summaries = [line for line in run.output.splitlines() if " - memory: " in line]  # eq. 4.12-4.13 and the gate
    assert summaries and all(f"{name}: " in summaries[-1] for name in ("gate_mean", "w_h_norm", "contribution_global"))

    step = tmp_path / "run" / "checkpoint" / "step-10"
    model = trained_from_hf("memoryllama_alma_debug", step, tmp_path / "hf")
    x = torch.randint(0, 4096, (2, 256), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(x)
    assert (ablated_logits(model, x) - logits)[:, 32:].abs().max() > 1e-3  # the memory memorises
    hf = assert_exports_as_remote_code("memoryllama_alma_debug", step, x[:, :80], logits[:, :80], tmp_path)
    assert hf["class"] == "MemoryLMForCausalLM"


@pytest.mark.slow
def test_the_compiled_block_equals_eager():
    """A written chunk and a partial one reading what it wrote, through the compiled block
    (float32). The chunk loop unrolls in the graph, so every further chunk is the same code at
    more Inductor time (with two written chunks 124 s of a cold cache on the CI machine, 75 s
    with one)."""
    from graft_checks import assert_compiled_block_equals_eager

    x = torch.randn(2, CHUNK + 5, 48, generator=torch.Generator().manual_seed(4), requires_grad=True)
    assert_compiled_block_equals_eager(awaken(tiny()).layers["2"], x, torch.arange(x.shape[1]).expand(2, -1), None)


@pytest.mark.parametrize("update", ["muon", "titans"])
def test_full_activation_checkpointing_equals_eager(update):
    """Every block recomputed in the backward, as `activation-checkpoint:full` trains: six
    chunks, each update rule."""
    from graft_checks import assert_full_ac_equals_eager

    assert_full_ac_equals_eager(awaken(tiny(update=update)), tokens())


@pytest.mark.slow
def test_one_and_two_processes_from_one_seed_agree_and_keep_the_backbone(tmp_path):
    from graft_checks import assert_seeded_runs_agree

    assert_seeded_runs_agree("memoryllama_alma_debug", tmp_path, ["--training.steps", "4", "--validator.no-enable",
                                                           "--debug.seed", "0", "--training.global_batch_size", "4"])


@pytest.mark.parametrize("update,chunk,memory", [("muon", CHUNK, None), ("titans", 1, None),
                                                  (None, None, THESIS_MEMORY)])
def test_streaming_in_segments_equals_one_pass_in_float64(update, chunk, memory):
    """Segments that cut chunks anywhere: the caches (keys, values, memory state) carry
    everything, and chunks stay aligned to the stream's positions."""
    model = awaken(tiny(layers="0,2", update=update, chunk=chunk, memory=memory)).double()
    x = tokens()
    with torch.no_grad():
        outputs, state, start = [], None, 0
        for length in (37, 50, 9):
            out, state = model.stream(x[:, start:start + length], state)
            outputs.append(out)
            start += length
        torch.testing.assert_close(torch.cat(outputs, 1), model(x), rtol=0, atol=1e-10)
    assert state.seen == LENGTH and state.caches[0][0].shape[2] == LENGTH  # every key kept


def bounded_stream(model: DecoderLM, x: torch.Tensor, window: int, piece: int):
    """x streamed in pieces of `piece` tokens with stream_window `window` -> (logits, state)."""
    model.cfg.stream_window = window
    outputs, state = [], None
    with torch.no_grad():
        for start in range(0, x.shape[1], piece):
            out, state = model.stream(x[:, start:start + piece], state)
            outputs.append(out)
    return torch.cat(outputs, 1), state


def test_a_bounded_stream_reaches_past_its_window_only_through_the_memory():
    """stream_window W: the caches keep at most W - piece keys; a window that holds the whole
    sequence streams as one pass (chunks aligned by position, not by the cache's length); a
    token changed before the blocks' reach changes the last piece only when the memory is
    awake (at the exact init the graft computes the backbone: nothing crosses)."""
    x, changed = tokens(), tokens().clone()
    changed[:, 0] = (changed[:, 0] + 1) % VOCAB
    awake = awaken(tiny(layers="0,2")).double()
    with torch.no_grad():
        whole = awake(x)
    torch.testing.assert_close(bounded_stream(awake, x, LENGTH, 8)[0], whole, rtol=0, atol=1e-10)
    # each of the 3 blocks reaches at most window - 1 tokens further back (sliding-window
    # attention): the last piece (88-95) sees nothing before token 88 - 3 * 23 = 19 but by the memory
    window, piece = 24, 8
    logits, state = bounded_stream(awake, x, window, piece)
    assert state.seen == LENGTH and all(c[0].shape[2] <= window for c in state.caches)
    assert (logits[:, -piece:] - bounded_stream(awake, changed, window, piece)[0][:, -piece:]).abs().max() > 1e-6
    exact = tiny(layers="0,2").double()
    torch.testing.assert_close(bounded_stream(exact, x, window, piece)[0][:, -piece:],
                               bounded_stream(exact, changed, window, piece)[0][:, -piece:], rtol=0, atol=1e-12)
