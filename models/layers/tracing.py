"""Whether model code is being traced by torch.compile, behind one name so that a cost model
(`torchtitan_ext/step_cost/`) can answer it for the regions it treats as compiled."""

from __future__ import annotations

import torch


def compiling() -> bool:
    """True while torch.compile traces the calling code (`torch.compiler.is_compiling`)."""
    return torch.compiler.is_compiling()
