"""Check the registry against a vLLM release's source tree, without importing vLLM.

``python -m vllm_dualgpu.patching.static_check --vllm-tree DIR --version X [--all]``

``DIR`` holds the ``vllm`` package (an unpacked wheel or a site-packages folder). For every
registry entry whose range includes ``X`` (``--all``: every entry) it reads the target's module
file and checks what :func:`vllm_dualgpu.patching.core.apply_patch` would check first: the
target exists, takes the declared parameters, and has the pinned source digest. Copies
(``from x import f`` holders) are checked to import the name. Then what "applied" would leave
unchanged (:mod:`vllm_dualgpu.patching.tree_index`): every module of the tree holding a copy of
a patched module-level function that ``copies`` does not list (core rebinds only those), and
every subclass that overrides a patched method (the base-class patch would not reach it). The
interventions (:mod:`vllm_dualgpu.patching.interventions`) whose object is in vLLM's tree are
checked too: the object exists (in its class or a base), takes the declared parameters, its
source names the declared names, and no subclass overrides a method relied on. A finding that
is a false alarm is allowed, with why, in :mod:`vllm_dualgpu.patching.static_allowed`. Entries
whose target is not in vLLM's tree (torch's, an environment variable, a native symbol) are not
checked here. Exit status 1 when any in-range entry fails, so CI can run it for releases it
does not install.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

from vllm_dualgpu.patching.core import Patch, version_in_range
from vllm_dualgpu.patching.source_check import _params, check_in_path
from vllm_dualgpu.patching.tree_index import TreeIndex


def module_path(tree: Path, module: str) -> Path | None:
    base = tree.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports_name(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(
        isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names)
        for node in ast.walk(tree)
    )


def _unreached(index: TreeIndex, entry, target: str, allowed: dict) -> str:
    """Copies not rebound and overrides not reached: "" when there are none (or all allowed)."""
    module, qualname = target.split(":", 1)
    listed = set(getattr(entry, "copies", ()))
    problems = []
    if "." not in qualname and isinstance(entry, Patch):
        held = [(m, local) for m, local in index.copies_of(module, qualname)
                if (target, m) not in allowed]
        stale = [m for m, local in held if local == qualname and m not in listed]
        if stale:
            problems.append(f"copies of {qualname} that copies does not list: {', '.join(stale)}")
        # core rebinds the holder's attribute of the target's own name only
        renamed = [f"{m} as {local}" for m, local in held if local != qualname]
        if renamed:
            problems.append(f"copies of {qualname} under another name (core rebinds only "
                            f"{qualname}): {', '.join(renamed)}")
    if "." in qualname:
        cls, method = qualname.rsplit(".", 1)
        if "." not in cls:
            found = index.overrides_of(f"{module}:{cls}", method)
            over = [c for c in found if (target, c) not in allowed]
            if over:
                problems.append(f"subclasses override {method}: {', '.join(over)}")
    return "; ".join(problems)


def check_entry(tree: Path, patch: Patch, index: TreeIndex | None = None,
                allowed: dict | None = None) -> str:
    """"" when the entry's target, parameters, pin and copies match the tree, else the reason."""
    path = module_path(tree, patch.module)
    if path is None:
        return f"module {patch.module} not in {tree}"
    reason = check_in_path(str(path), patch.target, patch.params, patch.source_sha256)
    if reason:
        return reason
    attr = patch.qualname.rsplit(".", 1)[-1]
    for holder in patch.copies:
        holder_path = module_path(tree, holder)
        if holder_path is None:
            return f"copy holder {holder} not in {tree}"
        if not _imports_name(holder_path, attr):
            return f"copy holder {holder} no longer imports {attr}"
    if index is None:
        return ""
    return _unreached(index, patch, patch.target, _allowed(allowed))


def _find_member(index: TreeIndex, tree: Path, module: str, qualname: str, depth: int = 0):
    """(the AST node defining ``qualname`` in ``module``, the module's source), a class's bases
    searched too; None when not found."""
    path = module_path(tree, module)
    if path is None or depth > 20:
        return None
    source = path.read_text(encoding="utf-8")
    scope = ast.parse(source).body
    *owners, name = qualname.split(".")
    cls = None
    for part in owners:
        cls = next((n for n in scope if isinstance(n, ast.ClassDef) and n.name == part), None)
        if cls is None:
            return None
        scope = cls.body
    for node in scope:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node, source
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return node, source
    if cls is not None and len(owners) == 1 and module in index.modules:
        for base in cls.bases:
            resolved = index.resolve_base(module, base)
            if resolved:
                base_module, base_cls = resolved.split(":", 1)
                found = _find_member(index, tree, base_module, f"{base_cls}.{name}", depth + 1)
                if found is not None:
                    return found
    return None


def check_intervention(tree: Path, item, index: TreeIndex, allowed: dict | None = None) -> str:
    """"" when the intervention's object is in the tree as declared and no subclass overrides
    the method it relies on, else the reason."""
    target = item.check_target
    module, qualname = target.split(":", 1)
    if module_path(tree, module) is None:
        return f"module {module} not in {tree}"
    found_member = _find_member(index, tree, module, qualname)
    if found_member is None:
        return f"{target} not found in {tree}"
    node, source = found_member
    is_function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    if item.params is not None:
        if not is_function:
            return f"{target} is not a function"
        found = _params(node)
        if found != tuple(item.params):
            return f"{target} takes ({', '.join(found)}), expected ({', '.join(item.params)})"
    if item.source_names:
        text = ast.get_source_segment(source, node) or ""
        absent = [n for n in item.source_names if n not in text]
        if absent:
            return f"{target} no longer uses {', '.join(absent)}"
    return _unreached(index, item, item.target if ":" in item.target else target, _allowed(allowed))


def _allowed(allowed: dict | None) -> dict:
    if allowed is not None:
        return allowed
    from vllm_dualgpu.patching.static_allowed import ALLOWED

    return ALLOWED


def in_tree(entry) -> bool:
    """Whether the entry's object is a Python name in vLLM's tree (not torch's, not an
    environment variable, not a native symbol read by a probe)."""
    target = getattr(entry, "check_target", entry.target)
    return ":" in target and target.split(".")[0].split(":")[0] == "vllm" \
        and not getattr(entry, "probe", "")


def check_tree(tree: Path, version: str, patches, every: bool = False, interventions=(),
               allowed: dict | None = None) -> list[tuple[object, str]]:
    """(entry, reason) for each checked patch, then each checked intervention; reason "" means
    it matches."""
    index = TreeIndex(tree)
    chosen = [e for e in (*patches, *interventions)
              # torch's targets (the virtual-GPU emulation) are not in vLLM's tree
              if in_tree(e) and (every or version_in_range(version, e.vllm_versions))]
    return [
        (e, check_entry(tree, e, index, allowed) if isinstance(e, Patch)
         else check_intervention(tree, e, index, allowed))
        for e in chosen
    ]


def main(argv: list[str] | None = None) -> int:
    from vllm_dualgpu.patching.interventions import INTERVENTIONS
    from vllm_dualgpu.patching.registry import PATCHES

    ap = argparse.ArgumentParser(prog="python -m vllm_dualgpu.patching.static_check",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-tree", required=True, type=Path,
                    help="folder holding the vllm package (an unpacked wheel)")
    ap.add_argument("--version", required=True, help="the release the tree is, e.g. 0.31.0")
    ap.add_argument("--all", action="store_true",
                    help="also check entries whose range excludes the release (report only)")
    args = ap.parse_args(argv)
    if module_path(args.vllm_tree, "vllm") is None:
        print(f"error: no vllm package in {args.vllm_tree}", file=sys.stderr)
        return 2
    results = check_tree(args.vllm_tree, args.version, PATCHES, every=args.all,
                         interventions=INTERVENTIONS)
    failed = 0
    for patch, reason in results:
        in_range = version_in_range(args.version, patch.vllm_versions)
        mark = "ok" if not reason else ("FAIL" if in_range else "no (out of range)")
        if reason and in_range:
            failed += 1
        print(f"{mark:>18}  {patch.name}" + (f": {reason}" if reason else ""))
    checked = sum(1 for p, _ in results if version_in_range(args.version, p.vllm_versions))
    print(f"vLLM {args.version}: {checked - failed} of {checked} in-range entries match")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
