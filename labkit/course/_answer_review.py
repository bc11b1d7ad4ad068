"""What in a passing answer an instructor should read before trusting its grade.

The verdict that counts is computed where an answer cannot reach its check (`labkit._grader_process`), but
a few facts a check judges are noted in the answer's own process (the route an exercise's answer took, a
lab's repaired run), and a lab's defect-free stages ship in labkit, where every learner's kernel can read
them (docs/COURSE.md says which forgeries that leaves). An answer written against the check rather than the
lesson needs means that no lesson of the workbook calls for: the call stack or the garbage collector's
objects (where a check keeps its notes), raw file descriptors and the kernel's files of a process (the
channel to the judge, the memory counts a check reads), private names (a lab's draw and its fix), a
function's code or source, a change to a module or to the environment, or names made at run time (``eval``,
``__import__``, ``vars``), which would hide the others from this reading.

`reaches` names those a cell's source uses, read from its syntax tree (nothing runs). ``labkit progress``
and nbgrader's regrade print them beside a pass; the pass stands, and the instructor reads the cell. It
reads what is written: a learner set on hiding a means from it can (a name spelt with ``chr``), but the
forgeries as written, and their plain disguises (``getattr(lab, "_lab")``, ``"_lab"`` kept in a variable),
are marked.
"""

from __future__ import annotations

import ast

__all__: list[str] = []

FRAMES = "the call stack or the garbage collector's objects"
DESCRIPTORS = "raw file descriptors"
PROC = "the kernel's files of a process"
PRIVATE = "private names"
CODE = "a function's code or source"
PATCH = "a change to a module or to the environment"
DYNAMIC = "names made at run time"
TOO_DEEP = "expressions nested too deeply to read"

# Functions, by the name they are imported under, that only an answer written against its check calls.
CALLS = {
    FRAMES: {"sys._getframe", "sys._current_frames", "inspect.currentframe", "inspect.stack", "inspect.trace",
             "inspect.getouterframes", "inspect.getinnerframes", "traceback.walk_stack", "traceback.extract_stack",
             "gc.get_objects", "gc.get_referrers", "gc.get_referents"},
    DESCRIPTORS: {*(f"os.{name}" for name in ("read", "readv", "pread", "write", "writev", "pwrite", "dup", "dup2",
                                              "fdopen", "sendfile", "pipe")),
                  "socket.socket", "socket.fromfd", "socket.socketpair"},
    CODE: {"inspect.getsource", "inspect.getsourcelines", "inspect.getsourcefile", "inspect.getfile",
           "linecache.getline", "linecache.getlines", "types.CodeType", "types.FunctionType"},
    PATCH: {"os.putenv", "os.unsetenv", "object.__setattr__", "object.__delattr__",
            *(f"os.environ.{name}" for name in ("pop", "popitem", "clear", "update", "setdefault", "__delitem__"))},
    # what turns a string into a name, so that the names above need not be written out
    DYNAMIC: {"eval", "exec", "__import__", "vars", "globals", "locals", "importlib.import_module",
              "builtins.__import__", "builtins.eval", "builtins.exec"},
}
# Attributes that lead to the same places, whatever object they are read from.
ATTRIBUTES = {
    FRAMES: {"f_back", "f_locals", "f_globals", "f_builtins", "tb_frame", "gi_frame", "cr_frame", "ag_frame"},
    CODE: {"__code__", "__globals__", "__closure__", "__defaults__", "__kwdefaults__", "__file__"},
    DYNAMIC: {"__dict__", "__getattribute__", "__subclasses__", "__builtins__", "__bases__", "__mro__"},
}
# Built-ins that reach an attribute by its name as a string: a written-out name is judged as the attribute.
BY_NAME = ("getattr", "setattr", "delattr", "hasattr")
# What an exercise or lab cell may use without importing it (`labkit.grading.EXERCISE_NAMESPACE`).
PRESET = {"torch": "torch", "nn": "torch.nn", "F": "torch.nn.functional", "np": "numpy", "math": "math"}
# Where the kernel keeps a process's counts and descriptors: a path an answer names to read or reset them.
PROC_PATHS = ("/proc/", "/dev/fd/")
ORDER = (FRAMES, DESCRIPTORS, PROC, PRIVATE, CODE, PATCH, DYNAMIC)
MAX_EXAMPLE_CHARS = 40


def reaches(source: str) -> tuple[str, ...]:
    """Each means of `ORDER` that ``source`` uses, with its first use: ``"raw file descriptors (os.write)"``.
    Empty for a cell that does not compile (nesting past the parser's limit included): it cannot pass."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError):
        return ()
    try:
        return _reached(tree)
    except RecursionError:  # a chain of a thousand attributes compiles and runs, and is past reading here
        return (f"{TOO_DEEP} (its syntax tree is deeper than Python's recursion limit)",)


def _reached(tree: ast.AST) -> tuple[str, ...]:
    names = _imported_names(tree)
    modules = {path.split(".")[0] for path in names.values()} | {"builtins"}
    found: dict[str, str] = {}
    in_reading_order = sorted(ast.walk(tree), key=lambda node: (getattr(node, "lineno", 0), getattr(node, "col_offset", 0)))
    for node in in_reading_order:
        for means, example in _uses(node, names, modules):
            found.setdefault(means, example)
    return tuple(f"{means} ({found[means]})" for means in ORDER if means in found)


def _imported_names(tree: ast.AST) -> dict[str, str]:
    """What each name the cell binds by import (or finds preset) stands for, as a dotted path."""
    names = dict(PRESET)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.AST, names: dict[str, str]) -> str | None:
    """``node`` as the dotted path it names (``lab._lab.variant``), imports resolved; None past a call or index."""
    if isinstance(node, ast.Name):
        return names.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, names)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _uses(node: ast.AST, names: dict[str, str], modules: set[str]):
    """(means, example) for what ``node`` itself uses; ``modules`` are the top-level modules the cell imports."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield from _imports(node)
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
        if node.value.startswith(PROC_PATHS):
            yield PROC, _shown(node)
        elif node.value.isidentifier() and _private(node.value) and len(node.value) > 1:
            yield PRIVATE, _shown(node)  # a private name kept as a string, to be looked up later
    elif isinstance(node, ast.Name | ast.Attribute):
        path = _dotted(node, names)
        called = next((means for means, paths in CALLS.items() if path in paths), None)
        if called:
            yield called, path
        elif isinstance(node, ast.Attribute):
            yield from _attribute(node.value, node.attr, path or f"….{node.attr}", names, modules)
    if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
        targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
        yield from ((PATCH, _shown(target)) for target in targets if _patches(target, names, modules))
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in BY_NAME and node.args:
        yield from _by_name(node, names, modules)


def _by_name(call: ast.Call, names: dict[str, str], modules: set[str]):
    """``getattr(lab, "_lab")`` as the attribute it names. A name computed from variables is an idiom of the lessons
    (``getattr(model, name)``): the private strings it could be made of are marked where they are written."""
    named = call.args[1] if len(call.args) > 1 else None
    if isinstance(named, ast.Constant) and isinstance(named.value, str):
        yield from _attribute(call.args[0], named.value, _shown(call), names, modules)
    if call.func.id in ("setattr", "delattr") and _root(call.args[0], names) in modules:
        yield PATCH, _shown(call)


def _imports(node: ast.Import | ast.ImportFrom):
    paths = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
             else [f"{node.module}.{alias.name}" for alias in node.names] if node.module else [])
    for path in paths:
        called = next((means for means, calls in CALLS.items() if path in calls), None)
        if called:
            yield called, path
        elif path.split(".")[0] == "labkit" and any(_private(part) for part in path.split(".")):
            yield PRIVATE, path  # another library's private names are its own business (05's _BatchNorm)


def _attribute(base: ast.AST, attribute: str, shown: str, names: dict[str, str], modules: set[str]):
    """``attribute`` of ``base``: a frame's, a function's or a namespace's; or a private one, unless it is the cell's
    own (``self._x``) or a library's other than labkit (``torch.nn.modules.batchnorm._BatchNorm``, an idiom of the
    lessons)."""
    for means, attributes in ATTRIBUTES.items():
        if attribute in attributes:
            yield means, shown
            return
    root = _root(base, names)
    library = root in modules and root != "labkit"
    own = isinstance(base, ast.Name) and base.id in ("self", "cls")
    if _private(attribute) and not own and not library:
        yield PRIVATE, shown


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _root(node: ast.AST, names: dict[str, str]) -> str | None:
    while isinstance(node, ast.Attribute | ast.Subscript):
        node = node.value
    return names.get(node.id, node.id).split(".")[0] if isinstance(node, ast.Name) else None


def _patches(target: ast.AST, names: dict[str, str], modules: set[str]) -> bool:
    """Whether assigning (or deleting) ``target`` changes an imported module's attribute or item:
    ``torch.Tensor.abs``, ``json.dumps``, ``os.environ['X']``; a plain name or a local object's attribute does not."""
    return isinstance(target, ast.Attribute | ast.Subscript) and _root(target, names) in modules


def _shown(node: ast.AST) -> str:
    text = ast.unparse(node)
    return text if len(text) <= MAX_EXAMPLE_CHARS else text[:MAX_EXAMPLE_CHARS - 1] + "…"
