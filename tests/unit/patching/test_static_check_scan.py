"""The check of a release's source tree finds what "applied" would leave unchanged.

A small fake ``vllm`` tree on disk: a module-level function copied by ``from x import f`` into
other modules (some listed in the entry's ``copies``, some not), a base-class method that
subclasses override (directly, through an alias, a re-export, a module alias), and interventions
whose target is present, missing or outside vLLM. No vLLM import.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from vllm_dualgpu.patching.core import Patch
from vllm_dualgpu.patching.interventions import PRIVATE_API, Intervention
from vllm_dualgpu.patching.static_check import check_tree, main

FILES = {
    "vllm/__init__.py": "",
    "vllm/a.py": """
        def f(x):
            return x

        def reads(obj):
            return getattr(obj, "ray_backend")

        class Base:
            def m(self, n):
                return n

            def untouched(self):
                return 0
    """,
    # copies of f: top level, relative with an alias, and a copy of that copy
    "vllm/b.py": "from vllm.a import f\n",
    "vllm/c.py": "from .a import f as g\n",
    "vllm/c2.py": "from vllm.c import g\n",
    "vllm/listed.py": "from vllm.a import f\n",
    # copies by assignment: of a module's attribute, and of an imported copy
    "vllm/f.py": "import vllm.a\n_f = vllm.a.f\n",
    "vllm/g.py": "from vllm.a import f\nkeep = f\n",
    # not copies: an import inside a function runs at call time; a TYPE_CHECKING import never
    "vllm/d.py": """
        def h():
            from vllm.a import f
            return f(1)
    """,
    "vllm/e.py": """
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from vllm.a import f
    """,
    # subclasses of Base
    "vllm/sub/__init__.py": "from vllm.a import Base\n",
    "vllm/sub/p.py": """
        from vllm.a import Base

        class Mid(Base):
            def untouched(self):
                return 1

        class Leaf(Mid):
            def m(self, n):
                return -n
    """,
    "vllm/sub/q.py": """
        import vllm.a as A

        class Q(A.Base):
            m = None
    """,
    "vllm/sub/s.py": """
        from vllm.sub import Base as B

        class S(B):
            @classmethod
            def m(cls, n):
                return n
    """,
    # overrides that run the base's method (super() or the base named): the patch is reached
    "vllm/sub/t.py": """
        from vllm.a import Base

        class CallsSuper(Base):
            def m(self, n):
                return super().m(n) + 1

        class NamesBase(Base):
            def m(self, n):
                return Base.m(self, n) + 1
    """,
    "vllm/sub/r.py": """
        class Other:
            def m(self, n):
                return n
    """,
}


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for rel, text in FILES.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def patch(target: str, params: tuple[str, ...], copies: tuple[str, ...] = (), name: str = "p") -> Patch:
    return Patch(name=name, target=target, processes=("engine",), vllm_versions=">=0.30.0,<0.34",
                 why="", upstream="", remove_when="", factory="x:y", params=params, copies=copies)


def intervention(target: str, params=None, name: str = "i", source_names=()) -> Intervention:
    return Intervention(name=name, kind=PRIVATE_API, target=target, processes=("engine",),
                        vllm_versions=">=0.30.0,<0.34", why="", upstream="", remove_when="",
                        params=params, source_names=source_names)


def reasons(tree: Path, entries, interventions=(), allowed=None) -> dict[str, str]:
    found = check_tree(tree, "0.33.0", entries, interventions=interventions,
                       allowed={} if allowed is None else allowed)
    return {entry.name: reason for entry, reason in found}


def named(reason: str) -> tuple[set[str], set[str]]:
    """(holders of the target's own name, holders under another name) in a reason."""
    parts = {p.split(":")[0].strip(): {h.strip() for h in p.split(":", 1)[1].split(",")}
             for p in reason.split(";") if ":" in p}
    plain = next((v for k, v in parts.items() if "does not list" in k), set())
    renamed = next((v for k, v in parts.items() if "another name" in k), set())
    return plain, renamed


def test_every_unlisted_copy_of_a_module_function_is_named(tree):
    reason = reasons(tree, [patch("vllm.a:f", ("x",), copies=("vllm.listed",))])["p"]
    # not copies: the listed holder, a function's import, a TYPE_CHECKING import, the target
    assert named(reason) == ({"vllm.b", "vllm.g"},
                             {"vllm.c as g", "vllm.c2 as g", "vllm.f as _f", "vllm.g as keep"}), reason


def test_listing_the_plain_copies_leaves_only_the_aliased_ones(tree):
    # core rebinds a holder's attribute of the target's own name: `from .a import f as g` can
    # not be fixed by listing it, so it is named (with its alias) even when listed
    copies = ("vllm.listed", "vllm.b", "vllm.g")
    reason = reasons(tree, [patch("vllm.a:f", ("x",), copies=copies)])["p"]
    assert named(reason) == (set(), {"vllm.c as g", "vllm.c2 as g", "vllm.f as _f", "vllm.g as keep"})
    allowed = {("vllm.a:f", m): "never called" for m in ("vllm.c", "vllm.c2", "vllm.f", "vllm.g")}
    assert reasons(tree, [patch("vllm.a:f", ("x",), copies=copies)], allowed=allowed) == {"p": ""}


def test_a_commented_allow_list_entry_silences_one_copy(tree):
    allowed = {("vllm.a:f", "vllm.b"): "b never calls f at run time",
               ("vllm.a:f", "vllm.c"): "same", ("vllm.a:f", "vllm.c2"): "same",
               ("vllm.a:f", "vllm.f"): "same", ("vllm.a:f", "vllm.g"): "same"}
    assert reasons(tree, [patch("vllm.a:f", ("x",), ("vllm.listed",))], allowed=allowed) == {"p": ""}
    del allowed[("vllm.a:f", "vllm.c2")]
    assert "vllm.c2" in reasons(tree, [patch("vllm.a:f", ("x",), ("vllm.listed",))], allowed=allowed)["p"]


def test_every_subclass_override_of_a_patched_method_is_named(tree):
    reason = reasons(tree, [patch("vllm.a:Base.m", ("self", "n"))])["p"]
    for override in ("vllm.sub.p:Leaf", "vllm.sub.q:Q", "vllm.sub.s:S"):
        assert override in reason, reason
    for not_one in ("vllm.sub.p:Mid", "vllm.sub.r:Other", "CallsSuper", "NamesBase"):
        assert not_one not in reason, reason


def test_a_method_no_subclass_overrides_matches(tree):
    assert reasons(tree, [patch("vllm.a:Base.untouched", ("self",))]) != {"p": ""}  # Mid does
    assert reasons(tree, [patch("vllm.sub.p:Mid.untouched", ("self",))]) == {"p": ""}


def test_interventions_are_checked_for_presence_parameters_and_overrides(tree):
    items = [
        intervention("vllm.a:f", ("x",), name="present"),
        intervention("vllm.a:gone", name="missing"),
        intervention("vllm.a:f", ("y",), name="wrong-params"),
        intervention("vllm.a:Base.m", ("self", "n"), name="overridden"),
        intervention("vllm.a:reads", source_names=('"ray_backend"',), name="names-as-written"),
        intervention("vllm.a:reads", source_names=('"gone"',), name="name-gone"),
        intervention("CUDA_DEVICE_ORDER", name="environment"),
        intervention("torch.cuda:get_device_name", name="torch"),
    ]
    found = reasons(tree, [], interventions=items)
    assert found["present"] == ""
    assert "not found" in found["missing"]
    assert "(x)" in found["wrong-params"]
    assert "vllm.sub.p:Leaf" in found["overridden"]
    # the source as written (quotes and all), as the live check reads it
    assert found["names-as-written"] == ""
    assert '"gone"' in found["name-gone"]
    # an environment variable or a target outside vLLM's tree is not in this check
    assert "environment" not in found and "torch" not in found


def test_the_command_fails_on_a_tree_where_a_registry_copy_is_missing(tree, capsys):
    # the registry's entries are not in the fake tree: every in-range entry fails, exit 1
    assert main(["--vllm-tree", str(tree), "--version", "0.33.0"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_every_allowed_finding_names_a_declared_target_and_says_why():
    from vllm_dualgpu.patching.interventions import INTERVENTIONS
    from vllm_dualgpu.patching.registry import PATCHES
    from vllm_dualgpu.patching.static_allowed import ALLOWED

    declared = {e.target for e in (*PATCHES, *INTERVENTIONS)}
    for (target, holder), why in ALLOWED.items():
        assert target in declared, target
        assert holder.startswith("vllm.") and why.strip(), (target, holder)
