"""An English corpus that ships with every CPython install, so training needs no network.

Documents, in a fixed order: each help topic of `pydoc_data.topics` (the text behind
`help("topic")`), then, per top-level standard-library module, its docstrings
(module, classes, functions) joined. About 230 documents and 1.4M characters on
CPython 3.11; the exact text follows the installed Python version.
"""

from __future__ import annotations

import ast
import functools
import sysconfig
from pathlib import Path

MIN_DOCUMENT_CHARS = 200


def _module_docstrings(path: Path) -> str:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
        return ""
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docs = (ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, kinds))
    return "\n\n".join(d for d in docs if d)


@functools.cache
def embedded_documents() -> tuple[str, ...]:
    from pydoc_data.topics import topics

    docs = [topics[name] for name in sorted(topics)]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs += [_module_docstrings(p) for p in sorted(stdlib.glob("*.py"))]
    return tuple(d.strip() for d in docs if len(d.strip()) >= MIN_DOCUMENT_CHARS)
