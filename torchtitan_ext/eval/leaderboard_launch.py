"""The leaderboard's launch side: the paper suite's dry run (the launcher's preflight for every
row at each world size, and the exact multi-node command), a suite's estimate (cells, tokens,
non-embedding parameters per row), and the one preflight a suite runs before its cells.
Rows and suites: torchtitan_ext/eval/leaderboard_suites.py.
"""

from __future__ import annotations

import os
import shlex
import tempfile

import torch

from torchtitan_ext.errors import UserError
from torchtitan_ext.eval.leaderboard_suites import Row, Suite, WINDOW_MULTIPLES

WORLDS = ((1, 8), (4, 8), (16, 8))  # NNODES x NPROC_PER_NODE of the paper suite's dry run
EMBEDDING_NAMES = ("tok_embeddings", "lm_head", "embed_tokens")


def paper_args(row: Row, chosen: Suite) -> list[str]:
    """train.sh arguments of a paper-suite row: its paper config, the window-only control on
    window-token sequences (as many tokens per step: a larger global batch)."""
    module, _, function = chosen.paper_configs[row.name].partition(":")
    args = ["--module", module, "--config", function, "--dump_folder", f"outputs/leaderboard/{row.name}"]
    if row.windowed:
        args += ["--training.seq_len", str(chosen.window),
                 "--training.global_batch_size", str(128 * chosen.seq_len // chosen.window)]
    return args


def command(args: list[str], nodes: int, per_node: int, row: Row) -> str:
    """The launcher command every node runs (train.sh's multi-node rendezvous)."""
    env = f"NNODES={nodes} NPROC_PER_NODE={per_node} MASTER_ADDR=<node0> MASTER_PORT=29500 RDZV_ID={row.name} SKIP_SETUP=1"
    return f"{env} bash scripts/train.sh {shlex.join(args)}"


def preflight(args: list[str], world: int) -> str:
    """'ok', or the launcher preflight's one-line refusal of `args` at `world` ranks."""
    from torchtitan_ext.training import cli
    from torchtitan_ext.training import preflight as checks
    from torchtitan_ext.training.cli import option_value

    try:
        checks.check(cli.parse(args), world=world,
                     explicit_local_batch=option_value(args, "--training.local_batch_size") is not None)
    except UserError as e:
        return f"error: {e}"
    return "ok"


def dry_run(chosen: Suite, rows: tuple[Row, ...], assets: str | None) -> str:
    """Every row's preflight at 1x8, 4x8 and 16x8 ranks and its multi-node command; UserError
    naming the refusals when any row fails (after all are checked)."""
    if not chosen.paper_configs:
        raise UserError(f"--dry-run checks the paper suite's multi-node commands, not suite {chosen.name}")
    lines, refused = [], []
    for row in rows:
        args = paper_args(row, chosen)
        with tempfile.TemporaryDirectory() as scratch:  # preflight creates the dump folder it checks
            checked = [scratch if a == args[args.index("--dump_folder") + 1] else a for a in args]
            checked += ["--hf_assets_path", assets] if assets else []
            outcomes = [preflight(checked, nodes * per_node) for nodes, per_node in WORLDS]
        for (nodes, per_node), outcome in zip(WORLDS, outcomes):
            lines.append(f"[{outcome}] {nodes}x{per_node} {row.name}: {command(args, nodes, per_node, row)}")
            if outcome != "ok":
                refused.append(f"{row.name} at {nodes * per_node} ranks: {outcome.removeprefix('error: ')}")
    if refused:
        raise UserError(f"preflight refused {len(refused)} of {len(lines)}: {refused[0]}")
    from torchtitan_ext.eval.zero_shot import PAPER_RULER, PAPER_TASKS

    ruler, lengths = PAPER_RULER
    zero_shot = (f"zero-shot on each row's export (python scripts/convert_to_hf.py ...): lm_eval --model hf --model_args "
                 f"pretrained=<export>,trust_remote_code=True,dtype=bfloat16 --tasks {','.join(PAPER_TASKS)}; RULER: "
                 f"--tasks {ruler} --metadata '{{\"max_seq_lengths\": {list(lengths)}}}'")
    return "\n".join(lines + ["", "or per node under Slurm: sbatch --nodes=<NNODES> scripts/slurm_train.sbatch <args above>",
                              zero_shot])


def built_model(row: Row) -> torch.nn.Module:
    """A row's model as its config builds it, on the meta device (a graft's backbone frozen)."""
    from torchtitan_ext.training import cli

    spec = cli.parse(["--module", *row.config.split(":", 1)[:1], "--config", row.config.split(":", 1)[1]]).model_spec
    with torch.device("meta"):
        return spec.model.build()


def trainable_params(row: Row) -> int:
    """Parameters a row's training updates (a graft: its LoRA, memory and heads)."""
    return sum(p.numel() for p in built_model(row).parameters() if p.requires_grad)


def non_embedding_params(row: Row) -> int:
    """Parameters of a row's model outside its token embedding and output head (meta device)."""
    model = built_model(row)
    return sum(p.numel() for name, p in model.named_parameters() if not name.startswith(EMBEDDING_NAMES)
               and not any(f".{e}" in name for e in EMBEDDING_NAMES))


def estimate(chosen: Suite, rows: tuple[Row, ...]) -> str:
    """Cells, training tokens per row, each scratch row's non-embedding parameters and each
    trained graft's trainable parameters (a row reading another's runs trains none)."""
    params = {r.name: non_embedding_params(r) for r in rows if r.kind == "scratch"}
    trained = {r.name: trainable_params(r) for r in rows if r.kind == "graft" and not r.runs_of}
    lines = [f"suite {chosen.name}: {len(rows)} rows x {len(chosen.seeds)} seeds = {len(rows) * len(chosen.seeds)} cells, "
             f"{chosen.training_tokens():,} training tokens per from-scratch row, perplexity to {chosen.ppl_lengths()[-1]} "
             f"tokens, recall at {[chosen.window * k for k in WINDOW_MULTIPLES]} tokens "
             f"(grafts: {[chosen.graft_window * k for k in WINDOW_MULTIPLES]})"]
    lines += [f"  {name}: {count:,} non-embedding parameters" for name, count in params.items()]
    lines += [f"  {name}: {count:,} trainable parameters" for name, count in trained.items()]
    return "\n".join(lines)


def explicit_preflight(args: list[str]) -> None:
    """The launcher's preflight of one training command, once, before a suite's cells (which
    then skip it); UserError with its refusal."""
    outcome = preflight(args, int(os.environ.get("WORLD_SIZE", "1")))
    if outcome != "ok":
        raise UserError(outcome.removeprefix("error: "))
