"""Whether vLLM relays a model's auxiliary hidden states between pipeline stages (EAGLE3, DFlash).

vLLM's worker decides it when the model is built: ``verify_supports_aux_hidden_states_over_pp``
(v1/worker/gpu/spec_decode/eagle/eagle3_utils.py) reads ``supports_aux_hidden_states_over_pp``
from the model's inner decoder (``_inner_decoder``: the ``.model`` of the model, or of its
language model). The front end asks the same flag of the same class without building the model:
the class vLLM will build (its registry) and the class of its ``.model``, read from the
``__init__`` that assigns it (a class it calls, or one a ``self`` builder method returns).

Model modules are imported where vLLM's registry imports the classes it inspects: in a
subprocess (``registry._run_in_subprocess``; some modules start CUDA when imported). Where no
class is found the answer is None, with the reason.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass

FLAG = "supports_aux_hidden_states_over_pp"


@dataclass(frozen=True)
class AuxRelay:
    model_class: str = ""  # the class vLLM builds, e.g. MistralForCausalLM
    decoder_class: str = ""  # the class of its .model, e.g. MistralModel
    relays: bool | None = None  # the decoder's flag; None when no decoder was found
    why: str = ""  # why not, when relays is None


def find(model_config) -> AuxRelay:
    """The answer for the model of ``model_config`` (a vLLM ModelConfig), its class loaded in
    vLLM's registry subprocess."""
    from vllm.config import ModelConfig
    from vllm.model_executor.models import registry

    if not isinstance(model_config, ModelConfig):
        return AuxRelay(why="not a vLLM ModelConfig")
    name = getattr(model_config, "architecture", None) or ", ".join(model_config.architectures or ())
    run = getattr(registry, "_run_in_subprocess", None)
    if run is None:
        return AuxRelay(name, why="this vLLM's registry cannot load model classes in a subprocess")
    try:
        return AuxRelay(*run(functools.partial(_probe, model_config)))
    except Exception as exc:  # the subprocess failed: its last line says why
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        return AuxRelay(name, why=f"loading the class failed: {lines[-1] if lines else type(exc).__name__}")


def _probe(model_config) -> tuple:
    """In the subprocess: the class vLLM's model loader builds, and its answer as a tuple."""
    try:
        from vllm.model_executor.model_loader.utils import get_model_architecture
    except ImportError:
        from vllm.model_executor.models import ModelRegistry

        model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architectures, model_config=model_config)
    else:
        model_cls, _ = get_model_architecture(model_config)
    r = relay_of(model_cls)
    return (r.model_class, r.decoder_class, r.relays, r.why)


def relay_of(model_cls: type) -> AuxRelay:
    """The answer for a loaded model class."""
    name = model_cls.__name__
    if callable(getattr(model_cls, "get_language_model", None)):
        return AuxRelay(name, why=f"{name} is multimodal: its language model is chosen when it is built")
    try:
        decoder = decoder_class(model_cls)
    except LookupError as exc:
        return AuxRelay(name, why=str(exc))
    return AuxRelay(name, decoder.__qualname__, bool(getattr(decoder, FLAG, False)))


def decoder_class(model_cls: type) -> type:
    """The class of ``model_cls``'s ``.model``: the first ``__init__`` of its MRO that assigns
    ``self.model`` names it. LookupError when none is found."""
    for owner in model_cls.__mro__:
        init = owner.__dict__.get("__init__")
        if init is None or owner.__module__.split(".")[0] in ("builtins", "torch", "typing"):
            continue
        init = inspect.unwrap(init)
        if not inspect.isfunction(init):
            continue
        nodes = list(ast.walk(_parse(init, owner)))
        if any(_assigned(node, "language_model") is not None for node in nodes):
            raise LookupError(f"{owner.__qualname__}.__init__ sets self.language_model, whose .model vLLM reads")
        calls = [v for v in (_assigned(node, "model") for node in nodes) if v is not None]
        if not calls:
            continue
        classes = {_called_class(call, init, model_cls) for call in calls}
        if len(classes) == 1 and isinstance(next(iter(classes)), type):
            return classes.pop()
        shown = ", ".join(sorted(ast.unparse(c) for c in calls))
        raise LookupError(f"{owner.__qualname__}.__init__ sets self.model to {shown}: no one class found")
    raise LookupError(f"no __init__ of {model_cls.__name__} sets self.model")


def _parse(func, owner) -> ast.AST:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(func)))
    except (OSError, TypeError, SyntaxError) as exc:
        raise LookupError(f"no source for {owner.__qualname__}.{func.__name__}: {exc}") from None


def _assigned(node, attr: str) -> ast.expr | None:
    """The value of ``self.<attr> = <value>`` (any value: a non-call cannot be followed)."""
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AnnAssign) and node.value is not None:
        targets = [node.target]
    else:
        return None
    for t in targets:
        if isinstance(t, ast.Attribute) and t.attr == attr and isinstance(t.value, ast.Name) and t.value.id == "self":
            return node.value
    return None


def _called_class(value: ast.expr, func, model_cls: type):
    """The class ``value`` (a call in ``func``) builds, or None: ``Name(...)`` in the function's
    module or its parameter's default, ``self.attr(...)`` a class attribute or a builder method
    whose returns all call one class."""
    if not isinstance(value, ast.Call):
        return None
    target = value.func
    if isinstance(target, ast.Name):
        param = inspect.signature(func).parameters.get(target.id)
        if param is not None:
            return param.default if isinstance(param.default, type) else None
        return func.__globals__.get(target.id)
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
        found = getattr(model_cls, target.attr, None)
        if isinstance(found, type) or not inspect.isfunction(found):
            return found if isinstance(found, type) else None  # a class attribute, or not followed
        builder = inspect.unwrap(found)
        returns = [n.value for n in ast.walk(_parse(builder, model_cls)) if isinstance(n, ast.Return) and n.value]
        classes = {_called_class(r, builder, model_cls) for r in returns}
        return classes.pop() if len(classes) == 1 else None
    return None
