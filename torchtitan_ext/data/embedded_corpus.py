"""An English corpus that ships with every CPython install, so training needs no network.

Documents, in a fixed order: each help topic of `pydoc_data.topics` (the text behind
`help("topic")`), then, per top-level standard-library module, its docstrings
(module, classes, functions) joined. About 230 documents and 1.4M characters on
CPython 3.11; the exact text follows the installed Python version.

Parsing the standard library takes 3-9 s, which every training process (each rank) and every
evaluation would pay; the documents are kept in a JSON file under the project's cache folder,
named by a hash of the Python version, the standard library's folder and this file's source,
so a new interpreter or a change here builds it afresh.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

from torchtitan_ext.paths import cache_dir, write_json

MIN_DOCUMENT_CHARS = 200


def _module_docstrings(path: Path) -> str:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
        return ""
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docs = (ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, kinds))
    return "\n\n".join(d for d in docs if d)


def _extract_documents() -> list[str]:
    from pydoc_data.topics import topics

    docs = [topics[name] for name in sorted(topics)]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs += [_module_docstrings(p) for p in sorted(stdlib.glob("*.py"))]
    return [d.strip() for d in docs if len(d.strip()) >= MIN_DOCUMENT_CHARS]


def cached_corpus_path() -> Path:
    """The cache file of the documents for this interpreter and this extraction code."""
    stdlib = sysconfig.get_paths()["stdlib"]
    key = hashlib.sha256(f"{sys.version}\n{stdlib}\n".encode() + Path(__file__).read_bytes()).hexdigest()[:16]
    return cache_dir() / "embedded_corpus" / f"{key}.json"


@functools.cache
def embedded_documents() -> tuple[str, ...]:
    """The corpus's documents, from the cache file when one exists (`cached_corpus_path`),
    else extracted from the standard library and the cache file written (atomically)."""
    path = cached_corpus_path()
    try:
        return tuple(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError):  # missing, or unreadable: extract again
        docs = _extract_documents()
    try:
        write_json(path, docs, indent=None)
    except OSError:  # a read-only cache folder: the documents are still returned
        pass
    return tuple(docs)
