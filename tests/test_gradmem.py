"""GradMem (models/memory/gradmem.py, models/lms/gradmem.py, torchtitan_ext/gradmem.py): the
second-order meta-gradient against finite differences and a plain per-sample reference
(float64), batch independence, the write lowering its loss, the read never seeing the context,
causality, the memory mattering, meta device, bad input, and training through torchtitan on
1 and 2 processes."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

from conftest import REPO, train
from models.lms.gradmem import GradMemLM, GradMemLMConfig
from models.memory.gradmem import GradMemConfig, gradmem_diagnostics
from torchtitan_ext.gradmem import exact_match, weighted_write_loss
from torchtitan_ext.synthetic_tasks import kv_pairs

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


def plain_outer_loss(model, tokens, labels, weight=0.5):
    """The same objective written sample by sample from the paper's equations: K steps of
    M <- M - alpha grad L_write(M), L_write = mean NLL of the context after [M; c_<i]
    (WRITE head = LM head + Delta), then [M; read tokens] -> cross-entropy on the labels."""
    g = model.gradmem
    total, count = 0.0, (labels != -100).sum()
    for b in range(tokens.shape[0]):
        context, read = tokens[b : b + 1, :N], tokens[b : b + 1, N:]
        memory = g.memory_init[None]
        for _ in range(g.cfg.write_steps):
            x = torch.cat([memory, model.tok_embeddings(context)], 1)
            h = model.decode(x, torch.arange(x.shape[1])[None])[:, g.cfg.n_mem - 1 : -1]
            logits = F.linear(h, model.lm_head.weight + g.memory_write_head)
            write = F.cross_entropy(logits[0], context[0])
            (grad,) = torch.autograd.grad(write, memory, create_graph=True)
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


def test_second_order_terms_are_not_dropped(float64):
    """A first-order write (inner gradient detached) gives another weight gradient: the test
    above would catch a write loop that lost its graph."""
    model = small(torch.float64)
    tokens, positions, labels = rows(2)
    weight = model.layers["0"].attention.wq.weight
    (full,) = torch.autograd.grad(outer_loss(model, tokens, positions, labels), [weight])
    original = torch.autograd.grad
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.autograd, "grad", lambda out, inputs, create_graph=False, **kw: tuple(
            g.detach() for g in original(out, inputs, create_graph=create_graph, **kw)))
        (first_order,) = original(outer_loss(model, tokens, positions, labels), [weight])
    assert (full - first_order).abs().max() > 1e-6


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
                            ({"inner_lr": 0.0}, "positive")):
        with pytest.raises(ValueError, match=message):
            GradMemConfig(**fields)
    model = small()
    tokens, _, _ = rows(1)
    with pytest.raises(ValueError, match="restart at 0 where the query starts"):
        model(tokens, torch.arange(tokens.shape[1])[None])
    with pytest.raises(NotImplementedError, match="write"):
        model.stream(tokens)


def test_answers_come_from_the_memory_alone(monkeypatch):
    """exact_match writes each context and answers from [memory; query]: a model whose read
    is told the value scores 1, and a different context cannot leak into the answer."""
    from torchtitan_ext.kv_tokenizer import build
    from torchtitan_ext.tokenizer import AssetsTokenizer

    tokenizer = AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=str(build()))
    samples = [kv_pairs(random.Random(i), 4) for i in range(3)]
    model = small()
    model.cfg.vocab_size = VOCAB
    generated = []

    def fake_generate(context, lengths, query, new_tokens, steps=None):
        generated.append((context.shape, query.shape, new_tokens, steps))
        return torch.tensor([tokenizer.encode(s.answers[0], add_bos=False, add_eos=False) for s in samples])

    monkeypatch.setattr(model, "generate", fake_generate)
    assert exact_match(model, tokenizer, samples, steps=5) == [1.0, 1.0, 1.0]
    assert generated == [((3, 30), (3, 5), 2, 5)]  # BOS + 4 x 7 + "|"; "?!kk:"


PREFLIGHT = [sys.executable, "-m", "torchtitan_ext.preflight", "--module", "train_configs.gradmem", "--config",
             "gradmem_kv_debug"]


@pytest.mark.parametrize("args, message", [
    (["--compile.enable"], "torch.compile"),
    (["activation-checkpoint:full"], "activation-checkpoint:none"),
    (["--dataloader.no-split-context"], "split_context"),
    (["--training.seq_len", "30"], "8 key-value pairs takes"),
    (["--training.seq_len", "1020"], "exceeds the model's max_seq_len"),
])
def test_options_the_write_loop_cannot_take_are_refused(args, message):
    proc = subprocess.run(PREFLIGHT + args, cwd=REPO, capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr[-2000:]


@pytest.mark.parametrize("config", ["gradmem_kv", "gradmem_kv_forward"])
def test_the_paper_configs_take_table_1s_largest_rows(config):
    """The paper's KV-retrieval configs pass preflight at the last curriculum stage (96 pairs,
    input rows of 7 x 96 + 9 = 681 tokens behind m = 8 memory vectors), and the paper's model
    (4 layers, dim 128, K = 2 / the forward write) writes and reads such rows forward and
    backward on the meta device."""
    from train_configs.gradmem import kv_row
    from torchtitan_ext.gradmem import model_config

    stage = ["--dataloader.pairs", "96", "--validator.dataloader.pairs", "96", "--training.seq_len", str(kv_row(96))]
    proc = subprocess.run(PREFLIGHT[:-1] + [config] + stage, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    write = "forward" if config.endswith("forward") else "gradient"
    context, read = 7 * 96 + 2, 7  # BOS + 96 pairs + "|"; "?!kk:" + the 2-character value
    with torch.device("meta"):
        model = GradMemLM(model_config("kv", gradmem={"write": write}))
        memory, losses = model.write(torch.randint(0, 70, (2, context)), torch.tensor([context, context]))
        logits = model.read(memory, torch.randint(0, 70, (2, read)))
        (logits.logsumexp(-1).mean() + losses.sum()).backward()
    assert memory.shape == (2, 8, 128) and logits.shape == (2, read, 70)
    assert all(p.grad is not None for p in model.gradmem.parameters())


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
    rows with the context removed at read time: 20 steps lower the loss; the write's
    diagnostics reach the console; every backbone tensor of the step-20 checkpoint is the
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
                          "--validator.no-enable", "--training.steps", "20", "--checkpoint.interval", "20",
                          "--dump_folder", str(tmp_path / "run")])
    assert run.returncode == 0, run
    assert run.losses[20] < run.losses[1] - 0.1, run.losses
    summaries = [line for line in run.output.splitlines() if " - memory: " in line]
    assert summaries and all(f"{name}: " in summaries[-1]
                             for name in ("update_ratio", "write_loss_first", "write_loss_last"))
    step = tmp_path / "run" / "checkpoint" / "step-20"
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
