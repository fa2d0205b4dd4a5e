"""Which decoder blocks a layer spec names: the grafts' `layers` (models/grafts/graft.py) and
Locas' (models/memory/locas.py). Specs: "all"; "elma" = the first two blocks; "alma" = the
last two; "gema:k" = every k-th block from the first (blocks k-1, 2k-1, ...); or a
comma-separated list such as "0,5,11" (MemoryLlama thesis, section 4, figure 4.2)."""


def graft_layers(spec: str, n_layers: int) -> list[int]:
    """The block indices a layer spec names in a backbone of `n_layers` blocks; ValueError
    naming the spec when it names none or one out of range."""
    if spec == "all":
        return list(range(n_layers))
    if spec in ("alma", "elma"):
        if n_layers < 2:
            raise ValueError(f"graft layers '{spec}' needs 2 blocks; the backbone has {n_layers}")
        return [n_layers - 2, n_layers - 1] if spec == "alma" else [0, 1]
    if spec.startswith("gema:"):
        k = int(spec.removeprefix("gema:"))
        if not 1 <= k <= n_layers:
            raise ValueError(f"graft layers '{spec}': k must be in 1..{n_layers}")
        return list(range(k - 1, n_layers, k))
    try:
        layers = sorted({int(i) for i in spec.split(",")})
    except ValueError:
        raise ValueError(f"graft layers '{spec}' unknown: all, alma, elma, gema:<k> or a list like 0,5,11") from None
    if layers[0] < 0 or layers[-1] >= n_layers:
        raise ValueError(f"graft layer {layers[-1] if layers[-1] >= n_layers else layers[0]} is out of range: "
                         f"the backbone has blocks 0..{n_layers - 1}")
    return layers
