"""The machinery behind the patch registry: declare, check, apply, never half-apply.

A patch replaces one attribute of vLLM (a module function, a method, a classmethod or the
getter of a property) with a wrapper built by a factory from the original. Before anything
changes, every precondition is checked: the vLLM version is in range, the target exists and has
the expected parameters (and, for a patch that mirrors the target's code, the source it was
written against), the factory loads, and every already imported module that holds a
``from x import f`` copy still holds the original. Only then is the target replaced and the
copies rebound. A patched object carries a sentinel attribute, so a second application is a
no-op. :func:`check_patch` runs the same checks without changing anything (``vllm-dualgpu
doctor`` uses it).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_dualgpu.support import version_in_range  # noqa: F401  (the patching layer's name for it)

SENTINEL = "__vllm_dualgpu_patch__"

APPLIED, ALREADY, SKIPPED, FAILED = "applied", "already applied", "skipped", "failed"
READY = "ready"
"""check_patch's verdict when every check passes: apply_patch would change the target now."""


@dataclass(frozen=True)
class Patch:
    """One declared run-time change to vLLM. Every field is shown in docs/patches.md."""

    name: str
    target: str
    """``module:Qualified.name`` of the attribute that is replaced."""
    processes: tuple[str, ...]
    """Where it applies: ``frontend``, ``engine``, ``worker``."""
    vllm_versions: str
    """PEP 440 specifier of the vLLM releases whose target this patch was written against
    (``A || B``: either; the refusal outside the supported range uses it)."""
    why: str
    upstream: str
    remove_when: str
    factory: str
    """``module:function`` that takes the original callable and returns the replacement."""
    params: tuple[str, ...]
    """Parameter names the target must have (in order); anything else is refused."""
    copies: tuple[str, ...] = ()
    """Modules holding a ``from x import name`` copy of a module-level target; rebound too when
    already imported (a module imported after the patch binds the replacement itself)."""
    issue: str = ""
    """The project issue that owns the patch."""
    optional: bool = False
    """True when the package works (less well) without it; False makes a skip an error."""
    source_sha256: str = ""
    """For a patch that mirrors the target's code instead of calling it: the digest of the
    target's source it was written against (:func:`source_check.function_digest`); any other
    source is refused."""
    opt_out: str = ""
    """An environment variable that, set to 0 (false, no, off), leaves this patch unapplied; for
    patches that fix vLLM for every executor (the others act only under dualgpu)."""
    fixed_in: str = ""
    """The vLLM release that fixed the problem upstream (the range ends there), with what it
    changed, e.g. ``"0.31.0: DFlashQwen3Model builds ... (models/qwen3_dflash.py)"``."""
    when: str = ""
    """Empty: applied wherever ``processes`` and the run say. ``"virtual-gpus"``: an emulation
    applied only in a worker whose hand-off gives it a virtual card (vllm_dualgpu.virtual_gpus),
    never otherwise."""
    upstream_draft: str = ""
    """The ``upstream/`` directory holding a pull request drafted against vLLM that would retire
    this entry, or why there is none (shown in docs/patches.md; empty: not yet considered)."""

    @property
    def module(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def qualname(self) -> str:
        return self.target.split(":", 1)[1]


def like(original: Callable, wrapper: Callable) -> Callable:
    """``wrapper`` with the name and docstring of ``original``, not its attributes (a cache vLLM
    keeps there stays the original's), and ``__wrapped__``, so its signature reads as the
    original's: what a factory returns for its patch."""
    return functools.update_wrapper(wrapper, original, updated=())


def opted_out(patch: Patch, env: dict | None = None) -> bool:
    """Whether the user switched ``patch`` off through its ``opt_out`` variable."""
    if not patch.opt_out:
        return False
    value = (os.environ if env is None else env).get(patch.opt_out, "").strip().lower()
    return value in ("0", "false", "no", "off")


@dataclass
class Outcome:
    patch: Patch
    status: str
    reason: str = ""
    rebound: list[str] = field(default_factory=list)

    def short(self) -> str:
        return self.patch.name if not self.reason else f"{self.patch.name} ({self.reason})"


def _resolve_owner(patch: Patch) -> tuple[object, str]:
    return resolve_target(patch.target)


def resolve_target(target: str) -> tuple[object, str]:
    """The object holding ``module:Qualified.name``'s last part, and that part's name."""
    module_name, qualname = target.split(":", 1)
    module = importlib.import_module(module_name)
    *path, attr = qualname.split(".")
    owner: object = module
    for part in path:
        owner = getattr(owner, part)
    return owner, attr


def _raw_attr(owner: object, attr: str) -> object:
    """The attribute as stored (keeps classmethod/staticmethod wrappers of classes)."""
    if inspect.isclass(owner):
        for klass in owner.__mro__:
            if attr in vars(klass):
                return vars(klass)[attr]
        raise AttributeError(attr)
    return getattr(owner, attr)


def _function_of(raw: object) -> Callable:
    if isinstance(raw, property):
        return raw.fget  # type: ignore[return-value]
    return raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw  # type: ignore[return-value]


def _stored_form(raw: object, func: Callable) -> object:
    """``func`` wrapped the way ``raw`` is stored (classmethod, staticmethod, property)."""
    if isinstance(raw, property):
        return raw.getter(func)  # keeps the setter, deleter and docstring
    if isinstance(raw, classmethod):
        return classmethod(func)
    if isinstance(raw, staticmethod):
        return staticmethod(func)
    return func


def _param_names(func: Callable) -> tuple[str, ...]:
    return tuple(inspect.signature(func).parameters)


def find_target(target: str) -> tuple[object, str, object] | str:
    """``(owner, attr, attribute as stored)`` of ``module:Qualified.name``, or why not found."""
    try:
        owner, attr = resolve_target(target)
        return owner, attr, _raw_attr(owner, attr)
    except (ImportError, AttributeError) as exc:
        return f"target {target} not found: {exc}"


def params_mismatch(target: str, func: Callable, expected: tuple[str, ...]) -> str:
    """Empty when ``func`` takes exactly ``expected`` (in order), else what it takes instead."""
    try:
        found = _param_names(func)
    except (TypeError, ValueError) as exc:
        return f"cannot read the signature of {target}: {exc}"
    if found != tuple(expected):
        return f"{target} takes ({', '.join(found)}), expected ({', '.join(expected)})"
    return ""


def _load_factory(spec: str) -> Callable[[Callable], Callable]:
    mod, fn = spec.split(":", 1)
    return getattr(importlib.import_module(mod), fn)


@dataclass
class _Checked:
    """Everything apply_patch needs once every check has passed."""

    owner: object
    attr: str
    raw: object
    original: Callable
    factory: Callable[[Callable], Callable]
    copy_modules: list


def _check(patch: Patch, vllm_version: str) -> Outcome | _Checked:
    """The checks of apply_patch, changing nothing: an Outcome when it must not apply."""
    if not version_in_range(vllm_version, patch.vllm_versions):
        return Outcome(patch, SKIPPED, f"vLLM {vllm_version} not in {patch.vllm_versions}")
    found = find_target(patch.target)
    if isinstance(found, str):
        return Outcome(patch, SKIPPED, found)
    owner, attr, raw = found
    original = _function_of(raw)
    if original is None:
        return Outcome(patch, SKIPPED, f"{patch.target} is a property without a getter")
    if getattr(original, SENTINEL, None) == patch.name:
        return Outcome(patch, ALREADY)
    wrong = params_mismatch(patch.target, original, patch.params)
    if wrong:
        return Outcome(patch, SKIPPED, wrong)
    if patch.source_sha256:
        from vllm_dualgpu.patching.source_check import function_digest, source_mismatch

        try:
            digest = function_digest(original)
        except (OSError, TypeError, SyntaxError) as exc:
            return Outcome(patch, SKIPPED, f"cannot read the source of {patch.target}: {exc}")
        if digest != patch.source_sha256:
            return Outcome(patch, SKIPPED, source_mismatch(patch.target, digest, patch.source_sha256))
    # Only holders imported already hold a copy to rebind; a holder imported later binds the
    # replacement itself. Importing holders here would run their import-time code (some read
    # the device capability then) too early.
    copy_modules = []
    for name in patch.copies:
        mod = sys.modules.get(name)
        if mod is None:
            continue
        held = getattr(mod, attr, None)
        if held is not original and getattr(held, SENTINEL, None) != patch.name:
            return Outcome(patch, SKIPPED, f"{name}.{attr} is not vLLM's original")
        copy_modules.append(mod)
    try:
        factory = _load_factory(patch.factory)
    except (ImportError, AttributeError) as exc:
        return Outcome(patch, SKIPPED, f"factory {patch.factory} cannot be loaded: {exc}")
    return _Checked(owner, attr, raw, original, factory, copy_modules)


def check_patch(patch: Patch, vllm_version: str) -> Outcome:
    """Dry run of :func:`apply_patch`: the same checks, nothing changed.

    READY (``rebound`` lists the copies it would rebind now), ALREADY or SKIPPED with the reason.
    """
    checked = _check(patch, vllm_version)
    if isinstance(checked, Outcome):
        return checked
    return Outcome(patch, READY, rebound=[m.__name__ for m in checked.copy_modules])


def apply_patch(patch: Patch, vllm_version: str) -> Outcome:
    """Check everything, then change everything; on any doubt change nothing."""
    checked = _check(patch, vllm_version)
    if isinstance(checked, Outcome):
        return checked
    original = checked.original
    replacement = checked.factory(original)
    setattr(replacement, SENTINEL, patch.name)
    replacement.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(checked.owner, checked.attr, _stored_form(checked.raw, replacement))
    rebound = []
    for mod in checked.copy_modules:
        setattr(mod, checked.attr, replacement)
        rebound.append(mod.__name__)
    return Outcome(patch, APPLIED, rebound=rebound)


def revert_patch(patch: Patch) -> bool:
    """Undo an applied patch (tests use this); returns whether anything changed."""
    owner, attr = _resolve_owner(patch)
    raw = _raw_attr(owner, attr)
    current = _function_of(raw)
    if getattr(current, SENTINEL, None) != patch.name:
        return False
    original = current.__wrapped__
    setattr(owner, attr, _stored_form(raw, original))
    for name in patch.copies:
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, attr, None) is current:
            setattr(mod, attr, original)
    return True
