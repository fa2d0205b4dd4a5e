"""torchtitan_ext.torch_compat: the mends that run torchtitan 0.3.0 on torch 2.11/2.12 besides the
pinned 2.13. Unit tests of the module-group split, the `fully_shard` wrapper (against a recording
fake) and `apply()` (the missing names faked away with monkeypatch), and a real FSDP2 run: a
1-rank gloo process group in a subprocess (no process group leaks into the pytest worker), a toy
decoder sharded as torchtitan's `apply_fsdp_to_decoder` shards it and trained with
ChunkedLossWrapper's chunked-loss flow, its losses and gradients against the same model in plain
torch. The reference shares no code with the module under test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as fsdp
from torch import nn

from torchtitan_ext import torch_compat

REPO = Path(__file__).resolve().parents[1]
PINNED_TORCH = torch.__version__ >= "2.13"


def _names(parts, named):
    by_id = {id(m): n for n, m in named.items()}
    return [[by_id[id(m)] for m in part] for part in parts]


# ---------------------------------------------------------------- split_by_shared_parameters


def test_split_by_shared_parameters_untied_modules_apart():
    named = {"emb": nn.Embedding(5, 4), "norm": nn.RMSNorm(4), "head": nn.Linear(4, 5, bias=False)}
    parts = torch_compat.split_by_shared_parameters(list(named.values()))
    assert _names(parts, named) == [["emb"], ["norm"], ["head"]]
    assert all(isinstance(part, list) for part in parts)


def test_split_by_shared_parameters_keeps_tied_parameters_together():
    """The group split keeps tied parameters together: torchtitan's tied
    [tok_embeddings, norm, lm_head] -> [tok_embeddings, lm_head] and [norm]."""
    emb, norm, head = nn.Embedding(5, 4), nn.RMSNorm(4), nn.Linear(4, 5, bias=False)
    head.weight = emb.weight
    named = {"emb": emb, "norm": norm, "head": head}
    assert _names(torch_compat.split_by_shared_parameters([emb, norm, head]), named) == [["emb", "head"], ["norm"]]
    # the part sits where its first module is
    assert _names(torch_compat.split_by_shared_parameters([norm, head, emb]), named) == [["norm"], ["head", "emb"]]
    # a module holding the tied module as a child shares its parameter too
    wrapper = nn.Sequential(head)
    named["wrapper"] = wrapper
    assert _names(torch_compat.split_by_shared_parameters([wrapper, norm, emb]), named) == [["wrapper", "emb"], ["norm"]]


def test_split_by_shared_parameters_chain_merges_in_order():
    """a shares p with b, b shares q with c: one part, even when b comes last and merges two
    parts found apart; other parts keep the order of their first module."""
    p, q = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3))
    a, b, c = nn.Module(), nn.Module(), nn.Module()
    a.w, b.w, b.v, c.v = p, p, q, q
    first, mid, last = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    named = {"a": a, "b": b, "c": c, "first": first, "mid": mid, "last": last}
    split = torch_compat.split_by_shared_parameters
    assert _names(split([a, b, c]), named) == [["a", "b", "c"]]
    assert _names(split([first, a, mid, c, b, last]), named) == [["first"], ["a", "c", "b"], ["mid"], ["last"]]
    assert _names(split([c, first, b, mid, a]), named) == [["c", "b", "a"], ["first"], ["mid"]]


def test_split_by_shared_parameters_parameterless_modules():
    relu, ident, lin = nn.ReLU(), nn.Identity(), nn.Linear(2, 2)
    named = {"relu": relu, "ident": ident, "lin": lin}
    assert _names(torch_compat.split_by_shared_parameters([relu, lin, ident]), named) == [["relu"], ["lin"], ["ident"]]
    assert torch_compat.split_by_shared_parameters([]) == []


# ---------------------------------------------------------------- fully_shard_untied_apart


@pytest.fixture
def recording():
    calls = []

    def fake_fully_shard(module, *args, **kwargs):
        """fake"""
        calls.append((module, args, kwargs))
        return ("sharded", module)

    return fake_fully_shard, calls


def _decoder_tail(tied: bool):
    emb, norm, head = nn.Embedding(5, 4), nn.RMSNorm(4), nn.Linear(4, 5, bias=False)
    if tied:
        head.weight = emb.weight
    return emb, norm, head


def test_fully_shard_untied_apart_single_module_passes_through(recording):
    fake, calls = recording
    wrapped = torch_compat.fully_shard_untied_apart(fake)
    assert wrapped.untied_apart is True and wrapped.__wrapped__ is fake
    assert wrapped.__name__ == "fake_fully_shard" and wrapped.__doc__ == "fake"
    model = nn.Linear(2, 2)
    assert wrapped(model, "mesh", reshard_after_forward=False) == ("sharded", model)
    assert len(calls) == 1
    assert calls[0][0] is model and calls[0][1] == ("mesh",) and calls[0][2] == {"reshard_after_forward": False}
    # a ModuleList is a module: straight through as well
    layers = nn.ModuleList([nn.Linear(2, 2)])
    wrapped(layers)
    assert calls[-1][0] is layers and len(calls) == 2


def test_fully_shard_untied_apart_shards_untied_list_apart(recording):
    fake, calls = recording
    wrapped = torch_compat.fully_shard_untied_apart(fake)
    _, norm, head = _decoder_tail(tied=False)
    modules = [norm, head]
    kwargs = {"mesh": "dp", "mp_policy": "mp", "reshard_after_forward": False}
    assert wrapped(modules, **kwargs) is modules  # the list itself, as torch returns it
    assert [c[0] for c in calls] == [norm, head]
    assert [c[0] is m for c, m in zip(calls, modules)] == [True, True]
    assert all(c[1] == () and c[2] == kwargs for c in calls)
    calls.clear()
    assert wrapped((norm, head), "dp") == (norm, head)  # any sequence, positional args too
    assert [(c[0], c[1]) for c in calls] == [(norm, ("dp",)), (head, ("dp",))]


def test_fully_shard_untied_apart_leaves_tied_modules_to_root(recording):
    fake, calls = recording
    wrapped = torch_compat.fully_shard_untied_apart(fake)
    emb, norm, head = _decoder_tail(tied=True)
    modules = [emb, norm, head]
    assert wrapped(modules, mesh="dp", reshard_after_forward=True) is modules
    assert len(calls) == 1
    assert calls[0][0] is norm and calls[0][2] == {"mesh": "dp", "reshard_after_forward": True}
    calls.clear()
    assert wrapped([emb, head]) == [emb, head] and calls == []  # nothing untied: all left to the root


# ---------------------------------------------------------------- apply


@pytest.mark.skipif(not PINNED_TORCH, reason="the pinned torch 2.13 has DataParallelMeshDims and completes groups")
def test_apply_on_pinned_torch_mends_nothing_of_fsdp():
    # importing torchtitan_ext applied every mend this torch needs: set_timeout only
    assert torch_compat.apply() == []
    assert torch_compat.groups_complete_from_root()
    assert fsdp.DataParallelMeshDims is not torch_compat.DataParallelMeshDimsStandIn
    assert not getattr(fsdp.fully_shard, "untied_apart", False)
    assert dist.set_timeout is dist.distributed_c10d._set_pg_timeout


def test_apply_aliases_set_timeout(monkeypatch):
    monkeypatch.delattr(dist, "set_timeout", raising=False)
    assert torch_compat.apply() == ["set_timeout"]
    assert dist.set_timeout is dist.distributed_c10d._set_pg_timeout
    assert torch_compat.apply() == []


def test_apply_installs_data_parallel_mesh_dims_stand_in(monkeypatch):
    original = getattr(fsdp, "DataParallelMeshDims", None)
    with monkeypatch.context() as m:
        m.delattr(fsdp, "DataParallelMeshDims", raising=False)
        assert torch_compat.apply() == ["DataParallelMeshDims"]
        from torch.distributed.fsdp import DataParallelMeshDims  # torchtitan's module-level import

        assert DataParallelMeshDims is torch_compat.DataParallelMeshDimsStandIn
        with pytest.raises(RuntimeError, match=r"--parallelism\.spmd_backend partial_dtensor") as info:
            DataParallelMeshDims(shard="fsdp")
        assert torch.__version__ in str(info.value)
        with pytest.raises(RuntimeError, match="DataParallelMeshDims"):
            DataParallelMeshDims()
        assert torch_compat.apply() == []
    assert getattr(fsdp, "DataParallelMeshDims", None) is original


def test_apply_wraps_fully_shard_once_where_groups_do_not_complete(monkeypatch):
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    original = fsdp.fully_shard
    had_completion = hasattr(FSDPState, "_force_complete_incomplete_states")
    with monkeypatch.context() as m:
        m.setattr(fsdp, "fully_shard", original)  # restored on exit whatever apply() puts there
        m.delattr(FSDPState, "_force_complete_incomplete_states", raising=False)
        assert not torch_compat.groups_complete_from_root()
        if getattr(original, "untied_apart", False):  # torch < 2.13: the import wrapped it already
            assert torch_compat.apply() == []
            assert fsdp.fully_shard is original
            unwrapped = original.__wrapped__
            m.setattr(fsdp, "fully_shard", unwrapped)
        else:
            unwrapped = original
        assert torch_compat.apply() == ["fully_shard_untied_apart"]
        wrapped = fsdp.fully_shard
        assert wrapped is not unwrapped and wrapped.untied_apart and wrapped.__wrapped__ is unwrapped
        assert torch_compat.apply() == []  # not twice
        assert fsdp.fully_shard is wrapped and wrapped.__wrapped__ is unwrapped
        from torch.distributed.fsdp import fully_shard  # what torchtitan binds at import

        assert fully_shard is wrapped
    assert fsdp.fully_shard is original
    assert hasattr(FSDPState, "_force_complete_incomplete_states") == had_completion
    assert torch_compat.groups_complete_from_root() == had_completion


def test_apply_lets_create_block_mask_take_separate_full_blocks_where_it_does_not(monkeypatch):
    from torch.nn.attention import flex_attention

    calls = []

    def older_create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cuda", BLOCK_SIZE=128):  # torch 2.11's keywords
        calls.append((Q_LEN, KV_LEN, device, BLOCK_SIZE))
        return "mask"

    real = flex_attention.create_block_mask
    assert "separate_full_blocks" in __import__("inspect").signature(real).parameters or \
        getattr(real, "drops_separate_full_blocks", False)
    with monkeypatch.context() as m:
        m.setattr(flex_attention, "create_block_mask", older_create_block_mask)
        assert torch_compat.apply() == ["create_block_mask_without_separate_full_blocks"]
        wrapped = flex_attention.create_block_mask
        # torchtitan's call outside batch-invariant mode: the keyword dropped, the rest passed on
        assert wrapped(None, 2, None, 64, 64, device="cpu", BLOCK_SIZE=32, separate_full_blocks=True) == "mask"
        assert calls == [(64, 64, "cpu", 32)]
        with pytest.raises(RuntimeError, match=r"torch >= 2\.13"):
            wrapped(None, 2, None, 64, 64, separate_full_blocks=False)  # batch-invariant mode: no silent change
        assert len(calls) == 1
        assert torch_compat.apply() == [] and flex_attention.create_block_mask is wrapped  # not twice
    assert flex_attention.create_block_mask is real


@pytest.mark.skipif(not PINNED_TORCH, reason="torch 2.13 flattens a mask_mod's captured tensors out of the structure")
def test_block_masks_of_different_batches_flatten_alike_on_pinned_torch():
    assert torch_compat.block_masks_flatten_alike()


def test_block_masks_that_keep_their_closure_do_not_flatten_alike(monkeypatch):
    from torch.nn.attention.flex_attention import BlockMask

    def keeps_closure(self):  # torch 2.11: the mask_mod itself (new each batch) in the context
        return (self.kv_num_blocks,), (self.mask_mod,)

    monkeypatch.setattr(BlockMask, "_flatten", keeps_closure)
    assert not torch_compat.block_masks_flatten_alike()


@pytest.fixture(scope="module")
def configs():
    """Parsed Trainer configs: transformer_debug with flex attention (as on a GPU; the CPU
    build swaps it for SDPA), mela_debug (its own attention, no BlockMask inputs) and
    titans_mac_debug (flex attention whose masks it builds inside the step: no inputs either)."""
    from torchtitan.models.common.attention import FlexAttention

    from torchtitan_ext.training import cli
    from torchtitan_ext.training.llama3_cpu_attention import DocumentCausalSDPA

    transformer = cli.parse(["--module", "train_configs.transformer", "--config", "transformer_debug"])
    swapped = 0
    for _, _, parent, attr in list(transformer.model_spec.model.traverse(DocumentCausalSDPA.Config)):
        if isinstance(parent, list):
            parent[attr] = FlexAttention.Config()
        else:
            setattr(parent, attr, FlexAttention.Config())
        swapped += 1
    assert swapped > 0
    return {"flex": transformer, "mela": cli.parse(["--module", "train_configs.mela", "--config", "mela_debug"]),
            "titans_mac": cli.parse(["--module", "train_configs.titans", "--config", "titans_mac_debug"])}


def test_cuda_graphs_off_only_for_flex_masks_this_torch_cannot_replay(configs, monkeypatch):
    monkeypatch.setattr(torch_compat, "block_masks_flatten_alike", lambda: False)
    assert torch_compat.cuda_graph_args(configs["flex"]) == ["--training.disable_cuda_graphs"]
    assert torch_compat.cuda_graph_args(configs["mela"]) == []  # no flex attention: graphs stay on
    # MAC / MAG / MAL: flex attention on CUDA, but each mask is made inside the captured step (once per
    # segment length, `models.layers.attention.flex_block_mask`), never a step input: graphs stay on
    assert torch_compat.cuda_graph_args(configs["titans_mac"]) == []
    monkeypatch.setattr(configs["flex"].training, "disable_cuda_graphs", True)
    assert torch_compat.cuda_graph_args(configs["flex"]) == []  # already off
    monkeypatch.setattr(configs["flex"].training, "disable_cuda_graphs", False)
    monkeypatch.setattr(torch_compat, "block_masks_flatten_alike", lambda: True)  # torch >= 2.13
    assert torch_compat.cuda_graph_args(configs["flex"]) == []


def test_launcher_passes_the_cuda_graph_flag_to_torchtitan(monkeypatch, capsys, tmp_path):
    import torchtitan.train

    from torchtitan_ext.training import train

    seen = {}
    monkeypatch.setattr(torch_compat, "cuda_graph_args", lambda config: ["--training.disable_cuda_graphs"])
    monkeypatch.setattr(torchtitan.train, "main", lambda: seen.setdefault("argv", list(sys.argv)))
    monkeypatch.setattr(sys, "argv", ["train"])
    monkeypatch.setattr(train.preemption, "install", lambda: None)  # no SIGTERM handler in the test worker
    train.main(["--module", "train_configs.transformer", "--config", "transformer_debug",
                "--dump_folder", str(tmp_path)])
    assert seen["argv"][-1] == "--training.disable_cuda_graphs"
    assert "CUDA-graph step is off" in capsys.readouterr().out
    from torchtitan_ext.training import cli

    assert cli.parse(seen["argv"][1:]).training.disable_cuda_graphs  # a flag torchtitan's parser takes


def test_apply_mends_nothing_below_the_oldest_supported_torch(monkeypatch):
    """torch 2.10 may lack what the mends patch: nothing is touched, so the launcher's check
    can name the torch in one line (tests/test_preflight.py) instead of an import traceback."""
    monkeypatch.setattr(torch, "__version__", "2.10.1+cu128")
    monkeypatch.delattr(fsdp, "DataParallelMeshDims", raising=False)
    monkeypatch.delattr(dist, "set_timeout", raising=False)
    assert torch_compat.torch_version() == (2, 10)
    assert torch_compat.apply() == []
    assert not hasattr(fsdp, "DataParallelMeshDims") and not hasattr(dist, "set_timeout")


# ---------------------------------------------------------------- FSDP2 numerics (subprocess)

# argv: mode ('wrapped': torch_compat.fully_shard_untied_apart(fully_shard), 'plain': fully_shard)
# and tied (0/1). Prints STAGE lines on stderr and one RESULT line (JSON) on stdout.
NUMERICS_SCRIPT = r'''
import copy
import datetime
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.distributed.fsdp as fsdp
import torch.nn.functional as F
from torch import nn

PLAIN_FULLY_SHARD = fsdp.fully_shard  # before torchtitan_ext's import mends anything

from torchtitan_ext import torch_compat  # noqa: E402

MODE, TIED = sys.argv[1], sys.argv[2] == "1"
DTYPE = torch.float64
VOCAB, DIM, BATCH, SEQ, CHUNKS = 37, 16, 2, 8, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, h):
        return h + torch.tanh(self.proj(h))


class Decoder(nn.Module):
    _skip_lm_head = False  # as torchtitan's Decoder: an attribute, not a forward kwarg

    def __init__(self, tied):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(2)})
        self.norm = nn.RMSNorm(DIM, eps=1e-6)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.lm_head.weight = self.tok_embeddings.weight
        with torch.no_grad():  # RMSNorm starts at ones; N(0, 1) tied logits are needlessly large
            self.norm.weight.uniform_(0.5, 1.5)
            self.tok_embeddings.weight.mul_(0.3)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h)
        return h if self._skip_lm_head else self.lm_head(h)


def shard(model, fully_shard, mesh):
    """As torchtitan's apply_fsdp_to_decoder (reshard_after_forward_policy 'default', no PP)."""
    if TIED:
        fully_shard([model.tok_embeddings, model.norm, model.lm_head], mesh=mesh, reshard_after_forward=False)
    else:
        fully_shard(model.tok_embeddings, mesh=mesh, reshard_after_forward=True)
        fully_shard([model.norm, model.lm_head], mesh=mesh, reshard_after_forward=False)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, fsdp.FSDPModule):
            module.set_gradient_divide_factor(1.0)


def chunked_loss(model, tokens, labels):
    """ChunkedLossWrapper's flow: the decoder with _skip_lm_head, detached chunks through lm_head
    (kept unsharded across chunks), a backward per chunk, then the decoder's backward from the
    accumulated gradient. Forward only under no_grad (the validator)."""
    lm_head = model.lm_head
    fsdp_enabled = isinstance(lm_head, fsdp.FSDPModule)
    model._skip_lm_head = True
    try:
        hidden = model(tokens)
    finally:
        model._skip_lm_head = False
    requires_grad = hidden.requires_grad
    chunks = [c.detach().requires_grad_(requires_grad) for c in hidden.chunk(CHUNKS, dim=1)]
    label_chunks = labels.chunk(CHUNKS, dim=1)
    if fsdp_enabled:
        lm_head.set_reshard_after_forward(False)
        lm_head.set_reshard_after_backward(False)
        lm_head.set_requires_gradient_sync(False, recurse=False)
        lm_head.unshard()
    total = torch.zeros((), dtype=DTYPE)
    grads = []
    for i, (chunk, label_chunk) in enumerate(zip(chunks, label_chunks)):
        if fsdp_enabled and i == CHUNKS - 1:
            lm_head.set_requires_gradient_sync(True, recurse=False)
        logits = lm_head(chunk)
        loss = F.cross_entropy(logits.flatten(0, 1), label_chunk.flatten(), reduction="sum") / labels.numel()
        total = total + loss.detach()
        if requires_grad:
            loss.backward()
            grads.append(chunk.grad)
    if fsdp_enabled:
        lm_head.set_reshard_after_forward(True)
        lm_head.set_reshard_after_backward(True)
        lm_head.set_requires_gradient_sync(True, recurse=False)
        lm_head.reshard()
    if requires_grad:
        print("STAGE decoder backward", file=sys.stderr, flush=True)
        hidden.backward(torch.cat(grads, dim=1))
    return total


def reference_loss(model, tokens, labels):
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def rel_err(a, b):
    a, b = full(a).detach(), b.detach()
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def main():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        # torchtitan's set_pg_timeouts after the first step: the alias of mend 1 on a real group
        dist.set_timeout(datetime.timedelta(minutes=5), dist.group.WORLD)
        torch.manual_seed(0)
        ref = Decoder(TIED).to(DTYPE)
        model = copy.deepcopy(ref)  # deepcopy keeps the tie
        assert (model.lm_head.weight is model.tok_embeddings.weight) == TIED
        mesh = dist.device_mesh.init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
        if MODE == "wrapped":
            fully_shard = torch_compat.fully_shard_untied_apart(PLAIN_FULLY_SHARD)
        else:
            fully_shard = PLAIN_FULLY_SHARD
        shard(model, fully_shard, mesh)
        names = ("tok_embeddings", "norm", "lm_head")
        result = {
            "torch": torch.__version__,
            "fsdp_modules": [n for n in names if isinstance(getattr(model, n), fsdp.FSDPModule)],
            "norm_lm_head_one_group": isinstance(model.norm, fsdp.FSDPModule)
            and isinstance(model.lm_head, fsdp.FSDPModule)
            and model.norm._get_fsdp_state() is model.lm_head._get_fsdp_state(),
            "dtensor_params": all(hasattr(p, "full_tensor") for p in model.parameters()),
            "losses": [], "ref_losses": [], "loss_err": [], "grad_err": [], "ref_grad_absmax": [],
        }
        ref_params = dict(ref.named_parameters())
        params = dict(model.named_parameters())
        assert params.keys() == ref_params.keys(), (params.keys(), ref_params.keys())
        result["params"] = list(params)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        gen = torch.Generator().manual_seed(1)
        for step in range(2):
            print(f"STAGE step {step} train", file=sys.stderr, flush=True)
            tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
            labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
            loss = chunked_loss(model, tokens, labels)
            ref_value = reference_loss(ref, tokens, labels)
            ref_value.backward()
            result["losses"].append(loss.item())
            result["ref_losses"].append(ref_value.item())
            result["loss_err"].append(rel_err(loss, ref_value))
            result["grad_err"].append({n: rel_err(params[n].grad, p.grad) for n, p in ref_params.items()})
            result["ref_grad_absmax"].append({n: p.grad.abs().max().item() for n, p in ref_params.items()})
            opt.step(); opt.zero_grad(); ref_opt.step(); ref_opt.zero_grad()
            if step == 0:  # the validator between steps: chunked loss under no_grad, eval mode
                print("STAGE step 0 eval", file=sys.stderr, flush=True)
                model.eval(); ref.eval()
                with torch.no_grad():
                    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
                    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
                    result["eval_loss_err"] = rel_err(chunked_loss(model, tokens, labels), reference_loss(ref, tokens, labels))
                model.train(); ref.train()
        result["param_err"] = {n: rel_err(params[n], p) for n, p in ref_params.items()}
        print("RESULT " + json.dumps(result), flush=True)
    finally:
        dist.destroy_process_group()


main()
'''

TOL = 1e-6  # relative, float64: a freed or stale weight is off by far more


def run_numerics(mode: str, tied: bool, python: str = sys.executable) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [python, "-c", NUMERICS_SCRIPT, mode, "1" if tied else "0"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
    )
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(results) == 1, (
        f"rc={proc.returncode} (negative: killed by that signal)\n"
        f"stdout tail:\n{proc.stdout[-2000:]}\nstderr tail:\n{proc.stderr[-4000:]}"
    )
    return json.loads(results[0][len("RESULT "):])


def assert_matches_plain_torch(result: dict, tied: bool) -> None:
    expected = ["tok_embeddings.weight", "layers.0.proj.weight", "layers.0.proj.bias",
                "layers.1.proj.weight", "layers.1.proj.bias", "norm.weight"]
    if not tied:
        expected.append("lm_head.weight")
    assert result["params"] == expected
    assert result["dtensor_params"]
    assert result["losses"][0] != result["losses"][1]  # the optimizer stepped
    for step in range(2):
        assert min(result["ref_grad_absmax"][step].values()) > 0, result["ref_grad_absmax"][step]
        assert result["loss_err"][step] <= TOL, result
        assert set(result["grad_err"][step]) == set(expected)
        bad = {n: e for n, e in result["grad_err"][step].items() if not e <= TOL}
        assert not bad, f"step {step}: gradients off plain torch (relative): {bad}"
    assert result["eval_loss_err"] <= TOL, result
    bad = {n: e for n, e in result["param_err"].items() if not e <= TOL}
    assert not bad, f"parameters after two steps off plain torch (relative): {bad}"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fsdp2_wrapped_fully_shard_chunked_loss_matches_plain_torch(tied):
    """What runs on torch 2.11/2.12: torchtitan's groups through the wrapper; the untied
    [norm, lm_head] sharded each on its own, the tied group's embedding/lm_head left to the root
    (norm alone). Every torch runs it: the wrapper must be right on 2.13 as well."""
    result = run_numerics("wrapped", tied)
    assert result["fsdp_modules"] == (["norm"] if tied else ["tok_embeddings", "norm", "lm_head"])
    assert not result["norm_lm_head_one_group"]
    assert_matches_plain_torch(result, tied)


@pytest.mark.skipif(not torch_compat.groups_complete_from_root(),
                    reason="this torch does not complete groups from the root: the plain group crashes")
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fsdp2_plain_fully_shard_chunked_loss_matches_plain_torch(tied):
    """What runs on the pinned torch: torchtitan's groups as they are ([norm, lm_head] /
    [tok_embeddings, norm, lm_head] one FSDP unit), the same numbers as plain torch (checks the
    harness of the wrapped test too)."""
    result = run_numerics("plain", tied)
    assert result["fsdp_modules"] == ["tok_embeddings", "norm", "lm_head"]
    assert result["norm_lm_head_one_group"]
    assert_matches_plain_torch(result, tied)
