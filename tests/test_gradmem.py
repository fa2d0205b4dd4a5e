"""GradMem (models/memory/gradmem.py, models/grafts/gradmem.py, torchtitan_ext/families/gradmem.py): the
second-order meta-gradient against finite differences and a plain per-sample reference
(float64), the first-order one against the reference with the inner gradient detached, batch
independence, the write lowering its loss, the read never seeing the context, causality, the
memory mattering, meta device, bad input, exact-match scoring against an independent greedy
decode, Table 1's Transformer baseline, the replication script's seed pooling, and training
through torchtitan on 1 and 2 processes."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

from conftest import load_script, REPO, train
from models.grafts.gradmem import GradMemLM, GradMemLMConfig
from models.memory.gradmem import GradMemConfig, gradmem_diagnostics
from torchtitan_ext.eval.gradmem_kv import exact_match
from torchtitan_ext.families.gradmem_loss import weighted_write_loss
from torchtitan_ext.data.synthetic_tasks import kv_pairs

VOCAB, N, R = 24, 11, 6  # context and read lengths of the test rows


def small(dtype=torch.float32, **gradmem) -> GradMemLM:
    torch.manual_seed(0)
    cfg = GradMemLMConfig(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, n_kv_heads=2, ffn_hidden=32,
                          gradmem=GradMemConfig(n_mem=3, **({"inner_lr": 0.5} | gradmem)))
    return GradMemLM(cfg).to(dtype)


def rows(batch: int, context: int = N, read: int = R, seed: int = 1):
    """tokens (B, context + read), positions restarting at the read, labels on the read's last 3 tokens."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, context + read), generator=g)
    positions = torch.cat([torch.arange(context), torch.arange(read)]).expand(batch, -1)
    labels = torch.full_like(tokens, -100)
    labels[:, -4:-1] = tokens[:, -3:]
    return tokens, positions, labels


def outer_loss(model, tokens, positions, labels, weight=0.5):
    logits, write_loss = model(tokens, positions)
    read = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return (read + weighted_write_loss(write_loss, labels, weight)) / (labels != -100).sum()


def plain_outer_loss(model, tokens, labels, weight=0.5, meta_gradient="second"):
    """The same objective written sample by sample from the paper's equations: K steps of
    M <- M - alpha grad L_write(M), L_write = mean NLL of the context after [M; c_<i]
    (WRITE head = LM head + Delta), then [M; read tokens] -> cross-entropy on the labels.
    meta_gradient "first": each inner gradient detached; "none": M_0 detached as well."""
    g = model.gradmem
    total, count = 0.0, (labels != -100).sum()
    for b in range(tokens.shape[0]):
        context, read = tokens[b : b + 1, :N], tokens[b : b + 1, N:]
        memory = g.memory_init[None]
        if meta_gradient == "none":
            memory = memory.detach().requires_grad_()
        for _ in range(g.cfg.write_steps):
            x = torch.cat([memory, model.tok_embeddings(context)], 1)
            h = model.decode(x, torch.arange(x.shape[1])[None])[:, g.cfg.n_mem - 1 : -1]
            logits = F.linear(h, model.lm_head.weight + g.memory_write_head)
            write = F.cross_entropy(logits[0], context[0])
            (grad,) = torch.autograd.grad(write, memory, create_graph=True)
            if meta_gradient != "second":
                grad = grad.detach()
            memory = memory - g.cfg.inner_lr * grad
        x = torch.cat([memory, model.tok_embeddings(read)], 1)
        logits = model.lm_head(model.decode(x, torch.arange(x.shape[1])[None]))[0, g.cfg.n_mem:]
        answer = labels[b, N:]
        total = total + F.cross_entropy(logits, answer, ignore_index=-100, reduction="sum")
        total = total + weight * write * (answer != -100).sum()
    return total / count


def test_meta_gradient_equals_a_plain_reference_and_finite_differences(float64):
    model = small(torch.float64)
    with torch.no_grad():  # a non-zero write head and memory so every path carries gradient
        model.gradmem.memory_write_head.normal_(std=0.1)
    tokens, positions, labels = rows(2)
    params = [p for p in model.parameters() if p.requires_grad]
    ours = torch.autograd.grad(outer_loss(model, tokens, positions, labels), params)
    with sdpa_kernel([SDPBackend.MATH]):  # fused attention has no double backward
        plain = torch.autograd.grad(plain_outer_loss(model, tokens, labels), params)
    for a, b in zip(ours, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    # Finite differences on entries of M_0, an attention weight, the embeddings and the write head.
    named = dict(model.named_parameters())
    grads = dict(zip([n for n, p in model.named_parameters() if p.requires_grad], ours))
    checked = 0
    for name in ("gradmem.memory_init", "layers.0.attention.wq.weight", "tok_embeddings.weight",
                 "gradmem.memory_write_head", "layers.1.feed_forward.w2.weight"):
        for index in ((0, 1), (2, 3)):
            p, eps = named[name], 1e-6
            with torch.no_grad():
                p[index] += eps
                up = outer_loss(model, tokens, positions, labels).item()
                p[index] -= 2 * eps
                down = outer_loss(model, tokens, positions, labels).item()
                p[index] += eps
            assert abs((up - down) / (2 * eps) - grads[name][index].item()) < 1e-6, name
            checked += abs(grads[name][index].item()) > 1e-6
    assert checked >= 8  # the checked entries carry gradient


@pytest.mark.parametrize("meta_gradient", ["first", "none"])
def test_first_order_meta_gradient_equals_a_reference_that_detaches_the_inner_gradient(float64, meta_gradient):
    """Table 1's "w/o meta-learning" (meta_gradient "first"; "none" also detaches M_0): every
    trainable tensor's outer gradient equals the plain reference with the inner gradient
    detached within 1e-10, and differs from the second-order gradient (the second-order
    terms are really dropped, and really there by default)."""
    model = small(torch.float64, write_steps=2, meta_gradient=meta_gradient)
    with torch.no_grad():
        model.gradmem.memory_write_head.normal_(std=0.1)
    tokens, positions, labels = rows(2)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    ours = torch.autograd.grad(outer_loss(model, tokens, positions, labels), params, allow_unused=True)
    with sdpa_kernel([SDPBackend.MATH]):
        plain = torch.autograd.grad(plain_outer_loss(model, tokens, labels, meta_gradient=meta_gradient), params,
                                    allow_unused=True)
        second = torch.autograd.grad(plain_outer_loss(model, tokens, labels), params)
    for name, a, b in zip(names, ours, plain):
        if b is None:  # M_0 under "none": no outer gradient in the reference, none or zero in ours
            assert name == "gradmem.memory_init" and meta_gradient == "none" and (a is None or not a.any())
            continue
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=name)
    grads = dict(zip(names, ours))
    if meta_gradient == "first":  # M_0 still trains, through the identity path
        assert grads["gradmem.memory_init"].abs().max() > 1e-6
    differs = [n for n, a, b in zip(names, ours, second) if a is not None and (a - b).abs().max() > 1e-6]
    assert "layers.0.attention.wq.weight" in differs and "tok_embeddings.weight" in differs, differs


def test_first_order_write_is_the_second_order_one_at_evaluation():
    """The mode changes only the outer gradient: without gradients the written memory is the same."""
    context = torch.randint(0, VOCAB, (2, N), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        memories = [small(meta_gradient=mode).write(context, torch.full((2,), N))[0] for mode in ("second", "first")]
    torch.testing.assert_close(memories[0], memories[1], rtol=0, atol=0)


@pytest.mark.parametrize("write", ["gradient", "forward"])
def test_a_samples_memory_is_the_same_alone_and_in_a_batch(write):
    model = small(write=write)
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([N, 5, 8, 2])
    context = torch.randint(0, VOCAB, (4, N), generator=g)
    with torch.no_grad():
        batch, _ = model.write(context, lengths)
        for b in range(4):
            alone, _ = model.write(context[b : b + 1, : lengths[b]], lengths[b : b + 1])
            torch.testing.assert_close(alone[0], batch[b], rtol=0, atol=1e-6)
    assert (batch[0] - batch[1]).abs().max() > 1e-4  # and the memories differ by context


def test_more_write_steps_lower_the_write_loss_and_the_diagnostics_say_so():
    model = small(inner_lr=0.2)
    context = torch.randint(0, VOCAB, (3, N), generator=torch.Generator().manual_seed(4))
    lengths = torch.full((3,), N)
    with torch.no_grad():
        start = model.write_loss(model.gradmem.initial(3), context, lengths)
        after = [model.write_loss(model.write(context, lengths, k)[0], context, lengths) for k in (1, 2, 4, 8)]
        _, inner = model.write(context, lengths, 4)
    torch.testing.assert_close(inner[0], start)  # the first inner loss is the loss of M_0
    for before, later in zip([start, *after], after):
        assert (later < before).all()
    stats = gradmem_diagnostics(model)  # of the last write (K = 4)
    assert stats["memory/gradmem/write_loss_first"] == pytest.approx(start.mean().item())
    assert stats["memory/gradmem/write_loss_last"] == pytest.approx(inner[-1].mean().item())
    assert stats["memory/gradmem/update_ratio"] > 0


def test_the_read_never_sees_the_context():
    """Changing the context after the write leaves the read's logits unchanged; before the
    write it changes them (only through the memory)."""
    model = small()
    tokens, positions, _ = rows(2)
    other = tokens.clone()
    other[:, : N - 1] = (other[:, : N - 1] + 5) % VOCAB
    with torch.no_grad():
        logits, _ = model(tokens, positions)
        memory, _ = model.write(tokens[:, :N], torch.full((2,), N))
        with pytest.MonkeyPatch.context() as patch:  # the context changes after the write
            patch.setattr(model, "write", lambda *a, **k: (memory, torch.zeros(1, 2)))
            after, _ = model(other, positions)
        before, _ = model(other, positions)  # the context changes before the write
    torch.testing.assert_close(after[:, N:], logits[:, N:], rtol=0, atol=0)
    torch.testing.assert_close(model.read(memory, tokens[:, N:]), logits[:, N:], rtol=0, atol=1e-6)
    assert (before[:, N:] - logits[:, N:]).abs().max() > 1e-4
    assert logits[:, :N].abs().max() == 0  # the context's positions carry nothing


def test_causal_in_the_read():
    model = small()
    tokens, positions, _ = rows(2)
    changed = tokens.clone()
    t = N + 3
    changed[:, t] = (changed[:, t] + 1) % VOCAB
    with torch.no_grad():
        a, wa = model(tokens, positions)
        b, wb = model(changed, positions)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=0)
    torch.testing.assert_close(wa, wb, rtol=0, atol=0)
    assert (a[:, t:] - b[:, t:]).abs().max() > 1e-5


@pytest.mark.parametrize("write", ["gradient", "forward"])
def test_the_written_memory_is_read(write):
    """The read depends on the written memory: M_K differs from M_0 and reading M_0 instead
    changes the logits; every memory parameter gets gradient."""
    model = small(write=write, memory_projection=True)
    tokens, positions, labels = rows(2)
    with torch.no_grad():
        memory, _ = model.write(tokens[:, :N], torch.full((2,), N))
        written = model.read(memory, tokens[:, N:])
        unwritten = model.read(model.gradmem.initial(2), tokens[:, N:])
    assert (memory - model.gradmem.initial(2)).abs().max() > 1e-4
    assert (written - unwritten).abs().max() > 1e-4
    outer_loss(model, tokens, positions, labels).backward()
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in model.gradmem.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("write", ["gradient", "forward"])
def test_write_and_read_on_the_meta_device_with_a_float32_memory(write, dtype):
    with torch.device("meta"):
        model = small(write=write).to(dtype)
        context, query = torch.randint(0, VOCAB, (2, N)), torch.randint(0, VOCAB, (2, R))
        memory, losses = model.write(context, torch.tensor([N, 4]))
        logits = model.read(memory, query)
        (logits.float().logsumexp(-1).mean() + losses.sum()).backward()
    assert memory.dtype == torch.float32 and memory.device.type == "meta" and logits.dtype == dtype
    assert all(p.grad is not None and p.grad.device.type == "meta" for p in model.gradmem.parameters())


def test_bad_config_and_rows_are_one_line_errors():
    for fields, message in (({"write_steps": 0}, "K >= 1"), ({"n_mem": 0}, "m >= 1"), ({"write": "x"}, "unknown"),
                            ({"inner_lr": 0.0}, "positive"), ({"meta_gradient": "third"}, "meta_gradient")):
        with pytest.raises(ValueError, match=message):
            GradMemConfig(**fields)
    model = small()
    tokens, _, _ = rows(1)
    with pytest.raises(ValueError, match="restart at 0 where the query starts"):
        model(tokens, torch.arange(tokens.shape[1])[None])
    with pytest.raises(NotImplementedError, match="write"):
        model.stream(tokens)


def test_exact_match_scores_the_models_own_greedy_answers_from_the_memory():
    """exact_match (batched by query length, contexts of 1-6 pairs padded together, K passed
    at call time) against an independent per-sample greedy decode through the model's
    training forward ([context | query + answer so far], positions restarting at the query,
    K set in the config): samples whose gold value is the model's own answer score 1, the
    others 0. The model is scrambled (weights N(0, 0.3), alpha 5) so its answers depend on the
    context."""
    from torchtitan_ext.families.gradmem import model_config
    from torchtitan_ext.data.kv_tokenizer import build
    from torchtitan_ext.data.synthetic_tasks import Sample
    from torchtitan_ext.data.tokenizer import AssetsTokenizer

    tokenizer = AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=str(build()))
    torch.manual_seed(0)
    model = GradMemLM(model_config("kv_debug", gradmem={"inner_lr": 5.0, "write_steps": 1})).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(std=0.3)
    reference = GradMemLM(model_config("kv_debug", gradmem={"inner_lr": 5.0, "write_steps": 3})).eval()
    reference.load_state_dict(model.state_dict())
    drawn = [kv_pairs(random.Random(i), n) for i, n in enumerate([2, 5, 3, 6, 4, 1, 2, 3])]
    own = []
    for sample in drawn:  # greedy, one sample at a time, through forward
        context = tokenizer.encode(sample.context, add_bos=True, add_eos=False)
        read = tokenizer.encode(sample.query, add_bos=False, add_eos=False)
        for _ in range(2):
            row = torch.tensor([context + read])
            positions = torch.cat([torch.arange(len(context)), torch.arange(len(read))])[None]
            with torch.no_grad():
                logits, _ = reference(row, positions)
            read.append(int(logits[0, -1].argmax()))
        own.append(tokenizer.decode(read[-2:]))
    assert len(set(own)) > 4, own  # the answers vary with the context
    gold = [answer if i % 2 == 0 else s.answers[0] for i, (s, answer) in enumerate(zip(drawn, own))]
    samples = [Sample(s.context, s.query, [g]) for s, g in zip(drawn, gold)]
    expected = [float(g == answer) for g, answer in zip(gold, own)]
    assert expected[0::2] == [1.0] * 4 and sum(expected[1::2]) == 0, (own, gold)
    assert exact_match(model, tokenizer, samples, steps=3) == expected


PREFLIGHT = ["--module", "train_configs.gradmem", "--config", "gradmem_kv_debug"]


@pytest.mark.parametrize("args, message", [
    (["--compile.enable"], "torch.compile"),
    (["activation-checkpoint:full"], "activation-checkpoint:none"),
    (["--dataloader.no-split-context"], "split_context"),
    (["--training.seq_len", "30"], "8 key-value pairs takes"),
    (["--training.seq_len", "1020"], "exceeds the model's max_seq_len"),
])
def test_options_the_write_loop_cannot_take_are_refused(args, message, capsys):
    """The launcher's checks, run in this process (test_preflight.py runs them as a command)."""
    from test_preflight import environment_error

    assert message in environment_error(capsys, PREFLIGHT + args)


@pytest.mark.slow
def test_trains_through_torchtitan_and_one_and_two_processes_agree(tmp_path):
    """From one seed checkpoint, 4 steps of gradmem_kv_debug on 1 process and on 2 (DDP, the
    same global batch of 4 split 2 + 2): losses within 1e-4. Then eval_tasks.py --mode gradmem
    scores the two checkpoints under one label as two seeds (pooled over both, each seed's
    scores kept) per K x pairs, and refuses K = 0 and rows past the model's context (exit 2,
    nothing written)."""
    import json
    import shutil

    args = ["--module", "train_configs.gradmem", "--config", "gradmem_kv_debug", "--training.steps", "4",
            "--validator.freq", "4", "--training.global_batch_size", "4"]  # 2 ranks: 2 rows each
    one, two = tmp_path / "one", tmp_path / "two"
    seed = train(args + ["--dump_folder", str(one), "--checkpoint.create-seed-checkpoint"])
    assert seed.returncode == 0, seed
    shutil.copytree(one, two)
    single = train(args + ["--dump_folder", str(one)])
    double = train(args + ["--dump_folder", str(two)], nproc=2)
    assert single.returncode == 0 and double.returncode == 0, (single, double)
    assert "local batch 4 -> 2 sequences to fit the global batch of 4 on 2 ranks" in double.output
    assert max(abs(single.losses[s] - double.losses[s]) / single.losses[s] for s in single.losses) < 1e-4

    eval_main = load_script("eval_tasks").main

    def scored(out: str, pairs: str = "4,8", steps: str = "1,3") -> None:
        argv = []
        for run in (one, two):
            argv += ["--checkpoint", str(run / "checkpoint" / "step-4"), "--config",
                     "train_configs.gradmem:gradmem_kv_debug", "--mode", "gradmem", "--label", "kv_debug"]
        eval_main(argv + ["--pairs", pairs, "--write-steps", steps, "--samples", "8", "--out", str(tmp_path / out)])

    scored("eval")
    results = json.loads((tmp_path / "eval" / "gradmem.json").read_text())
    assert [(r["k"], r["seeds"], [c["pairs"] for c in r["cells"]]) for r in results["rows"]] == [(1, 2, [4, 8]),
                                                                                                  (3, 2, [4, 8])]
    for cell in (c for r in results["rows"] for c in r["cells"]):
        scores = [x for seed in cell["scores_per_seed"] for x in seed]
        assert len(scores) == 16 and set(scores) <= {0.0, 1.0} and cell["em"] == pytest.approx(sum(scores) / 16)
        assert cell["ci"][0] <= cell["em"] <= cell["ci"][1] and len(cell["summary"]["per_seed"]) == 2
    for bad_input in ({"steps": "0"}, {"pairs": "200"}):  # K = 0; rows of 1,409 tokens past max_seq_len 1,024
        with pytest.raises(SystemExit) as bad:
            scored("bad", **bad_input)
        assert bad.value.code == 2 and not (tmp_path / "bad").exists()


def test_the_replication_script_runs_the_paper_texts_first_order_setting_and_pools_seeds(tmp_path):
    """replicate_gradmem_kv.py with a first-order method, the paper text's outer loss (write
    weight 0) and the memory projection, 2 seeds of 3 steps: each cell pools both seeds'
    per-sample scores (seeds-then-samples interval, each seed's figure in the table); a bad
    method is refused with exit 2."""
    import json

    replicate = load_script("replicate_gradmem_kv").main

    out = tmp_path / "out"
    replicate(["--out", str(out), "--seeds", "0,1", "--methods", "gradient:1:1.0:first", "--stages", "1",
               "--steps", "3", "--batch", "4", "--warmup", "1", "--samples", "4", "--eval-pairs", "1,2",
               "--eval-k", "1", "--write-weight", "0", "--projection"])
    results = json.loads((out / "results.json").read_text())
    assert (results["write_weight"], results["projection"], results["samples"]) == (0.0, True, 4)
    (row,) = results["rows"]
    assert (row["meta_gradient"], row["seeds"], row["label"]) == ("first", 2, "trained with K=1, alpha 1.0, first order")
    for cell in row["cells"]:
        assert [len(s) for s in cell["scores_per_seed"]] == [4, 4]
        assert cell["em"] == pytest.approx(sum(map(sum, cell["scores_per_seed"])) / 8)
        assert [s["value"] for s in cell["summary"]["per_seed"]] == [sum(s) / 4 for s in cell["scores_per_seed"]]
    assert "; seeds " in (out / "results.md").read_text() and (out / "gradmem_kv.png").is_file()
    with pytest.raises(SystemExit) as bad:
        replicate(["--out", str(tmp_path / "bad"), "--methods", "gradient:1:1.0:third"])
    assert bad.value.code == 2 and not (tmp_path / "bad").exists()


@pytest.mark.parametrize("config", ["gradmem_kv", "gradmem_kv_forward"])
def test_the_paper_configs_take_table_1s_largest_rows(config):
    """The paper's KV-retrieval configs pass preflight at the last curriculum stage (96 pairs,
    input rows of 7 x 96 + 9 = 681 tokens behind m = 8 memory vectors), and the paper's model
    (4 layers, dim 128, K = 2 / the forward write) writes and reads such rows forward and
    backward on the meta device."""
    from test_preflight import preflight_code
    from torchtitan_ext.families.gradmem import model_config
    from train_configs.gradmem import kv_row

    stage = ["--dataloader.pairs", "96", "--validator.dataloader.pairs", "96", "--training.seq_len", str(kv_row(96))]
    assert preflight_code(PREFLIGHT[:-1] + [config] + stage) == 0
    write = "forward" if config.endswith("forward") else "gradient"
    context, read = 7 * 96 + 2, 7  # BOS + 96 pairs + "|"; "?!kk:" + the 2-character value
    with torch.device("meta"):
        model = GradMemLM(model_config("kv", gradmem={"write": write}))
        memory, losses = model.write(torch.randint(0, 70, (2, context)), torch.tensor([context, context]))
        logits = model.read(memory, torch.randint(0, 70, (2, read)))
        (logits.logsumexp(-1).mean() + losses.sum()).backward()
    assert memory.shape == (2, 8, 128) and logits.shape == (2, read, 70)
    assert all(p.grad is not None for p in model.gradmem.parameters())


def test_the_transformer_baseline_reads_the_context_with_full_attention_and_trains():
    """gradmem_kv_transformer (Table 1's Transformer, M = KV-cache): the GradMem KV model's
    Llama shape with no memory (4 layers, 4 heads, dim 128, FFN 512, tied, 70 tokens; RoPE
    theta 10,000 unscaled), rows [BOS context query answer] as one document (positions
    0..L-1, loss on the answer); changing the context moves the answer's logits (the query
    attends to it), and 30 AdamW steps on its 4-pair rows lower the answer loss. Its preflight
    passes at Table 1's largest stage (96 pairs)."""
    from models.backbones.decoder_lm import DecoderLM
    from test_preflight import preflight_code
    from torchtitan_ext.data.kv_tokenizer import build
    from torchtitan_ext.data.task_data import TaskDataset
    from torchtitan_ext.data.tokenizer import AssetsTokenizer
    from train_configs.gradmem import gradmem_kv_transformer, kv_row

    config = gradmem_kv_transformer()
    cfg = config.model_spec.model.model
    assert (type(cfg).__name__, cfg.n_layers, cfg.n_heads, cfg.dim, cfg.ffn_hidden, cfg.vocab_size, cfg.rope_scaling,
            cfg.rope_theta) == ("DecoderLMConfig", 4, 4, 128, 512, 70, None, 10_000.0)
    loader = config.dataloader
    assert (loader.split_context, loader.question, config.training.seq_len) == (False, "continue", kv_row(4))
    tokenizer = AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=str(build()))
    data = iter(TaskDataset(["kv_retrieval"], tokenizer, kv_row(4), 0, False, True, 0, 0, 1, pairs=(4,),
                            question=loader.question))
    torch.manual_seed(0)
    model = DecoderLM(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(30):
        items = [next(data) for _ in range(16)]
        tokens, positions = (torch.stack([x[key] for x, _ in items]) for key in ("input", "positions"))
        labels = torch.stack([y for _, y in items])
        assert (positions == torch.arange(kv_row(4))).all()  # one document: the query follows the context
        loss = F.cross_entropy(model(tokens, positions).flatten(0, 1), labels.flatten(), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5, losses
    answer = int((labels[0] != -100).nonzero()[0])  # the first answer prediction, after the query
    changed = tokens[:1].clone()
    changed[0, 1:answer - 5] = torch.roll(changed[0, 1:answer - 5], 7)  # the context's characters, not the query's
    with torch.no_grad():
        moved = (model(changed, positions[:1]) - model(tokens[:1], positions[:1]))[0, answer].abs().max()
    assert moved > 1e-3
    stage = ["--dataloader.pairs", "96", "--validator.dataloader.pairs", "96", "--training.seq_len", str(kv_row(96))]
    assert preflight_code(PREFLIGHT[:-1] + ["gradmem_kv_transformer"] + stage) == 0


WRITE_AND_READ_IN_PLAIN_TRANSFORMERS = """
import sys, torch
from transformers import AutoModelForCausalLM
folder, inputs, out = sys.argv[1:4]
context, lengths, query = torch.load(inputs)
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
memory, _ = model.model.write(context, lengths)
with torch.no_grad():
    torch.save({"logits": model.model.read(memory, query),
                "project": [m for m in sys.modules if m.split('.')[0] in ('models', 'torchtitan_ext')]}, out)
"""


@pytest.mark.slow
def test_a_grafted_finetune_from_hugging_face_keeps_the_backbone_and_exports(tmp_path):
    """Through scripts/train.sh from a random tiny Qwen3 folder, GradMem + LoRA on KV-retrieval
    rows with the context removed at read time: 6 steps lower the loss (12.2 -> 11.3, measured
    2026-11-30); the write's diagnostics reach the console; every backbone tensor of the step-6 checkpoint is the
    Hugging Face file's bit for bit, the optimizer holds only the LoRA and memory tensors, and
    the zero-initialised ones (LoRA's B, the write head's Delta) moved; the remote-code export
    reloads in a Python without the project and reproduces the native write + read within 1e-5."""
    import site

    from graft_checks import trained_from_hf
    from test_backbone import qwen3_debug_checkpoint
    from test_hf import run_script

    config = ["--module", "train_configs.gradmem", "--config", "gradmem_qwen3_debug_tasks"]
    qwen3_debug_checkpoint(tmp_path / "hf")
    run = train(config + ["--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(tmp_path / "hf"),
                          "--validator.no-enable", "--training.steps", "6", "--checkpoint.interval", "6",
                          "--dump_folder", str(tmp_path / "run")])
    assert run.returncode == 0, run
    assert run.losses[6] < run.losses[1] - 0.1, run.losses
    summaries = [line for line in run.output.splitlines() if " - memory: " in line]
    assert summaries and all(f"{name}: " in summaries[-1]
                             for name in ("update_ratio", "write_loss_first", "write_loss_last"))
    step = tmp_path / "run" / "checkpoint" / "step-6"
    model = trained_from_hf("gradmem_qwen3_debug_tasks", step, tmp_path / "hf", "train_configs.gradmem")
    state = model.state_dict()  # zero-initialised graft tensors all moved: LoRA's B factors and the write head's Delta
    assert min(state[k].abs().max() for k in state if ".lora_B." in k or k.endswith("memory_write_head")) > 0

    assert run_script("convert_to_hf.py", *config, "--checkpoint", step, "--out", tmp_path / "export") == 0
    g = torch.Generator().manual_seed(2)
    context, lengths, query = torch.randint(0, 4096, (2, 20), generator=g), torch.tensor([20, 13]), torch.randint(
        0, 4096, (2, 6), generator=g)
    torch.save((context, lengths, query), tmp_path / "inputs.pt")
    env = {"PATH": __import__("os").environ["PATH"], "PYTHONPATH": site.getsitepackages()[0], "HF_HUB_OFFLINE": "1"}
    child = subprocess.run([sys.executable, "-S", "-c", WRITE_AND_READ_IN_PLAIN_TRANSFORMERS, str(tmp_path / "export"),
                            str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    hf = torch.load(tmp_path / "out.pt")
    assert hf["project"] == []
    memory, _ = model.write(context, lengths)
    with torch.no_grad():
        native = model.read(memory, query)
    assert (hf["logits"] - native).abs().max() < 1e-5


def test_the_lm_builds_its_memory_through_the_graft_table(monkeypatch):
    """GradMem is the "gradmem" row of models/grafts/graft.py's GRAFT_KINDS (trained, held by
    an LM of its own): GradMemLM builds its memory through that row, with its config."""
    import dataclasses

    from models.grafts import graft
    from models.memory.gradmem import GradMem

    row, built = graft.GRAFT_KINDS["gradmem"], []

    def recording(dim, vocab_size, cfg):
        built.append((dim, vocab_size, cfg))
        return row.build(dim, vocab_size, cfg)

    assert row.form == "trained_lm" and row.config is GradMemConfig and row.build is GradMem
    monkeypatch.setitem(graft.GRAFT_KINDS, "gradmem", dataclasses.replace(row, build=recording))
    model = small()
    assert built == [(16, VOCAB, model.cfg.gradmem)] and isinstance(model.gradmem, GradMem)
    assert isinstance(GradMemLMConfig(gradmem={"n_mem": 2}).gradmem, GradMemConfig)
