"""DCP checkpoint -> Hugging Face folder (sharded safetensors + index, config.json,
generation_config.json, tokenizer files; remote code for the memory models).

    python scripts/convert_to_hf.py --module train_configs.<family> --config <function> \\
        --checkpoint <dump_folder>/checkpoint/step-N --out <dir> [--max-shard-size 2GB] [--merge-lora]

Transformer++ becomes a standard LlamaForCausalLM, the pretrained backbone a LlamaForCausalLM /
Qwen2ForCausalLM / Qwen3ForCausalLM (a LoRA finetune of it with --merge-lora); MLP-FFN LM, Titans and Mela load with
AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True). See torchtitan_ext/hf_export.py.
"""

import argparse
import sys
from pathlib import Path


from torchtitan_ext.training.checkpoints import model_from_checkpoint
from torchtitan_ext.errors import UserError
from torchtitan_ext.hf_export import export


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--module", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--checkpoint", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--max-shard-size", default="2GB")
    parser.add_argument("--merge-lora", action="store_true", help="fold LoRA factors into the weights first")
    args = parser.parse_args(argv)
    try:
        model, config = model_from_checkpoint(args.module, args.config, args.checkpoint)
        export(model, config, args.out, args.max_shard_size, merge_lora=args.merge_lora)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
