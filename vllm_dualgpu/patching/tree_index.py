"""An index of a vLLM source tree read with :mod:`ast`: who copies a name, who overrides a method.

Used by :mod:`vllm_dualgpu.patching.static_check` for a release it does not install. Two
questions a registry entry rests on:

- which modules hold a ``from <module> import <name>`` copy of a module-level function (a copy
  made at import time keeps the original when only the target is replaced). Only imports that run
  when the module is imported count: those at module level, in ``if``/``try``/``with`` blocks,
  not in a function (those bind at call time) nor under ``if TYPE_CHECKING:`` (never run). A copy
  of a copy counts, under any alias.
- which classes derive from a class (directly, through an alias, a package's re-export or a
  module alias) and define a given method themselves.

It imports nothing from vLLM.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ModuleInfo:
    name: str
    is_package: bool
    from_imports: dict[str, tuple[str, str]] = field(default_factory=dict)
    """local name -> (source module, name there), for imports run at import time."""
    star_imports: list[str] = field(default_factory=list)
    module_aliases: dict[str, str] = field(default_factory=dict)
    """local name -> module (``import a.b as c``: c -> a.b; ``import a.b``: a -> a)."""
    classes: dict[str, tuple[list[ast.expr], set[str]]] = field(default_factory=dict)
    """top-level class -> (base expressions, names defined in its body)."""
    calls_base: dict[str, set[str]] = field(default_factory=dict)
    """class -> its methods that run the inherited method of their name (``super().m(...)`` or
    ``Base.m(self, ...)``): an override that still reaches a patched base method."""


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _run_at_import(body: list[ast.stmt]):
    """The statements of a module body that run when it is imported (blocks entered)."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _run_at_import(node.body)
            yield from _run_at_import(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _run_at_import(block)
        elif isinstance(node, ast.With):
            yield from _run_at_import(node.body)


def _defined_names(body: list[ast.stmt]) -> set[str]:
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _methods_calling_base(cls: ast.ClassDef) -> set[str]:
    bases = {_dotted(b) for b in cls.bases} - {None}
    found = set()
    for node in cls.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for call in ast.walk(node):
            func = getattr(call, "func", None) if isinstance(call, ast.Call) else None
            if not isinstance(func, ast.Attribute) or func.attr != node.name:
                continue
            owner = func.value
            if (isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name)
                    and owner.func.id == "super") or _dotted(owner) in bases:
                found.add(node.name)
    return found


def _assigned_from(info: ModuleInfo, value: ast.expr) -> tuple[str, str] | None:
    """(module, name) a module-level ``x = <name or dotted name>`` binds, when it can be told."""
    dotted = _dotted(value)
    if dotted is None:
        return None
    if "." not in dotted:
        return info.from_imports.get(dotted)
    head, rest = dotted.split(".", 1)
    if head in info.module_aliases:
        alias = info.module_aliases[head]
        full = dotted if alias == head else f"{alias}.{rest}"
    elif head in info.from_imports:
        origin, there = info.from_imports[head]
        full = f"{origin}.{there}.{rest}"
    else:
        return None
    owner, attr = full.rsplit(".", 1)
    return owner, attr


def _absolute(info: ModuleInfo, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = info.name.split(".")
    package = parts if info.is_package else parts[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def read_module(name: str, is_package: bool, source: str) -> ModuleInfo:
    info = ModuleInfo(name, is_package)
    tree = ast.parse(source)
    for node in _run_at_import(tree.body):
        if isinstance(node, ast.ImportFrom):
            origin = _absolute(info, node)
            for alias in node.names:
                if alias.name == "*":
                    info.star_imports.append(origin)
                else:
                    info.from_imports[alias.asname or alias.name] = (origin, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    info.module_aliases[alias.asname] = alias.name
                else:
                    head = alias.name.split(".")[0]
                    info.module_aliases[head] = head
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            origin = _assigned_from(info, node.value)  # `g = f`, `_f = vllm.a.f`: copies too
            if origin:
                info.from_imports[node.targets[0].id] = origin
        elif isinstance(node, ast.ClassDef):
            info.classes[node.name] = (list(node.bases), _defined_names(node.body))
            info.calls_base[node.name] = _methods_calling_base(node)
    return info


def _dotted(expr: ast.expr) -> str | None:
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        head = _dotted(expr.value)
        return f"{head}.{expr.attr}" if head else None
    return None


class TreeIndex:
    """Every module of the ``vllm`` package under ``root``."""

    def __init__(self, root: Path, package: str = "vllm"):
        self.modules: dict[str, ModuleInfo] = {}
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            try:
                source = path.read_text(encoding="utf-8")
                self.modules[name] = read_module(name, is_package, source)
            except (SyntaxError, UnicodeDecodeError):
                continue  # a template or a file for another Python: not imported as is

    # -- copies ---------------------------------------------------------------------------------
    def copies_of(self, module: str, name: str) -> list[tuple[str, str]]:
        """(module, local name) of every module-level copy of ``module.name`` (copies of copies
        and copies by assignment included), sorted; the target's own binding excluded."""
        holders = {(module, name)}
        changed = True
        while changed:
            changed = False
            for info in self.modules.values():
                for local, origin in info.from_imports.items():
                    if origin in holders and (info.name, local) not in holders:
                        holders.add((info.name, local))
                        changed = True
                for origin in info.star_imports:
                    for held_module, held in list(holders):
                        if held_module == origin and not held.startswith("_") \
                                and (info.name, held) not in holders:
                            holders.add((info.name, held))
                            changed = True
        holders.discard((module, name))
        return sorted(holders)

    # -- classes --------------------------------------------------------------------------------
    def resolve_name(self, module: str, name: str, depth: int = 0) -> str | None:
        """``module:Class`` that ``name`` in ``module`` is, following imports and re-exports."""
        info = self.modules.get(module)
        if info is None or depth > 20:
            return None
        if name in info.classes:
            return f"{module}:{name}"
        if name in info.from_imports:
            origin, there = info.from_imports[name]
            return self.resolve_name(origin, there, depth + 1)
        return None

    def resolve_base(self, module: str, expr: ast.expr) -> str | None:
        dotted = _dotted(expr)
        if dotted is None:
            return None
        if "." not in dotted:
            return self.resolve_name(module, dotted)
        head, rest = dotted.split(".", 1)
        info = self.modules[module]
        if head in info.module_aliases:
            full = f"{info.module_aliases[head]}.{rest}" if info.module_aliases[head] != head \
                else dotted
        elif head in info.from_imports and info.from_imports[head][0]:
            origin, there = info.from_imports[head]
            full = f"{origin}.{there}.{rest}"  # from vllm import platforms; platforms.X
        else:
            return None
        owner, attr = full.rsplit(".", 1)
        return self.resolve_name(owner, attr)

    def overrides_of(self, cls: str, method: str) -> list[str]:
        """``module:Class`` of every class deriving from ``cls`` that defines ``method`` without
        running the inherited one (an override calling ``super().method`` reaches the base)."""
        children: dict[str, list[str]] = {}
        for info in self.modules.values():
            for name, (bases, _) in info.classes.items():
                for base in bases:
                    resolved = self.resolve_base(info.name, base)
                    if resolved:
                        children.setdefault(resolved, []).append(f"{info.name}:{name}")
        found, seen, queue = [], {cls}, list(children.get(cls, ()))
        while queue:
            sub = queue.pop(0)
            if sub in seen:
                continue
            seen.add(sub)
            module, name = sub.split(":", 1)
            info = self.modules[module]
            if method in info.classes[name][1] and method not in info.calls_base[name]:
                found.append(sub)
            queue.extend(children.get(sub, ()))
        return sorted(found)
