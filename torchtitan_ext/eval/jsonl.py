"""The JSON-lines files the resumable studies append one record a run to."""

from __future__ import annotations

import json
from pathlib import Path

from torchtitan_ext.errors import UserError


def read_records(path: Path, what: str = "runs") -> list[dict]:
    """The records of `path` (blank lines skipped); UserError naming the file when it does not
    exist (`what`: what a user runs into it first, e.g. "seeds")."""
    if not path.is_file():
        raise UserError(f"{path} does not exist: run some {what} into it first")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
