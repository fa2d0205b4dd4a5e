"""A torch.compile backend for tests that notes what AOTAutograd's cache would refuse."""

from __future__ import annotations

from torch._dynamo.backends.registry import lookup_backend
from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache, check_node_safe


def cache_checked(backend, refusals: list[str]):
    """`backend` (a registered name or a backend) with each Dynamo graph first checked node by
    node as AOTAutograd's cache checks it (torch's `check_node_safe`, what makes it bypass a
    graph: a custom autograd.Function, an autocast switch, ...). A graph it would bypass is
    traced and partitioned again at every launch instead of loaded; each refused node is noted
    in `refusals` as "target: reason"."""
    compile_with = lookup_backend(backend) if isinstance(backend, str) else backend

    def compile_graph(gm, example_inputs):
        for node in gm.graph.nodes:
            try:
                check_node_safe(node)
            except BypassAOTAutogradCache as error:
                refusals.append(f"{node.target}: {error}")
        return compile_with(gm, example_inputs)

    return compile_graph
