"""`python -m torchtitan_ext.catalogue`: every config function in `train_configs/`, one line each."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import train_configs


def config_functions() -> dict[str, list[tuple[str, str]]]:
    """{module: [(function, first docstring line)]} for the modules of train_configs."""
    catalogue = {}
    for info in pkgutil.iter_modules(train_configs.__path__):
        module = importlib.import_module(f"train_configs.{info.name}")
        prefix = info.name + "_"
        functions = [
            (name, (inspect.getdoc(fn) or "").split("\n")[0])
            for name, fn in inspect.getmembers(module, inspect.isfunction)
            if name.startswith(prefix) and fn.__module__ == module.__name__
        ]
        if functions:
            catalogue[f"train_configs.{info.name}"] = functions
    return catalogue


def main() -> None:
    for module, functions in config_functions().items():
        print(f"--module {module}")
        for name, doc in functions:
            print(f"    --config {name:<22} {doc}")


if __name__ == "__main__":
    main()
