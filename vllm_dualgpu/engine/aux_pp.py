"""Whether vLLM relays a model's auxiliary hidden states between pipeline stages (EAGLE3, DFlash).

vLLM's worker decides it when the model is built: ``verify_supports_aux_hidden_states_over_pp``
(v1/worker/gpu/spec_decode/eagle/eagle3_utils.py) reads ``supports_aux_hidden_states_over_pp``
from the model's inner decoder (``_inner_decoder``: the ``.model`` of the model, or of its
language model). The front end asks the same flag of the same class without building the model:
the class vLLM will build (its registry) and the class of its ``.model``, read from the
``__init__`` that assigns it (a class it calls, or one a ``self`` builder method returns). For a
multimodal model, first the class of its language model, read the same way from the assignment
under ``_mark_language_model`` (or to ``self.language_model``): a class it calls,
``initialize_model(model_class=...)``, or ``init_vllm_registered_model`` with the architectures
it names, else those of the text config.

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
    r = relay_of(model_cls, text_architectures=text_architectures(getattr(model_config, "hf_text_config", None)))
    return (r.model_class, r.decoder_class, r.relays, r.why)


def text_architectures(text_config) -> tuple[str, ...]:
    """The architectures vLLM builds a language model from a text config by
    (``VllmConfig.with_hf_config``, config/vllm.py:964-981 in 0.33): the config's own, else
    transformers' causal-LM class for its model type."""
    archs = getattr(text_config, "architectures", None)
    if archs:
        return tuple(archs)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(text_config, "model_type", None))
    return (name,) if name else ()


def relay_of(model_cls: type, text_architectures: tuple[str, ...] = ()) -> AuxRelay:
    """The answer for a loaded model class; ``text_architectures``: the text config's, which a
    multimodal model that names no architecture for its language model builds."""
    name = model_cls.__name__
    if callable(getattr(model_cls, "get_language_model", None)):
        try:
            language_model = language_model_class(model_cls, text_architectures)
        except LookupError as exc:
            return AuxRelay(name, why=f"{name} is multimodal and its language model was not found: {exc}")
        inner = relay_of(language_model)
        if inner.relays is None:
            return AuxRelay(name, why=f"its language model {language_model.__name__}: {inner.why}")
        return AuxRelay(name, inner.decoder_class, inner.relays)
    try:
        decoder = decoder_class(model_cls)
    except LookupError as exc:
        return AuxRelay(name, why=str(exc))
    return AuxRelay(name, decoder.__qualname__, bool(getattr(decoder, FLAG, False)))


def language_model_class(model_cls: type, text_architectures: tuple[str, ...] = ()) -> type:
    """The class of a multimodal model's language model (what ``get_language_model()`` returns):
    the one module its ``__init__`` assigns under ``with self._mark_language_model(...)``, else
    its ``self.language_model``. LookupError when no one class is found."""
    for owner, init in _inits(model_cls):
        tree = _parse(init, owner)
        marked = [n for w in ast.walk(tree) if isinstance(w, ast.With) and _marks_language_model(w)
                  for stmt in w.body for n in ast.walk(stmt)]
        values = [t for n in marked for t in _self_targets(n)]
        if len({attr for attr, _ in values}) != 1:
            values = [("language_model", v) for v in (_assigned(n, "language_model") for n in ast.walk(tree))
                      if v is not None]
        if not values:
            continue
        classes = {_language_model_call(value, init, model_cls, text_architectures) for _, value in values}
        if len(classes) == 1 and isinstance(next(iter(classes)), type):
            return classes.pop()
        shown = ", ".join(sorted({ast.unparse(v) for _, v in values}))
        raise LookupError(f"{owner.__qualname__}.__init__ builds its language model as {shown}: no one class "
                          "found" + ("" if text_architectures else
                                     " (and the text config names no architectures to build it from)"))
    raise LookupError(f"no __init__ of {model_cls.__name__} assigns a language model")


def _marks_language_model(node: ast.With) -> bool:
    return any(isinstance(item.context_expr, ast.Call) and isinstance(item.context_expr.func, ast.Attribute)
               and item.context_expr.func.attr == "_mark_language_model" for item in node.items)


def _self_targets(node) -> list[tuple[str, ast.expr]]:
    """``(attr, value)`` for each ``self.<attr>`` an assignment ``node`` assigns ``value`` to."""
    targets = node.targets if isinstance(node, ast.Assign) else (
        [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else [])
    return [(t.attr, node.value) for t in targets
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"]


def _language_model_call(value: ast.expr, func, model_cls: type, text_architectures: tuple[str, ...]):
    """The class a language model's builder call makes, or None: ``initialize_model(model_class=X)``;
    ``init_vllm_registered_model`` (or ``initialize_model`` without a class) with
    ``architectures=[...]`` literal, here or in a ``with_hf_config(...)`` it is given, else the
    text config's architectures, resolved by vLLM's registry; any other call as for ``.model``."""
    if not isinstance(value, ast.Call):
        return None
    called = value.func.attr if isinstance(value.func, ast.Attribute) else getattr(value.func, "id", "")
    if called not in ("init_vllm_registered_model", "initialize_model"):
        return _called_class(value, func, model_cls)
    keywords = {k.arg: k.value for k in value.keywords if k.arg}
    if "model_class" in keywords:
        named = keywords["model_class"]
        return func.__globals__.get(named.id) if isinstance(named, ast.Name) else None
    archs = _literal_architectures(value)
    return _registered_class(archs if archs is not None else text_architectures)


def _literal_architectures(call: ast.Call) -> tuple[str, ...] | None:
    """``architectures=[...]`` of strings in ``call`` or in a call among its arguments (the
    ``vllm_config.with_hf_config(cfg, [...])`` form), or None."""
    for node in ast.walk(call):
        if not isinstance(node, ast.Call):
            continue
        given = [k.value for k in node.keywords if k.arg == "architectures"]
        if not given and isinstance(node.func, ast.Attribute) and node.func.attr == "with_hf_config" \
                and len(node.args) > 1:
            given = [node.args[1]]
        for v in given:
            if isinstance(v, (ast.List, ast.Tuple)) and v.elts and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in v.elts):
                return tuple(e.value for e in v.elts)
    return None


def _registered_class(architectures: tuple[str, ...]):
    """The first of ``architectures`` vLLM's registry loads, or None."""
    from vllm.model_executor.models import ModelRegistry

    for arch in architectures:
        cls = ModelRegistry._try_load_model_cls(arch)
        if cls is not None:
            return cls
    return None


def decoder_class(model_cls: type) -> type:
    """The class of ``model_cls``'s ``.model``: the first ``__init__`` of its MRO that assigns
    ``self.model`` names it. LookupError when none is found."""
    for owner, init in _inits(model_cls):
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


def _inits(model_cls: type):
    """``(owner, __init__)`` of each class in ``model_cls``'s MRO that defines its own, in Python."""
    for owner in model_cls.__mro__:
        init = owner.__dict__.get("__init__")
        if init is None or owner.__module__.split(".")[0] in ("builtins", "torch", "typing"):
            continue
        init = inspect.unwrap(init)
        if inspect.isfunction(init):
            yield owner, init


def _parse(func, owner) -> ast.AST:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(func)))
    except (OSError, TypeError, SyntaxError) as exc:
        raise LookupError(f"no source for {owner.__qualname__}.{func.__name__}: {exc}") from None


def _assigned(node, attr: str) -> ast.expr | None:
    """The value of ``self.<attr> = <value>`` (any value: a non-call cannot be followed)."""
    return next((value for a, value in _self_targets(node) if a == attr), None)


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
