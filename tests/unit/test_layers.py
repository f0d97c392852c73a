"""The package's layers: every module imports only from its own layer or the layers below.

Bottom to top: the base (version, logging, process kinds, support, per-rank notes), the pure
planner, the settings, the NVML reader and the machine profile (they use the planner's size and
GPU types), kernel
helpers, the patch machinery, registry and the plugin that applies it, the
engine side (executor, planning, workers), the patch bodies (they may call into the engine),
the plugin entry point, the command line. In-function imports count: a lazy import up the
layers is still a dependency up the layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import vllm_dualgpu

ROOT = Path(vllm_dualgpu.__file__).parent
LAYERS = [
    {"vllm_dualgpu", "vllm_dualgpu._version", "vllm_dualgpu.log", "vllm_dualgpu.process",
     "vllm_dualgpu.support", "vllm_dualgpu.rank_summary"},
    {"vllm_dualgpu.planner"},
    # the machine profile (calibrate's measured bandwidths, read by plan and the executor) and
    # the probe that measures them
    {"vllm_dualgpu.envs", "vllm_dualgpu.nvml", "vllm_dualgpu.virtual_gpus", "vllm_dualgpu.machine_profile",
     "vllm_dualgpu.bandwidth_probe"},
    {"vllm_dualgpu.kernels"},
    # plugin.py applies the registry in this process (and is vLLM's entry point): the engine
    # calls it to make sure its own process is patched.
    {"vllm_dualgpu.patching", "vllm_dualgpu.plugin"},
    {"vllm_dualgpu.engine", "vllm_dualgpu.executor"},
    {"vllm_dualgpu.patches"},
    {"vllm_dualgpu.cli"},
]
# The package's __init__ only re-exports register(), which loads the plugin lazily.
ALLOWED = {("vllm_dualgpu", "vllm_dualgpu.plugin")}


def unit(module: str) -> str:
    parts = module.split(".")
    two = ".".join(parts[:2])
    return two if any(two in layer for layer in LAYERS) else parts[0]


def layer_of(module: str) -> int:
    u = unit(module)
    return next(i for i, layer in enumerate(LAYERS) if u in layer)


def imports() -> list[tuple[str, str, int]]:
    out = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        mod = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.startswith("vllm_dualgpu") and _is_module(name):
                    out.append((mod, name, node.lineno))
    return out


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (ROOT.parent / rel).with_suffix(".py").exists() or (ROOT.parent / rel / "__init__.py").exists()


def test_no_module_imports_up_the_layers():
    up = []
    for mod, name, line in imports():
        if (unit(mod), unit(name)) in ALLOWED:
            continue
        if layer_of(name) > layer_of(mod):
            up.append(f"{mod}:{line} imports {name}")
    assert not up, "imports up the layers:\n" + "\n".join(sorted(set(up)))


def test_every_package_module_has_a_layer():
    for mod, name, _ in imports():
        layer_of(mod), layer_of(name)  # raises StopIteration for a module outside LAYERS


def test_no_import_circles():
    """No module reaches itself through imports (in-function imports count): a circle inside a
    layer hides which module is the lower one."""
    graph: dict[str, set[str]] = {}
    for mod, name, _ in imports():
        if name != mod and not mod.startswith(name + "."):  # a package's own __init__
            graph.setdefault(mod, set()).add(name)
    circles = []

    def reach(start: str) -> set[str]:
        seen, todo = set(), list(graph.get(start, ()))
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(graph.get(m, ()))
        return seen

    for mod in sorted(graph):
        if mod in reach(mod):
            circles.append(mod)
    assert circles == [], "modules in an import circle: " + ", ".join(circles)
