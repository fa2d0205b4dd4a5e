"""`python -m torchtitan_ext.catalogue`: every registered family and its config functions, one line each."""

from __future__ import annotations

import importlib
import inspect

from torchtitan_ext.families import families


def config_functions() -> dict[str, list[tuple[str, str]]]:
    """{config module: [(function, first docstring line)]} of every registered family: the
    module's public functions that take no arguments (helpers are private or take some)."""
    catalogue = {}
    for family in families().values():
        module = importlib.import_module(family.config_module)
        catalogue[family.config_module] = [
            (name, (inspect.getdoc(fn) or "").split("\n")[0])
            for name, fn in inspect.getmembers(module, inspect.isfunction)
            if not name.startswith("_") and fn.__module__ == module.__name__ and not inspect.signature(fn).parameters
        ]
    return catalogue


def main() -> None:
    summaries = {family.config_module: family.summary for family in families().values()}
    for module, functions in config_functions().items():
        print(f"--module {module}    # {summaries[module]}")
        for name, doc in functions:
            print(f"    --config {name:<22} {doc}")


if __name__ == "__main__":
    main()
