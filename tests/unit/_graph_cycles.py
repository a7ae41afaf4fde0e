"""The circles of a directed graph, for the tests that forbid them.

``test_import_graph.py`` (the package's modules) and
``test_rust_module_graph.py`` (the Rust crates' files and directories)
both fail on a strongly connected component of more than one node.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping
from typing import TypeVar

Node = TypeVar("Node", bound=Hashable)


def cycles(graph: Mapping[Node, Iterable[Node]]) -> list[list[Node]]:
    """The strongly connected components of more than one node (Tarjan, iterative).

    Args:
        graph: each node's successors (a set, a list, or a dict keyed by
            them). A successor need not be a key itself: it then has none.

    Returns:
        Each component's nodes, sorted; nodes and successors are visited in
        sorted order, so the result is the same on every run. Nodes are
        ordered by ``str`` (strings as they are, paths by their text).
    """
    index: dict[Node, int] = {}
    low: dict[Node, int] = {}
    stack: list[Node] = []
    on_stack: set[Node] = set()
    found: list[list[Node]] = []

    def enter(node: Node) -> Iterator[Node]:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        return iter(sorted(graph.get(node, ()), key=str))

    for start in sorted(graph, key=str):
        if start in index:
            continue
        work = [(start, enter(start))]
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    work.append((child, enter(child)))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component, key=str))
    return found
