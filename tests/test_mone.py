"""MoNe (models/grafts/mone.py, models/memory/swiglu_memory.py): the write against autograd,
the block against a plain token-by-token reference, causality, that information crosses
segments only through the memory, streaming, gradients, the paper's parameter overhead,
bad configs."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from models.backbones.decoder_lm import DecoderLM, DecoderLMConfig
from models.grafts.graft import graft_diagnostics, GraftConfig
from models.grafts.mone import MONE_LORA, MoNeBlock
from models.memory.swiglu_memory import column_norms, segment_write

VOCAB, SEGMENT, LENGTH = 97, 6, 22  # three full segments and a partial one


def tiny(segment: int = SEGMENT, layers: str = "all", lora: dict | None = None, vocab: int = VOCAB,
         **memory) -> DecoderLM:
    """A 2-block Qwen3 backbone (query width 4 * 12 = 48 != dim 32, GQA) with MoNe, float64."""
    graft = GraftConfig(kind="mone", layers=layers, memory={"segment": segment, **memory},
                        lora=lora or {"rank": 4, "dropout": 0.0, "targets": ("q", "k", "v")})
    torch.manual_seed(0)
    return DecoderLM(DecoderLMConfig(architecture="qwen3", vocab_size=vocab, dim=32, n_layers=2, n_heads=4,
                                     n_kv_heads=2, head_dim=12, ffn_hidden=64, qk_norm=True, graft=graft)).double()


def awaken(model: DecoderLM, seed: int = 0) -> DecoderLM:
    """Random values for the graft's initialised-constant parts (affines, lr / decay biases,
    LoRA B), so every path is exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "affine" in name or "memory_lr.bias" in name or "memory_decay.bias" in name or "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return model


def tokens(seed: int = 1, length: int = LENGTH) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))


def swiglu(weights, x):
    return (F.silu(x @ weights[0]) * (x @ weights[1])) @ weights[2]


def test_the_segment_write_equals_autograd_and_keeps_the_column_norms():
    """Three segments: W_s = W_{s-1} - (beta mu + grad (1/T) sum_j lr_j (-v_j . M(k_j))),
    columns rescaled to W_0's norms; the gradient by autograd, the rule written out."""
    g = torch.Generator().manual_seed(0)
    batch, heads, size, width, hidden, out = 2, 3, 7, 5, 6, 4
    initial = [torch.randn(batch, heads, *s, generator=g, dtype=torch.float64) for s in
               [(width, hidden), (width, hidden), (hidden, out)]]
    targets = column_norms(initial)
    weights, momentum = tuple(initial), tuple(torch.zeros_like(w) for w in initial)
    ref_weights, ref_momentum = list(initial), [torch.zeros_like(w) for w in initial]
    for _ in range(3):
        k = F.normalize(torch.randn(batch, heads, size, width, generator=g, dtype=torch.float64), dim=-1)
        v = torch.randn(batch, heads, size, out, generator=g, dtype=torch.float64)
        lr, beta = torch.rand(batch, heads, size, generator=g, dtype=torch.float64), \
            torch.rand(batch, heads, generator=g, dtype=torch.float64)
        weights, momentum = segment_write(weights, momentum, targets, k, v, lr, beta, backend="torch")
        leaves = [w.clone().requires_grad_() for w in ref_weights]
        loss = -(lr[..., None] / size * v * swiglu(leaves, k)).sum()
        grads = torch.autograd.grad(loss, leaves)
        ref_momentum = [beta[..., None, None] * m + gr for m, gr in zip(ref_momentum, grads)]
        stepped = [w - m for w, m in zip(ref_weights, ref_momentum)]
        ref_weights = [w / w.norm(dim=-2, keepdim=True) * t for w, t in zip(stepped, targets)]
        for a, b in zip(weights, ref_weights):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        for a, b in zip(momentum, ref_momentum):
            torch.testing.assert_close(-a, b, rtol=0, atol=1e-12)  # the kernel's S is -mu
    for w, t in zip(weights, targets):
        torch.testing.assert_close(w.norm(dim=-2, keepdim=True), t, rtol=1e-6, atol=0)
    assert all((w - w0).abs().max() > 1e-3 for w, w0 in zip(weights, initial))


def reference_block(block: MoNeBlock, x: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
    """Eq. 3-8 and appendix A.2 token by token: each query's softmax over its segment's
    tokens and memory tokens up to itself, written out; the write's gradient by autograd.
    sizes: the row's segment lengths (documents: every segment but the last written, a short
    one averaged over its own tokens); None: segments of T, each complete one written."""
    attn, cfg = block.attention.cfg, block.cfg
    batch, length, _ = x.shape
    sizes = sizes or [min(cfg.segment, length - s) for s in range(0, length, cfg.segment)]
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
    rep = attn.n_heads // attn.n_kv_heads
    xn = block.attention_norm(x)
    weights = [w.detach().expand(batch, *w.shape) for w in block.memory_initial]
    momentum = [torch.zeros_like(w) for w in weights]
    targets = [w.detach().norm(dim=-2, keepdim=True) for w in block.memory_initial]

    def split(t):  # (B, n, H * w) -> (B, H, n, w)
        return t.unflatten(-1, (cfg.heads, -1)).transpose(1, 2)

    def affine(t, a):  # attention heads (B, n_heads, n, hd) -> (B, n, width)
        return t.transpose(1, 2).flatten(-2) * a[0] + a[1]

    outputs = []
    for index, (start, end) in enumerate(zip(bounds, bounds[1:])):
        seg = xn[:, start:end]
        n = seg.shape[1]
        positions = torch.arange(n).expand(batch, n)  # segment-local RoPE
        q, k, v = block.attention.project(seg, positions)
        q_aff = split(affine(q, block.memory_query_affine))
        read = swiglu(weights, F.normalize(F.silu(q_aff), dim=-1))
        h = (block.memory_norm(read) * F.silu(q_aff @ block.memory_gate)).transpose(1, 2).flatten(-2)
        mk, mv = block.attention.project_kv(h, positions)
        att = torch.zeros_like(q)
        for i in range(n):
            for head in range(attn.n_heads):
                kv = head // rep
                keys = torch.cat([k[:, kv, :i + 1], mk[:, kv, :i + 1]], 1)
                values = torch.cat([v[:, kv, :i + 1], mv[:, kv, :i + 1]], 1)
                p = torch.softmax((keys @ q[:, head, i, :, None]).squeeze(-1) / attn.head_dim ** 0.5, -1)
                att[:, head, i] = (p[..., None] * values).sum(1)
        y = x[:, start:start + n] + block.attention.wo(att.transpose(1, 2).flatten(-2))
        outputs.append(y + block.feed_forward(block.ffn_norm(y)))
        if n == cfg.segment or index < len(sizes) - 1:
            k_mem = F.normalize(F.silu(split(affine(k.repeat_interleave(rep, 1), block.memory_key_affine))), dim=-1)
            v_mem = F.silu(split(seg))
            lr = F.softplus(block.memory_lr(seg)).transpose(1, 2)
            beta = torch.sigmoid(block.memory_decay(seg.mean(1)))
            with torch.enable_grad():
                leaves = [w.detach().requires_grad_() for w in weights]
                loss = -(lr.detach()[..., None] / n * v_mem.detach() * swiglu(leaves, k_mem.detach())).sum()
                grads = torch.autograd.grad(loss, leaves)
            momentum = [beta.detach()[..., None, None] * m + gr for m, gr in zip(momentum, grads)]
            weights = [(w - m) / (w - m).norm(dim=-2, keepdim=True) * t for w, m, t in zip(weights, momentum, targets)]
    return torch.cat(outputs, 1)


@pytest.mark.parametrize("segment", [SEGMENT, 4])
def test_the_block_equals_the_plain_reference_in_float64(segment):
    model = awaken(tiny(segment=segment))
    x = torch.randn(2, LENGTH, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    block = model.layers["0"]
    with torch.no_grad():
        torch.testing.assert_close(block(x, None, None), reference_block(block, x), rtol=0, atol=1e-10)


def test_documents_start_segments_as_the_plain_reference_in_float64():
    """Doc positions restarting at 0: each document starts a segment, a document's short last
    segment is written (averaged over its own tokens) before the next reads the memory; rows
    of other cuts run in one batch. One document per row equals no doc positions."""
    model = awaken(tiny())
    x = torch.randn(2, LENGTH, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    block = model.layers["0"]
    rows = {9: [6, 3, 6, 6, 1], 16: [6, 6, 4, 6]}  # context cut -> the row's segment lengths (T = 6)
    positions = torch.stack([torch.cat([torch.arange(cut), torch.arange(LENGTH - cut)]) for cut in rows])
    with torch.no_grad():
        out = block(x, None, positions)
        for row, sizes in enumerate(rows.values()):
            torch.testing.assert_close(out[row:row + 1], reference_block(block, x[row:row + 1], sizes), rtol=0, atol=1e-10)
        whole = torch.arange(LENGTH).expand(2, -1)
        torch.testing.assert_close(block(x, None, whole), block(x, None, None), rtol=0, atol=1e-12)


def test_a_stream_whose_segments_end_reads_the_next_document_as_one_pass():
    """`end_segments` between a context and a question streamed in pieces gives the one-pass
    logits of [context | question] as two documents; a model with a plain block is refused."""
    from models.grafts.mone import end_segments

    model, x = awaken(tiny()), tokens()
    cut = 9
    positions = torch.cat([torch.arange(cut), torch.arange(LENGTH - cut)]).expand(2, -1)
    with torch.no_grad():
        whole = model(x, positions)
        context, state = model.stream(x[:, :4])
        more, state = model.stream(x[:, 4:cut], state)
        question, _ = model.stream(x[:, cut:], end_segments(model.layers.values(), state))
    torch.testing.assert_close(torch.cat([context, more, question], 1), whole, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="every block is MoNe"):
        end_segments(tiny(layers="0").layers.values(), state)


def test_causality_in_float64():
    model, x = awaken(tiny()), tokens()
    with torch.no_grad():
        base = model(x)
        for t in (2, SEGMENT + 1, 3 * SEGMENT):
            changed = x.clone()
            changed[:, t] = (changed[:, t] + 1) % VOCAB
            out = model(changed)
            assert (out[:, :t] - base[:, :t]).abs().max() < 1e-12, t
            assert (out[:, t:] - base[:, t:]).abs().max() > 1e-6, t


def test_information_crosses_segments_only_through_the_memory():
    """Attention stays inside a segment: a token of segment 0 changes the next segments'
    logits, and stops changing them when the memory is never written (lr = 0)."""
    x = tokens()
    changed = x.clone()
    changed[:, 2] = (changed[:, 2] + 1) % VOCAB
    model = awaken(tiny())
    with torch.no_grad():
        assert (model(changed) - model(x))[:, SEGMENT:].abs().amin(-1).min() > 1e-8
        for block in model.layers.values():
            block.memory_lr.bias.fill_(-800.0)  # softplus underflows to 0: no write
        assert (model(changed) - model(x))[:, SEGMENT:].abs().max() < 1e-12


def test_ablating_the_written_memory_changes_the_answer():
    """Read a context of two segments, then a query segment: with the written fast weights
    replaced by W_0 the query's logits change."""
    model, x = awaken(tiny()), tokens(length=3 * SEGMENT)
    with torch.no_grad():
        _, state = model.stream(x[:, :2 * SEGMENT])
        logits, _ = model.stream(x[:, 2 * SEGMENT:], state)
        fresh = [block.empty_cache(2, torch.zeros(2, 1, 32, dtype=torch.float64)) for block in model.layers.values()]
        ablated = state._replace(caches=tuple(c._replace(weights=f.weights, momentum=f.momentum)
                                              for c, f in zip(state.caches, fresh)))
        ablated_logits, _ = model.stream(x[:, 2 * SEGMENT:], ablated)
    assert (logits - ablated_logits).abs().max() > 1e-4


def test_streaming_in_pieces_equals_one_pass_in_float64():
    model, x = awaken(tiny()), tokens()
    with torch.no_grad():
        whole = model(x)
        state, parts = None, []
        for start, end in [(0, 1), (1, 8), (8, 12), (12, 13), (13, LENGTH)]:
            logits, state = model.stream(x[:, start:end], state)
            parts.append(logits)
    assert state.seen == LENGTH
    torch.testing.assert_close(torch.cat(parts, 1), whole, rtol=0, atol=1e-12)


def test_a_bounded_stream_is_the_unbounded_one():
    """MoNe attends inside its segment, so stream_window (at least the piece) cuts nothing."""
    model, x = awaken(tiny()), tokens()
    with torch.no_grad():
        unbounded, _ = model.stream(x)
        model.cfg.stream_window = 2 * SEGMENT
        state, parts = None, []
        for start in range(0, LENGTH, 5):
            logits, state = model.stream(x[:, start:start + 5], state)
            parts.append(logits)
    torch.testing.assert_close(torch.cat(parts, 1), unbounded, rtol=0, atol=1e-12)


def test_every_graft_parameter_learns_and_the_backbone_is_frozen():
    """One backward from the last segment's loss: every graft tensor but LoRA's A (B = 0 at
    init) gets gradient, no backbone tensor needs one; the diagnostics see the writes."""
    model = tiny()
    logits = model(tokens())
    F.cross_entropy(logits[:, -SEGMENT:].flatten(0, 1), tokens(seed=2)[:, -SEGMENT:].flatten()).backward()
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("memory" in n or "lora" in n for n in trained)
    silent = [n for n, p in trained.items() if "lora_A" not in n and (p.grad is None or p.grad.abs().max() == 0)]
    assert not silent
    stats = graft_diagnostics(model)
    assert stats["memory/layer1/update_ratio"] > 1e-3 and 0 < stats["memory/layer0/beta_mean"] < 1


def test_the_paper_shape_has_its_parameter_overhead():
    """Qwen2.5-0.5B's shapes (no attention biases), MoNe on all 24 blocks with LoRA r128 on
    W_q, W_k, W_v: 6.34 % more parameters (the paper: 6.4 %), d_h = 224."""
    graft = GraftConfig(kind="mone", layers="all", lora=MONE_LORA)
    with torch.device("meta"):
        model = DecoderLM(DecoderLMConfig(vocab_size=151936, dim=896, n_layers=24, n_heads=14, n_kv_heads=2,
                                          ffn_hidden=4864, tie_embeddings=True, graft=graft))
    block = model.layers["0"]
    assert block.in_h == block.out_h == 224 and block.memory_initial[0].shape == (4, 224, 224)
    added = sum(p.numel() for p in model.parameters() if p.requires_grad)
    backbone = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert 6.3 < 100 * added / backbone < 6.45


def test_bad_configs_name_the_problem(tokenizer_dir, tmp_path):
    from conftest import train

    with pytest.raises(ValueError, match="MoNe heads 3 must divide the query width 48"):
        tiny(heads=3)
    with pytest.raises(ValueError, match="MoNe needs heads >= 1, segment >= 1"):
        tiny(segment=0)
    run = train(["--module", "bad_configs", "--config", "mone_heads_not_dividing", "--dump_folder", str(tmp_path / "run")],
                preflight=True)
    assert run.returncode == 2 and run.output.strip().splitlines()[-1].endswith(
        "MoNe heads 3 must divide the query width 256 (n_heads * head_dim) and dim 128")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_the_compiled_block_equals_eager():
    """A written segment and a partial one through the compiled block (float32)."""
    from graft_checks import assert_compiled_block_equals_eager

    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(4), requires_grad=True)
    assert_compiled_block_equals_eager(awaken(tiny(segment=8)).float().layers["1"], x, None, None)


def test_full_activation_checkpointing_equals_eager():
    """Every block recomputed in the backward, as `activation-checkpoint:full` trains: three
    written segments and a partial one (float64)."""
    from graft_checks import assert_full_ac_equals_eager

    assert_full_ac_equals_eager(awaken(tiny()), tokens())


MONE = ["--module", "train_configs.backbone", "--config", "mone_debug"]
FROM_HF = ["--checkpoint.initial_load_in_hf", "--validator.no-enable", "--debug.seed", "0"]


def unwritten_logits(model: DecoderLM, x: torch.Tensor) -> torch.Tensor:
    """Logits of a copy whose memories are never written (lr = softplus(-800) = 0)."""
    import copy

    ablated = copy.deepcopy(model)
    with torch.no_grad():
        for block in ablated.layers.values():
            block.memory_lr.bias.fill_(-800.0)
        return ablated(x)


@pytest.mark.slow
def test_a_finetune_from_hugging_face_keeps_the_backbone_uses_the_memory_and_exports(tmp_path):
    """Through scripts/train.sh from a random tiny Qwen3 folder: 10 steps lower the loss;
    every backbone tensor of the step-10 checkpoint is the Hugging Face file's bit for bit;
    the optimizer holds only graft tensors; a memory never written changes the trained
    model's predictions after the first segment (never inside it); the remote-code export
    reloads without the project with the same logits."""
    from conftest import train
    from graft_checks import assert_exports_as_remote_code, trained_from_hf
    from test_backbone import qwen3_debug_checkpoint

    qwen3_debug_checkpoint(tmp_path / "hf")
    run = train(MONE + FROM_HF + ["--checkpoint.initial_load_path", str(tmp_path / "hf"), "--training.steps", "10",
                                  "--checkpoint.interval", "10", "--dump_folder", str(tmp_path / "run")])
    assert run.returncode == 0, run
    assert run.losses[10] < run.losses[1] - 0.1, run.losses  # a 20-step run fell 0.195 by step 10, 0.289 by 20
    summaries = [line for line in run.output.splitlines() if " - memory: " in line]
    assert summaries and all(f"{name}: " in summaries[-1] for name in ("lr_mean", "beta_mean", "update_ratio"))

    step = tmp_path / "run" / "checkpoint" / "step-10"
    model = trained_from_hf("mone_debug", step, tmp_path / "hf")
    x = torch.randint(0, 4096, (2, 256), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(x)
    change = (unwritten_logits(model, x) - logits).abs()
    assert change[:, :32].max() == 0 and change[:, 32:].max() > 1e-3  # the memory memorises, causally
    assert_exports_as_remote_code("mone_debug", step, x[:, :80], logits[:, :80], tmp_path)


@pytest.mark.slow
def test_two_processes_and_a_resume_agree_from_one_seed(tmp_path):
    """From one seed checkpoint, 4 steps: 2 processes within 1e-3 of one, the backbone
    unchanged, every graft tensor changed; a run resumed from step 2 repeats steps 3-4 bit
    for bit."""
    from conftest import train
    from graft_checks import assert_seeded_runs_agree

    short = ["--training.steps", "4", "--validator.no-enable", "--debug.seed", "0", "--debug.deterministic",
             "--training.global_batch_size", "4", "--checkpoint.interval", "2"]
    single, one = assert_seeded_runs_agree("mone_debug", tmp_path, short)
    resumed = tmp_path / "resumed"
    shutil.copytree(one, resumed)
    shutil.rmtree(resumed / "checkpoint" / "step-4")
    again = train(MONE + short + ["--dump_folder", str(resumed)])
    assert again.returncode == 0 and sorted(again.losses) == list(range(3, 5)), again
    assert all(again.losses[s] == single.losses[s] for s in again.losses)


def test_the_paper_config_keeps_the_papers_ratios():
    """mone_llama3_2_1b: samples of 2 to 8 segments (1K-4K at T = 512), seq_len 8 segments,
    16 per step, MoNe in all 16 blocks with the paper's LoRA, 86.4M added parameters (meta)."""
    from train_configs.backbone import mone_llama3_2_1b

    config = mone_llama3_2_1b()
    graft = config.model_spec.model.model.graft
    segment = graft.memory.segment
    assert [int(n) for n in config.dataloader.lengths.split(",")] == [n * segment for n in range(2, 9)]
    assert config.training.seq_len == 8 * segment and config.training.global_batch_size == 16
    assert graft.lora == MONE_LORA and graft.layers == "all"
    with torch.device("meta"):
        model = config.model_spec.model.build()
    assert sum(isinstance(b, MoNeBlock) for b in model.layers.values()) == 16
    assert round(sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6, 1) == 86.4
