"""Print the parameter count of every model flavor, built on the meta device (no memory used).

    python scripts/param_counts.py
"""

import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.titans import VARIANTS  # noqa: E402
from torchtitan_ext import mlp_lm, titans, transformer  # noqa: E402

FAMILIES = {"transformer": transformer, "mlp_lm": mlp_lm} | {
    f"titans_{v}": SimpleNamespace(FLAVORS=titans.FLAVORS, model_spec=partial(titans.model_spec, v)) for v in VARIANTS
}


def param_count(family: str, flavor: str) -> int:
    with torch.device("meta"):
        model = FAMILIES[family].model_spec(flavor).model.build()
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    print(f"{'family':<12} {'flavor':<8} {'parameters':>15}")
    for family, module in FAMILIES.items():
        for flavor in module.FLAVORS:
            print(f"{family:<12} {flavor:<8} {param_count(family, flavor):>15,}")


if __name__ == "__main__":
    main()
