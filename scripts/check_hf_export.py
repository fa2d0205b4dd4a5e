"""Convert a DCP checkpoint to Hugging Face and check that transformers' model gives our logits.

    python scripts/check_hf_export.py --module train_configs.<family> --config <function> \\
        --checkpoint <dump_folder>/checkpoint/step-N --out <dir> [--device cuda] [--length 1024]

Our model is read from the checkpoint (`model_from_checkpoint`), exported as
`scripts/convert_to_hf.py` does (`torchtitan_ext.hf_export.export`), and the export is loaded
back with `AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)`. Both run in fp32
(TF32 off) on `--device` on the same random tokens (one document per row, 2 x `--length`);
the check passes when max |logits_hf - logits_ours| / max |logits_ours| <= `--tolerance`
(1e-3: fp32 with different attention kernels, flex attention against transformers' SDPA on a
GPU). Prints one line (PASS or FAIL, the error, the exported class, seconds) and exits 0 / 1;
bad input (a checkpoint of another model, a missing folder) exits 2 with one line.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from torchtitan_ext.errors import UserError
from torchtitan_ext.hf_export import export
from torchtitan_ext.training.checkpoints import causal_logits, model_from_checkpoint


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--module", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--checkpoint", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--length", type=int, default=1024, help="tokens per row (2 rows)")
    p.add_argument("--tolerance", type=float, default=1e-3, help="max |diff| / max |logit|")
    return p


def compare(model: torch.nn.Module, folder: Path, device: str, length: int) -> tuple[float, str]:
    """(max |logits_hf - logits_ours| / max |logits_ours|, transformers' class name) on random tokens."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    hf = hf.to(device).eval()
    model = model.to(device).eval()
    vocab = hf.config.vocab_size
    tokens = torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        ours = causal_logits(model, tokens).float()
        theirs = hf(tokens).logits.float()
    return ((theirs - ours).abs().max() / ours.abs().max()).item(), type(hf).__name__


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    start = time.perf_counter()
    try:
        model, config = model_from_checkpoint(args.module, args.config, args.checkpoint)
        export(model, config, args.out)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    error, hf_class = compare(model, args.out, args.device, args.length)
    ok = error <= args.tolerance
    print(f"{'PASS' if ok else 'FAIL'}  hf_export {args.config}: {hf_class} logits vs ours max rel diff {error:.2e} "
          f"(tolerance {args.tolerance:.0e}; 2 x {args.length} tokens, {args.device}, fp32; "
          f"{time.perf_counter() - start:.0f} s)", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
