"""Print the parameter count of every model flavor, built on the meta device (no memory used).

    python scripts/param_counts.py
"""

import torch

from models.lms.mela import Mela, parameter_groups
from torchtitan_ext.families import families, mela


def param_count(family: str, flavor: str, **overrides) -> int:
    with torch.device("meta"):
        model = families()[family].model_spec(flavor, **overrides).model.build()
    return sum(p.numel() for p in model.parameters())


def counts() -> list[tuple[str, str, int]]:
    """(ModelSpec name, flavor, parameters) of every registered family, variant and flavor."""
    return [(spec_name, flavor, param_count(family.name, flavor, **overrides))
            for family in families().values() for spec_name, flavor, overrides in family.specs()]


def mela_shares(flavor: str) -> dict[str, float]:
    """Percent of Mela's parameters in memory / language / embedding (Table 1's columns)."""
    with torch.device("meta"):
        groups = parameter_groups(Mela(mela.model_config(flavor)))
    total = sum(groups.values())
    return {name: 100 * count / total for name, count in groups.items()}


def main() -> None:
    print(f"{'family':<12} {'flavor':<16} {'parameters':>15}")
    for name, flavor, count in counts():
        print(f"{name:<12} {flavor:<16} {count:>15,}")
    print("\nMela shares (Table 1: 400m 27.45 / 65.75, 800m 28.78 / 66.35, 1b2 18.19 / 76.97)")
    for flavor in mela.FLAVORS:
        shares = mela_shares(flavor)
        print(f"mela {flavor:<6} " + "  ".join(f"{k} {v:.2f}%" for k, v in shares.items()))


if __name__ == "__main__":
    main()
