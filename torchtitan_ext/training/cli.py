"""The training command line: `--module M --config F [--section.key value ...]` parsed into
torchtitan's Trainer config by its ConfigManager, with one-line UserErrors for an unknown
config or a module that fails to import (used by the launcher entry `train.py`, by
`preflight.py` and by everything that builds a model from a config function)."""

from __future__ import annotations

from torchtitan_ext.errors import UserError


def import_failure(module: str | None) -> str | None:
    """Why the existing `module` fails to import ("ModuleNotFoundError: No module named 'x'"),
    or None when it imports, does not exist, or none was named. torchtitan reports any failure
    as "Cannot import module", which hides a missing dependency inside an existing module."""
    if not module:
        return None
    import importlib

    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        missing_itself = e.name is not None and (module == e.name or module.startswith(e.name + "."))
        return None if missing_itself else f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - any import-time failure is the answer
        return f"{type(e).__name__}: {e}"
    return None


def option_value(argv: list[str], name: str) -> str | None:
    """The value of `--name value` or `--name=value` in argv, else None."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def parse(argv: list[str]):
    """Parse `--module/--config` and overrides with torchtitan's ConfigManager."""
    from torchtitan.config import ConfigManager

    try:
        return ConfigManager().parse_args(list(argv))
    except (ImportError, ValueError) as e:
        cause = import_failure(option_value(list(argv), "--module")) if isinstance(e, ImportError) else None
        if cause:
            raise UserError(f"--module {option_value(list(argv), '--module')} fails to import ({cause}): "
                            "install the missing dependency (bash scripts/setup.sh)") from None
        raise UserError(f"{e} (run `bash scripts/train.sh --list` for the config catalogue)") from None
