"""`autograd_graph`: the autograd graph behind a tensor (its nodes, the tensors each saved, the
parameters the output cannot reach), as data, Graphviz DOT text or a matplotlib drawing."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from labkit.errors import LabkitError
from labkit.readings import format_bytes
from labkit.tracers._common import subplots

__all__ = ["AutogradGraph", "GraphNode", "SavedTensor", "autograd_graph"]


@dataclass(frozen=True)
class SavedTensor:
    """A tensor an autograd node saved for backward: ``name`` is the attribute without its
    ``_saved_`` prefix; ``nbytes`` is numel x element size of the saved view."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclass(frozen=True)
class GraphNode:
    """One node of an `AutogradGraph`: a backward function, or (``leaf`` set) the
    ``AccumulateGrad`` node that writes a leaf tensor's ``.grad``. ``depth`` is the longest
    path from the output's node. ``freed``: backward already released the saved tensors."""

    index: int
    name: str
    depth: int
    saved: tuple[SavedTensor, ...]
    freed: bool
    leaf: str | None


@dataclass(frozen=True)
class AutogradGraph:
    """The autograd graph behind a tensor, walked from its ``grad_fn`` through
    ``next_functions``: what `autograd_graph` returns.

    ``edges`` are ``(node, next_node)`` index pairs in the direction gradient flows (one per
    input, so repeated pairs mean a tensor used twice). ``leaves``: names of the leaf tensors
    reached. ``unreachable_params``: parameters that require grad but no path reaches: this is
    where gradient flow is cut (``detach()``, ``no_grad``, or not used). ``frozen_params``:
    ``requires_grad=False``."""

    nodes: tuple[GraphNode, ...]
    edges: tuple[tuple[int, int], ...]
    unreachable_params: tuple[str, ...]
    frozen_params: tuple[str, ...]

    @property
    def leaves(self) -> list[str]:
        return [node.leaf for node in self.nodes if node.leaf is not None]

    def to_dot(self) -> str:
        """The graph as Graphviz DOT text (no Graphviz needed to produce it)."""
        lines = ["digraph autograd {", '  node [shape=box, fontname="Helvetica"];']
        for node in self.nodes:
            style = ', shape=ellipse, style=filled, fillcolor="lightblue"' if node.leaf else ""
            lines.append(f'  n{node.index} [label="{_dot_escape(_node_label(node))}"{style}];')
        lines += [f"  n{src} -> n{dst};" for src, dst in self.edges]
        for k, (name, note) in enumerate(self._cut_params()):
            lines.append(f'  cut{k} [label="{_dot_escape(name)}\\n({note})", color=red, style=dashed];')
        lines.append("}")
        return "\n".join(lines)

    def draw(self) -> Any:
        """Draw the graph with matplotlib in layers by depth: the output's node on top, leaves
        (blue) below, cut parameters (red, dashed) in a last row. Returns the figure."""
        layers: dict[int, list[GraphNode]] = {}
        for node in self.nodes:
            layers.setdefault(node.depth, []).append(node)
        cut = self._cut_params()
        rows = len(layers) + (1 if cut else 0)
        widest = max([len(nodes) for nodes in layers.values()] + [len(cut)])
        fig, ax = subplots(figsize=(max(4.0, 2.6 * widest), max(3.0, 1.3 * rows)))
        where = {}
        for depth, nodes in layers.items():
            for k, node in enumerate(nodes):
                where[node.index] = (k - (len(nodes) - 1) / 2, -depth)
        for src, dst in self.edges:
            ax.annotate("", xy=where[dst], xytext=where[src],
                        arrowprops={"arrowstyle": "->", "color": "0.4", "shrinkA": 14, "shrinkB": 14})  # fmt: skip
        for node in self.nodes:
            colour = "lightblue" if node.leaf else "lightyellow"
            ax.text(*where[node.index], _node_label(node), ha="center", va="center", fontsize=7,
                    bbox={"boxstyle": "round", "facecolor": colour})  # fmt: skip
        for k, (name, note) in enumerate(cut):
            ax.text(k - (len(cut) - 1) / 2, -len(layers), f"{name}\n({note})", ha="center",
                    va="center", fontsize=7, color="red",
                    bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "red", "linestyle": "--"})  # fmt: skip
        ax.set_xlim(-widest / 2 - 0.5, widest / 2 + 0.5)
        ax.set_ylim(-rows + 0.5, 0.5)
        ax.axis("off")
        return fig

    def _cut_params(self) -> list[tuple[str, str]]:
        return [(name, "unreachable") for name in self.unreachable_params] + [
            (name, "frozen") for name in self.frozen_params
        ]


def autograd_graph(
    output: torch.Tensor,
    params: nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | None = None,
) -> AutogradGraph:
    """Walk the autograd graph that ``output.backward()`` would traverse. Used in
    ``01_computation_graph``.

    ``params`` (a model, a dict, or ``model.named_parameters()``) names the leaves and lets the
    graph report parameters the output cannot reach. Saved tensors are read from each node's
    ``_saved_*`` attributes; after a backward without ``retain_graph=True`` they are gone and the
    node says ``freed``."""
    if not isinstance(output, torch.Tensor):
        raise LabkitError(f"autograd_graph walks from a tensor, got {type(output).__name__}")
    if output.grad_fn is None:
        raise LabkitError(
            "this tensor has no grad_fn, so there is no graph behind it: it is a leaf, or it was "
            "computed under torch.no_grad() or from detached tensors; pass the loss itself"
        )
    named = _named_params(params)
    functions, edges = _walk(output.grad_fn)
    depths = _longest_depths(len(functions), edges)
    names = {id(tensor): name for name, tensor in named.items()}
    nodes = tuple(_graph_node(k, fn, depths[k], names) for k, fn in enumerate(functions))
    reached = {id(fn.variable) for fn in functions if hasattr(fn, "variable")}
    unreachable = tuple(n for n, p in named.items() if p.requires_grad and id(p) not in reached)
    frozen = tuple(n for n, p in named.items() if not p.requires_grad)
    return AutogradGraph(nodes, tuple(edges), unreachable, frozen)


def _named_params(params: Any) -> dict[str, torch.Tensor]:
    if params is None:
        return {}
    if isinstance(params, nn.Module):
        return dict(params.named_parameters())
    usage = "pass the model, a dict of name -> tensor, or model.named_parameters()"
    if isinstance(params, Mapping):
        pairs = list(params.items())
    elif isinstance(params, (str, bytes, torch.Tensor)) or not isinstance(params, Iterable):
        raise LabkitError(f"params cannot be a {type(params).__name__}: {usage}")
    else:
        pairs = list(params)
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise LabkitError(
                f"params must hold (name, tensor) pairs, found a {type(pair).__name__}: {usage}"
            )
        name, tensor = pair
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise LabkitError(
                f"params must map str names to tensors, found {type(name).__name__} -> "
                f"{type(tensor).__name__} ({name!r}): {usage}"
            )
    return dict(pairs)


def _walk(root: Any) -> tuple[list[Any], list[tuple[int, int]]]:
    # Breadth-first, so node numbering follows distance from the output and is reproducible.
    functions, index, edges = [root], {id(root): 0}, []
    queue = deque([root])
    while queue:
        fn = queue.popleft()
        for next_fn, _ in fn.next_functions:
            if next_fn is None:
                continue
            if id(next_fn) not in index:
                index[id(next_fn)] = len(functions)
                functions.append(next_fn)
                queue.append(next_fn)
            edges.append((index[id(fn)], index[id(next_fn)]))
    return functions, edges


def _longest_depths(count: int, edges: list[tuple[int, int]]) -> list[int]:
    # Longest path from the root in topological order, so every node sits below all its users.
    users = [0] * count
    targets: list[list[int]] = [[] for _ in range(count)]
    for src, dst in edges:
        users[dst] += 1
        targets[src].append(dst)
    depth, ready = [0] * count, deque([0])
    while ready:
        node = ready.popleft()
        for dst in targets[node]:
            depth[dst] = max(depth[dst], depth[node] + 1)
            users[dst] -= 1
            if users[dst] == 0:
                ready.append(dst)
    return depth


def _graph_node(index: int, fn: Any, depth: int, names: dict[int, str]) -> GraphNode:
    leaf = None
    if hasattr(fn, "variable"):
        tensor = fn.variable
        leaf = names.get(id(tensor), f"leaf {tuple(tensor.shape)}")
    saved, freed = _saved_tensors(fn)
    return GraphNode(index, type(fn).__name__, depth, saved, freed, leaf)


def _saved_tensors(fn: Any) -> tuple[tuple[SavedTensor, ...], bool]:
    saved = []
    for attribute in sorted(a for a in dir(fn) if a.startswith("_saved_")):
        try:
            value = getattr(fn, attribute)
        except RuntimeError as error:
            failure = _saved_tensor_failure(error)
            if failure == "modified in place":
                raise LabkitError(
                    f"{type(fn).__name__} saved a tensor that was modified in place after the forward "
                    "(an optimizer.step() or an in-place op), so its saved values are gone: call "
                    "autograd_graph right after the forward, before anything updates tensors in place"
                ) from error
            if failure != "freed":
                raise
            return (), True
        values = value if isinstance(value, (tuple, list)) else (value,)
        label = attribute.removeprefix("_saved_")
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        for k, tensor in enumerate(tensors):
            saved.append(SavedTensor(
                label if len(tensors) == 1 else f"{label}[{k}]", tuple(tensor.shape),
                str(tensor.dtype).removeprefix("torch."), tensor.numel() * tensor.element_size(),
            ))  # fmt: skip
    return tuple(saved), False


# The two messages torch raises when a node's `_saved_*` attribute cannot be unpacked, both from
# SavedVariable::unpack in torch/csrc/autograd/saved_variable.cpp (as torch 2.13 words them),
# matched by a fragment each:
# - ERR_BACKWARD_TWICE: "Trying to backward through the graph a second time (or directly access
#   saved tensors after they have already been freed). ..."
# - the version check: "one of the variables needed for gradient computation has been modified by
#   an inplace operation: [...] is at version 2; expected version 1 instead. ..."
# tests/test_tracers.py triggers both for real, so a torch that rewords one fails that test by name.
_FREED_MESSAGE = "after they have already been freed"
_MODIFIED_IN_PLACE_MESSAGE = "modified by an inplace operation"


def _saved_tensor_failure(error: RuntimeError) -> Literal["freed", "modified in place"] | None:
    """Why torch refused to unpack a saved tensor, from the text of its RuntimeError: ``"freed"``
    (a backward without ``retain_graph=True`` released it), ``"modified in place"`` (its version
    counter moved since the forward), or ``None`` for any other error.

    Reading the message is the only way: both failures are plain RuntimeErrors, the version a
    tensor had when it was saved is not exposed to Python (only the current ``_version``), and the
    saved-tensor handles that could say "freed" without raising (`labkit._torch_compat.raw_saved_tensors`)
    are private and undocumented."""
    text = str(error)
    if _FREED_MESSAGE in text:
        return "freed"
    if _MODIFIED_IN_PLACE_MESSAGE in text:
        return "modified in place"
    return None


def _node_label(node: GraphNode) -> str:
    if node.leaf is not None:
        return node.leaf
    details = [f"{s.name}: {list(s.shape)} {s.dtype} {format_bytes(s.nbytes)}" for s in node.saved]
    if node.freed:
        details = ["saved tensors freed"]
    return "\n".join([node.name, *details])



def _dot_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

