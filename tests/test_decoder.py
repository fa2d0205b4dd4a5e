"""The shared decoder block (models/layers/decoder.py) against a block written out here from
its definition, in float64, for both RoPE layouts and the options the project's models use;
and the two RMSNorm roundings."""

from __future__ import annotations

import math

import pytest
import torch

from models.layers.decoder import DecoderBlock, RMSNorm

DIM, HEADS, KV_HEADS, THETA, EPS = 32, 4, 2, 10000.0, 1e-5
CASES = {  # DecoderBlock options; "packed": two documents in the row
    "pairs_swiglu_gated_packed": dict(rope="pairs", gated=True, packed=True),
    "pairs_relu_mlp": dict(rope="pairs", ffn="relu", packed=False),
    "halves_qwen_options_packed": dict(rope="halves", head_dim=12, qkv_bias=True, qk_norm=True, hf_norm=True,
                                       packed=True),
    "halves_gelu_mlp": dict(rope="halves", ffn="gelu", packed=False),
}


def rms(v: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return v / torch.sqrt((v * v).mean(-1, keepdim=True) + EPS) * weight


def rotate(t: torch.Tensor, positions: list[int], layout: str) -> torch.Tensor:
    """t (L, n, d) at positions: pairs (2i, 2i+1) or (i, i + d/2) turn by position * theta^(-2i/d).
    Hugging Face's layout rounds the frequencies theta^(-2i/d) to float32, as transformers'
    inv_freq (a float64 block keeps those values: the angles are then float64)."""
    length, _, d = t.shape
    out = t.clone()
    for s in range(length):
        for i in range(d // 2):
            frequency = THETA ** (-2 * i / d)
            if layout == "halves":
                exponent = torch.tensor(2 * i / d, dtype=torch.float32)
                frequency = (1.0 / torch.tensor(THETA, dtype=torch.float32) ** exponent).item()
            angle = positions[s] * frequency
            cos, sin = math.cos(angle), math.sin(angle)
            a, b = (2 * i, 2 * i + 1) if layout == "pairs" else (i, i + d // 2)
            out[s, :, a] = t[s, :, a] * cos - t[s, :, b] * sin
            out[s, :, b] = t[s, :, b] * cos + t[s, :, a] * sin
    return out


def reference_block(w: dict, x: torch.Tensor, positions: list[int], layout: str, ffn: str) -> torch.Tensor:
    """One row x (L, dim) through the block of state dict w: token s attends to the tokens
    t <= s of its document (positions restart at 0 per document)."""
    length = x.shape[0]
    d = w["attention.wk.weight"].shape[0] // KV_HEADS

    def linear(name, v):
        out = v @ w[f"{name}.weight"].T
        return out + w[f"{name}.bias"] if f"{name}.bias" in w else out

    xn = rms(x, w["attention_norm.weight"])
    q, k, v = (linear(f"attention.w{p}", xn).view(length, -1, d) for p in "qkv")
    if "attention.q_norm.weight" in w:
        q, k = rms(q, w["attention.q_norm.weight"]), rms(k, w["attention.k_norm.weight"])
    q, k = rotate(q, positions, layout), rotate(k, positions, layout)
    document = torch.tensor(positions).eq(0).cumsum(0)
    out = torch.zeros_like(q)
    for s in range(length):
        keys = [t for t in range(s + 1) if document[t] == document[s]]
        for h in range(HEADS):
            g = h // (HEADS // KV_HEADS)
            p = torch.softmax(torch.stack([q[s, h] @ k[t, g] for t in keys]) / math.sqrt(d), 0)
            out[s, h] = sum(p_t * v[t, g] for p_t, t in zip(p, keys))
    out = out.reshape(length, -1)
    if "attention.wg.weight" in w:
        out = out * torch.sigmoid(linear("attention.wg", xn))
    h = x + linear("attention.wo", out)
    hn = rms(h, w["ffn_norm.weight"])
    if ffn == "swiglu":
        inner = torch.nn.functional.silu(linear("feed_forward.w1", hn)) * linear("feed_forward.w3", hn)
    else:
        inner = {"relu": torch.relu, "gelu": torch.nn.functional.gelu}[ffn](linear("feed_forward.w1", hn))
    return h + linear("feed_forward.w2", inner)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_block_equals_its_written_out_definition_in_float64(case, traced, monkeypatch):
    """Eagerly, and on the path torch.compile traces (q/k/v as one matmul, `project_together`)."""
    import models.layers.tracing

    monkeypatch.setattr(models.layers.tracing, "compiling", lambda: traced)
    options = dict(CASES[case])
    packed, layout, ffn = options.pop("packed"), options["rope"], options.get("ffn", "swiglu")
    torch.manual_seed(0)
    block = DecoderBlock(DIM, HEADS, KV_HEADS, 48, THETA, EPS, **options).double()
    with torch.no_grad():
        for name, p in block.named_parameters():  # norms away from one, biases away from zero
            p.copy_(torch.randn_like(p) * 0.3 + ("norm" in name))
    lengths = (9, 12) if packed else (21,)
    positions = [t for n in lengths for t in range(n)]
    x = torch.randn(2, sum(lengths), DIM, dtype=torch.float64)
    rows = torch.tensor(positions).expand(2, -1)
    with torch.no_grad():
        ours = block(x, rows, rows if packed else None)
        weights = block.state_dict()
        expected = torch.stack([reference_block(weights, row, positions, layout, ffn) for row in x])
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-12)


def test_the_traced_stacked_projection_keeps_a_lora_adapters_path(monkeypatch):
    """Traced by torch.compile, q/k/v (and W_g) run as one matmul over stacked weights, unless one is
    a LoRALinear: its low-rank path is not in its `weight` (float64, a non-zero B)."""
    import models.layers.tracing
    from models.grafts.lora import LoRAConfig, LoRALinear

    torch.manual_seed(0)
    block = DecoderBlock(DIM, HEADS, KV_HEADS, 48, THETA, EPS, gated=True).double()
    attention = block.attention
    attention.wk = LoRALinear(attention.wk, LoRAConfig(rank=2, alpha=4.0, dropout=0.0))
    with torch.no_grad():
        attention.wk.lora_B.weight.normal_()
    x, positions = torch.randn(2, 9, DIM, dtype=torch.float64), torch.arange(9)
    outputs = []
    for traced in (False, True):
        monkeypatch.setattr(models.layers.tracing, "compiling", lambda: traced)
        with torch.no_grad():
            outputs.append(block(x, positions))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=1e-12)
    with torch.no_grad():
        attention.wk.lora_B.weight.zero_()
        assert (block(x, positions) - outputs[0]).abs().max() > 1e-3  # the adapter's path mattered


def test_the_two_rmsnorm_roundings_agree_in_float32_and_round_as_written_in_bfloat16():
    """Both take float32 statistics: in float32 they agree; in bfloat16 transformers' casts the
    normalised x back before the weight, torch's kernel applies the weight first (one rounding);
    neither equals statistics taken in bfloat16."""
    torch.manual_seed(0)
    x = torch.randn(64, 256) * 3 + 1
    weight = 1 + 0.1 * torch.randn(256)
    torch_norm, hf_norm = RMSNorm(256, EPS), RMSNorm(256, EPS, hf=True)
    with torch.no_grad():
        for norm in (torch_norm, hf_norm):
            norm.weight.copy_(weight)
        torch.testing.assert_close(torch_norm(x), hf_norm(x), rtol=1e-6, atol=1e-6)
        expected = rms(x.double(), weight.double())
        for norm in (torch_norm, hf_norm):  # float64 stays float64
            torch.testing.assert_close(norm.double()(x.double()), expected, rtol=0, atol=1e-14)
        xb, wb = x.bfloat16(), weight.bfloat16()
        normalised = xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + EPS)
        cast_then_weight, weight_then_cast = wb * normalised.bfloat16(), (wb.float() * normalised).bfloat16()
        hf_out, torch_out = hf_norm.bfloat16()(xb), torch_norm.bfloat16()(xb)
        assert torch.equal(hf_out, cast_then_weight) and torch.equal(torch_out, weight_then_cast)
        assert not torch.equal(hf_out, torch_out)
        bf16_statistics = wb * (xb * torch.rsqrt(xb.pow(2).mean(-1, keepdim=True) + EPS))
        assert not torch.equal(bf16_statistics, hf_out) and not torch.equal(bf16_statistics, torch_out)
