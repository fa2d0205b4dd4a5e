"""Where the project keeps generated files (tokenizers, caches; override with MNLM_CACHE), and
how outputs are written (a staged folder moved into place at the end, a JSON file renamed over
the old one)."""

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def cache_dir() -> Path:
    return Path(os.environ.get("MNLM_CACHE", REPO_ROOT / ".cache"))


def default_tokenizer_dir() -> Path:
    """The sentencepiece model trained on the embedded corpus (scripts/build_tokenizer.py);
    lossless (identity normalisation), hence the folder name."""
    return cache_dir() / "tokenizer" / "embedded-sp4096-lossless"


def write_json(path: Path, data, indent: int | None = 1) -> None:
    """Write `data` to `path` atomically: a temporary `.partial` sibling (named per process, so
    two processes writing one path never share it) renamed over it, so a run killed mid-write
    leaves the old file (or none), never half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    partial.write_text(json.dumps(data, indent=indent))
    partial.replace(path)


@contextlib.contextmanager
def staged_folder(out: Path):
    """Yield a temporary sibling of `out` to write into; on success it replaces `out`, on
    failure it is removed and `out` is left as it was (nothing half-written)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        yield staging
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_results(out: Path, results: dict, table: str, plots: dict[str, Callable[[Path], None]] | None = None,
                  stem: str = "results") -> None:
    """Write `<stem>.json` (`results`), `<stem>.md` (`table`) and each plot (file name ->
    function writing that file) into `out` through `staged_folder` (all or nothing), then
    print the table and the files written."""
    names = [f"{stem}.json", f"{stem}.md", *(plots or {})]
    with staged_folder(out) as staging:
        (staging / names[0]).write_text(json.dumps(results, indent=2))
        (staging / names[1]).write_text(table)
        for name, plot in (plots or {}).items():
            plot(staging / name)
    print(table)
    print(f"wrote {out}/{', '.join(names)}")
