"""Whether an exercise cell is still the student edition's stub, told from its source alone.

A stub's verdict is known without running it: calling a function whose whole body is
``raise NotImplementedError(...)`` raises NotImplementedError. Grading such a cell in a process of
its own (`labkit._grader_process`) would cost a Python start and a torch import for a verdict that
cannot differ, and every run of the student edition checks every stub. Anything the source does
besides defining functions and importing (a decorator, an assignment, a call, a name bound to
``NotImplementedError``) could change what the call does, so such a cell is not called a stub here
and is graded in its own process as any answer is.
"""

from __future__ import annotations

import ast

__all__: list[str] = []


def is_untouched_stub(cell_source: str, function: str) -> bool:
    """True when the cell only defines functions and imports, and ``function``'s body only raises
    NotImplementedError (after an optional docstring)."""
    try:
        module = ast.parse(cell_source)
    except SyntaxError:
        return False
    definitions = [node for node in module.body if isinstance(node, ast.FunctionDef) and node.name == function]
    return (all(_only_defines(node, function) for node in module.body) and len(definitions) == 1
            and _raises_not_implemented(definitions[0]))


def _only_defines(node: ast.stmt, function: str) -> bool:
    if isinstance(node, ast.Import | ast.ImportFrom):
        bound = {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        return not bound & {function, "NotImplementedError", "*"}
    arguments = node.args if isinstance(node, ast.FunctionDef) else None
    return (arguments is not None and not node.decorator_list and node.name != "NotImplementedError"
            and "NotImplementedError" not in {arg.arg for arg in ast.walk(arguments) if isinstance(arg, ast.arg)}
            and all(isinstance(default, ast.Constant)
                    for default in arguments.defaults + arguments.kw_defaults if default is not None))


def _raises_not_implemented(definition: ast.FunctionDef) -> bool:
    body = definition.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].cause is not None:
        return False
    raised = body[0].exc
    if isinstance(raised, ast.Call):
        if raised.keywords or not all(isinstance(arg, ast.Constant) for arg in raised.args):
            return False
        raised = raised.func
    return isinstance(raised, ast.Name) and raised.id == "NotImplementedError"
