"""Checks every memory graft's tests share (tests/test_memory_llama.py, tests/test_mone.py,
tests/test_gradmem.py):
frozen backbone and graft-only optimizer state of a finetune, remote-code export, the
compiled block, full activation checkpointing, and 1-vs-2-process runs from one seed checkpoint."""

from __future__ import annotations

import shutil

import torch

CONFIG_MODULE = "train_configs.backbone"


def trained_from_hf(config: str, step, hf_folder, module: str = CONFIG_MODULE):
    """The finetune's model at checkpoint `step`, having checked that every backbone tensor is
    the Hugging Face folder's bit for bit and the optimizer holds exactly the trainable
    (graft) tensors, LoRA factors and `memory*`."""
    from torch.distributed.checkpoint import FileSystemReader

    from torchtitan_ext.families.backbone import load_hf_backbone
    from torchtitan_ext.training.checkpoints import build_model, load_dcp_model

    model, _ = build_model(module, config)
    load_dcp_model(model, step)
    state, hf_state = model.state_dict(), load_hf_backbone(hf_folder).state_dict()
    assert all(torch.equal(state[key], value) for key, value in hf_state.items())  # frozen means frozen
    stored = FileSystemReader(str(step)).read_metadata().state_dict_metadata
    optimized = {k.split(".", 2)[2].rsplit(".", 1)[0] for k in stored if k.startswith("optimizer.state.")}
    assert optimized == {k for k, p in model.named_parameters() if p.requires_grad}
    assert all(".lora_" in k or ".memory" in k for k in optimized)
    return model


def assert_exports_as_remote_code(config: str, step, x: torch.Tensor, logits: torch.Tensor, tmp_path) -> dict:
    """--merge-lora refuses a memory graft (exit 2, nothing written); the remote-code export
    reloads without the project with logits within 1e-5. Returns what the reload saw."""
    from test_hf import load_without_project, run_script

    args = ["--module", CONFIG_MODULE, "--config", config, "--checkpoint", step]
    assert run_script("convert_to_hf.py", *args, "--out", tmp_path / "merged", "--merge-lora") == 2
    assert not (tmp_path / "merged").exists()
    assert run_script("convert_to_hf.py", *args, "--out", tmp_path / "export") == 0
    torch.save(x, tmp_path / "x.pt")
    hf = load_without_project(tmp_path / "export", tmp_path / "x.pt", tmp_path)
    assert (hf["logits"] - logits).abs().max() < 1e-5
    return hf


def assert_compiled_block_equals_eager(block: torch.nn.Module, x: torch.Tensor, *args) -> None:
    """torch.compile of one block (what torchtitan's per-block compile does): outputs and the
    gradients of x and every graft tensor within 1e-5 of eager."""
    results = []
    for run in (block, torch.compile(block)):
        out = run(x, *args)
        grads = torch.autograd.grad(out.square().mean(), [x, *block.graft_parameters()])
        results.append((out, grads))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=1e-5)
    for compiled, eager in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)


def assert_full_ac_equals_eager(model: torch.nn.Module, x: torch.Tensor) -> None:
    """torchtitan's full activation checkpointing applied as the recipe applies it
    (`activation-checkpoint:full`: parallelize_llama's `ac_config.build().apply(model)`, every
    block of `model.layers` recomputed in the backward) leaves the next-token loss and the
    gradient of every trainable tensor as eager's, to rounding: a memory written again while a
    block is recomputed, or a state the recomputation misses, moves them."""
    import copy

    import torch.nn.functional as F
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torchtitan.distributed.activation_checkpoint import FullAC

    recomputed = copy.deepcopy(model)
    FullAC.Config().build().apply(recomputed)
    assert all(isinstance(block, CheckpointWrapper) for block in recomputed.layers.values())
    results = []
    for run in (model, recomputed):
        logits = run(x)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        trainable = [p for p in run.parameters() if p.requires_grad]
        results.append((loss, torch.autograd.grad(loss, trainable)))
    (loss, grads), (loss_ac, grads_ac) = results
    assert grads and len(grads) == len(grads_ac)
    torch.testing.assert_close(loss_ac, loss, rtol=1e-6, atol=0)
    for ac, eager in zip(grads_ac, grads):
        torch.testing.assert_close(ac, eager, rtol=1e-6, atol=1e-9)


def assert_seeded_runs_agree(config: str, tmp_path, short: list[str]):
    """From one seed checkpoint, `short` steps on 1 process and on 2: within 1e-3; then the
    seed's frozen tensors are unchanged and every graft tensor moved in both checkpoints.
    Returns the 1-process run and its folder. (Full activation checkpointing is held to eager
    in process: `assert_full_ac_equals_eager`.)"""
    from conftest import train
    from torchtitan_ext.training.checkpoints import build_model, load_dcp_model

    args = ["--module", CONFIG_MODULE, "--config", config] + short
    one, two = tmp_path / "one", tmp_path / "two"
    seed = train(args + ["--dump_folder", str(one), "--checkpoint.create-seed-checkpoint"])
    assert seed.returncode == 0, seed
    shutil.copytree(one, two)
    single = train(args + ["--dump_folder", str(one)])
    double = train(args + ["--dump_folder", str(two)], nproc=2)
    assert single.returncode == 0 and double.returncode == 0, (single, double)
    assert max(abs(single.losses[s] - double.losses[s]) / single.losses[s] for s in single.losses) < 1e-3

    last = max(single.losses)
    seeded, _ = build_model(CONFIG_MODULE, config)
    load_dcp_model(seeded, one / "checkpoint" / "step-0")
    for folder in (one, two):
        trained, _ = build_model(CONFIG_MODULE, config)
        load_dcp_model(trained, folder / "checkpoint" / f"step-{last}")
        start, end = seeded.state_dict(), trained.state_dict()
        frozen = {k for k, p in trained.named_parameters() if not p.requires_grad}
        assert frozen and all(torch.equal(start[k], end[k]) for k in frozen)
        assert all(not torch.equal(start[k], end[k]) for k, p in trained.named_parameters() if p.requires_grad)
    return single, one
