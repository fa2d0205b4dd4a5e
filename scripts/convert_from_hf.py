"""Hugging Face folder -> DCP seed checkpoint that training starts from.

    python scripts/convert_from_hf.py --module train_configs.<family> --config <function> \\
        --hf <dir> --out <dump_folder>/checkpoint/step-0

The folder is one written by convert_to_hf.py, or any model saved by `transformers` with the
flavor's shapes: a Llama (Transformer++), a Llama / Qwen2 / Qwen3 (the pretrained backbone). The result holds the model weights only, like
torchtitan's seed checkpoints: `bash scripts/train.sh ... --dump_folder <dump_folder>` resumes
from it. (torchtitan can also read the HF folder itself: `--checkpoint.initial_load_path <dir>
--checkpoint.initial_load_in_hf`.) Written to a temporary folder, moved into place at the end.
"""

import argparse
import sys
from pathlib import Path


from torchtitan_ext.errors import UserError
from torchtitan_ext.hf_export import import_weights
from torchtitan_ext.paths import staged_folder


def write_dcp(state: dict, out: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with staged_folder(out) as staging:
        dcp.save(state, checkpoint_id=str(staging), no_dist=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--module", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--hf", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    try:
        model, _ = import_weights(args.module, args.config, args.hf)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    write_dcp(model.state_dict(), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
