"""Print the parameter count of every model flavor, built on the meta device (no memory used).

    python scripts/param_counts.py
"""

from functools import partial
from types import SimpleNamespace

import torch


from models.mela import Mela, parameter_groups
from models.titans import VARIANTS
from torchtitan_ext import mela, mlp_lm, titans, transformer

FAMILIES = {"transformer": transformer, "mlp_lm": mlp_lm, "mela": mela} | {
    f"titans_{v}": SimpleNamespace(FLAVORS=titans.FLAVORS, model_spec=partial(titans.model_spec, v)) for v in VARIANTS
}


def param_count(family: str, flavor: str) -> int:
    with torch.device("meta"):
        model = FAMILIES[family].model_spec(flavor).model.build()
    return sum(p.numel() for p in model.parameters())


def mela_shares(flavor: str) -> dict[str, float]:
    """Percent of Mela's parameters in memory / language / embedding (Table 1's columns)."""
    with torch.device("meta"):
        groups = parameter_groups(Mela(mela.model_config(flavor)))
    total = sum(groups.values())
    return {name: 100 * count / total for name, count in groups.items()}


def main() -> None:
    print(f"{'family':<12} {'flavor':<8} {'parameters':>15}")
    for family, module in FAMILIES.items():
        for flavor in module.FLAVORS:
            print(f"{family:<12} {flavor:<8} {param_count(family, flavor):>15,}")
    print("\nMela shares (Table 1: 400m 27.45 / 65.75, 800m 28.78 / 66.35, 1b2 18.19 / 76.97)")
    for flavor in mela.FLAVORS:
        shares = mela_shares(flavor)
        print(f"mela {flavor:<6} " + "  ".join(f"{k} {v:.2f}%" for k, v in shares.items()))


if __name__ == "__main__":
    main()
