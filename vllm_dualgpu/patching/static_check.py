"""Check the registry against a vLLM release's source tree, without importing vLLM.

``python -m vllm_dualgpu.patching.static_check --vllm-tree DIR --version X [--all]``

``DIR`` holds the ``vllm`` package (an unpacked wheel or a site-packages folder). For every
registry entry whose range includes ``X`` (``--all``: every entry) it reads the target's module
file and checks what :func:`vllm_dualgpu.patching.core.apply_patch` would check first: the
target exists, takes the declared parameters, and has the pinned source digest. Copies
(``from x import f`` holders) are checked to import the name. Exit status 1 when any in-range
entry fails, so CI can run it for releases it does not install.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

from vllm_dualgpu.patching.core import Patch, version_in_range
from vllm_dualgpu.patching.source_check import check_in_path


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


def check_entry(tree: Path, patch: Patch) -> str:
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
    return ""


def check_tree(tree: Path, version: str, patches, every: bool = False) -> list[tuple[Patch, str]]:
    """(entry, reason) for each checked entry; reason "" means it matches."""
    return [
        (p, check_entry(tree, p))
        for p in patches
        # torch's targets (the virtual-GPU emulation) are not in vLLM's tree
        if p.module.split(".")[0] == "vllm" and (every or version_in_range(version, p.vllm_versions))
    ]


def main(argv: list[str] | None = None) -> int:
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
    results = check_tree(args.vllm_tree, args.version, PATCHES, every=args.all)
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
