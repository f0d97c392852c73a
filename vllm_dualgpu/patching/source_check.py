"""The source a patch was written against: one digest, read live or from the file on disk.

A patch that replaces a function's body (instead of wrapping it) pins the digest of the source it
mirrors (``Patch.source_sha256``); :mod:`vllm_dualgpu.patching.core` skips it when the installed
function's source differs. The front end needs the same answer without importing the module
(vLLM keeps model modules out of the API-server process), so :func:`check_in_file` finds the
function in the module's file with :mod:`ast` and digests the same lines.

Both read the function's lines from its first decorator to its last statement, dedented, with
trailing whitespace removed; this module imports nothing from vLLM.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import textwrap
from collections.abc import Callable


def digest(lines: list[str]) -> str:
    text = textwrap.dedent("".join(line if line.endswith("\n") else line + "\n" for line in lines))
    body = "\n".join(line.rstrip() for line in text.strip("\n").splitlines())
    return hashlib.sha256(body.encode()).hexdigest()


def function_digest(func: Callable) -> str:
    """Digest of a live function's source (raises OSError/TypeError when it has none)."""
    lines, _ = inspect.getsourcelines(func)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    node = tree.body[0]
    # getsourcelines may run past the last statement (comments, blank lines): cut as ast does.
    return digest(lines[: node.end_lineno])


def _find(tree: ast.Module, qualname: str) -> ast.FunctionDef | None:
    scope: list[ast.stmt] = tree.body
    *path, name = qualname.split(".")
    for part in path:
        cls = next((n for n in scope if isinstance(n, ast.ClassDef) and n.name == part), None)
        if cls is None:
            return None
        scope = cls.body
    return next(
        (n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name),
        None,
    )


def _params(node: ast.FunctionDef) -> tuple[str, ...]:
    a = node.args
    names = [p.arg for p in (*a.posonlyargs, *a.args)]
    if a.vararg:
        names.append(a.vararg.arg)
    names += [p.arg for p in a.kwonlyargs]
    if a.kwarg:
        names.append(a.kwarg.arg)
    return tuple(names)


def check_in_file(target: str, params: tuple[str, ...], sha256: str = "", names: tuple[str, ...] = ()) -> str:
    """What core's checks would say about ``module:Qualified.name``, read from the file without
    importing it: "" when it is there with these parameters (and this source digest, if given,
    and a source naming every one of ``names``), else the reason."""
    module = target.split(":", 1)[0]
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        return f"{module} cannot be found: {exc}"
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return f"{module} has no Python source"
    return check_in_path(spec.origin, target, params, sha256, names)


def check_in_path(path: str, target: str, params: tuple[str, ...], sha256: str = "",
                  names: tuple[str, ...] = ()) -> str:
    """:func:`check_in_file` for the module's source at ``path`` (a release's unpacked tree)."""
    qualname = target.split(":", 1)[1]
    with open(path, encoding="utf-8") as f:
        source = f.read()
    node = _find(ast.parse(source), qualname)
    if node is None:
        return f"{target} not found in {path}"
    found = _params(node)
    if found != params:
        return f"{target} takes ({', '.join(found)}), expected ({', '.join(params)})"
    first = min([d.lineno for d in node.decorator_list] + [node.lineno])
    lines = source.splitlines(keepends=True)[first - 1 : node.end_lineno]
    if sha256 and digest(lines) != sha256:
        return source_mismatch(target, digest(lines), sha256)
    absent = [n for n in names if n not in "".join(lines)]
    if absent:
        return f"{target} no longer uses {', '.join(absent)}"
    return ""


def source_mismatch(target: str, found: str, expected: str) -> str:
    return (
        f"the source of {target} is not the one this patch was written against "
        f"(sha256 {found[:12]}..., expected {expected[:12]}...)"
    )
