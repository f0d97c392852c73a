"""EAGLE3/DFlash under PP: the preflight decides as vLLM's worker does, by the flag
``supports_aux_hidden_states_over_pp`` of the decoder class (the class of the model's ``.model``,
``_inner_decoder`` and ``verify_supports_aux_hidden_states_over_pp`` in vLLM's
v1/worker/gpu/spec_decode/eagle/eagle3_utils.py), on real vLLM configs built on the CPU.

The expected classes and flags are read from vLLM 0.33.0's sources (file:line under
site-packages/vllm/model_executor/models/); the Qwen3-Next/Qwen3.5 relay path is tested in
tests/integration/patches/test_patch_qwen3_next_aux_hidden_relay.py.
"""

from __future__ import annotations

import importlib
import importlib.metadata

import pytest
from vllm.model_executor.models import registry as vllm_registry

from vllm_dualgpu.engine import preflight

VLLM = importlib.metadata.version("vllm")
FLAG = "supports_aux_hidden_states_over_pp"
REAL_RUN_IN_SUBPROCESS = getattr(vllm_registry, "_run_in_subprocess", None)  # before any fixture swaps it

TINY = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
AUX_LAYERS = [1, 2, 3]
EAGLE3 = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **TINY, "num_hidden_layers": 1,
          "draft_vocab_size": TINY["vocab_size"], "hidden_act": "silu",
          "eagle_aux_hidden_state_layer_ids": AUX_LAYERS,
          "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_LAYERS, "use_aux_hidden_state": True}}
GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 256, "n_layer": 4, "n_head": 4,
        "n_positions": 1024, "vocab_size": 1024, "torch_dtype": "bfloat16"}
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **TINY, "num_experts": 4,
             "num_experts_per_tok": 2, "moe_intermediate_size": 128, "decoder_sparse_step": 1, "mlp_only_layers": []}


@pytest.fixture
def eagle3_pp2(engine_config, write_config):
    """make(target config.json dict) -> the real VllmConfig of an EAGLE3 run with PP=2 on the dualgpu
    backend, through create_engine_config as the plugin wraps it (the preflight runs inside)."""

    def make(target: dict):
        model = write_config(target, "target")
        drafter = write_config({**EAGLE3, "hidden_size": target.get("hidden_size", target.get("n_embd"))}, "drafter")
        return engine_config(model=str(model), load_format="dummy", skip_tokenizer_init=True, pipeline_parallel_size=2,
                             distributed_executor_backend="dualgpu", enforce_eager=True, max_model_len=1024,
                             speculative_config={"method": "eagle3", "model": str(drafter), "num_speculative_tokens": 2})

    return make


# --- through the real entry point ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("arch,model_type", [
    ("LlamaForCausalLM", "llama"),      # LlamaModel, llama.py:358
    ("MistralForCausalLM", "mistral"),  # mistral.py:236, its MistralModel(LlamaModel) at :207
    ("Phi3ForCausalLM", "phi3"),        # phi3.py:10, Phi3ForCausalLM(LlamaForCausalLM): LlamaModel
])
def test_model_types_whose_decoder_relays_are_accepted(eagle3_pp2, arch, model_type):
    cfg = eagle3_pp2({"architectures": [arch], "model_type": model_type, **TINY})
    assert cfg.speculative_config.method == "eagle3" and cfg.parallel_config.pipeline_parallel_size == 2
    assert cfg.model_config.hf_text_config.model_type == model_type
    assert preflight.check(cfg, 2) == []  # as with two GPUs visible


# A tiny Qwen2.5-VL (transformers' Qwen2_5_VLConfig: its text config's model type is qwen2_5_vl_text).
MROPE = {"rope_scaling": {"type": "mrope", "mrope_section": [16, 8, 8]}}
QWEN2_5_VL = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", **TINY, **MROPE,
              "text_config": {"model_type": "qwen2_5_vl_text", **TINY, **MROPE},
              "vision_config": {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
                                "out_hidden_size": 256, "fullatt_block_indexes": [1], "window_size": 112,
                                "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_chans": 3},
              "image_token_id": 1000, "video_token_id": 1001, "vision_start_token_id": 1002}


@pytest.mark.slow
def test_a_multimodal_model_whose_language_model_relays_is_accepted(eagle3_pp2):
    """Qwen2.5-VL's language model is a Qwen2ForCausalLM (qwen2_5_vl.py:1443-1448), whose
    Qwen2Model relays: vLLM's worker accepts EAGLE3 under PP, so the preflight does too."""
    cfg = eagle3_pp2(QWEN2_5_VL)
    assert cfg.model_config.hf_text_config.model_type == "qwen2_5_vl_text"  # not a type accepted at once
    assert cfg.model_config.architectures == ["Qwen2_5_VLForConditionalGeneration"]
    assert preflight.check(cfg, 2) == []


@pytest.mark.slow
def test_decoder_without_the_flag_is_refused_naming_version_type_and_classes(eagle3_pp2):
    """Qwen3MoeModel (qwen3_moe.py) is an EagleModelMixin that keeps the mixin's False
    (interfaces.py:1611): vLLM's worker would refuse it at load."""
    with pytest.raises(preflight.PreflightError) as info:
        eagle3_pp2(QWEN3_MOE)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("--speculative-config method 'eagle3' needs auxiliary hidden states relayed between "
                              f"pipeline stages, which vLLM {VLLM} does not do for model type 'qwen3_moe'")
    assert "Qwen3MoeForCausalLM" in message and "Qwen3MoeModel" in message and FLAG in message
    assert "method 'mtp'" in message and "without speculative decoding" in message
    assert message.endswith("--pipeline-parallel-size 1.")
    if not VLLM.startswith("0.30."):
        assert "0.30" not in message


@pytest.mark.slow
def test_model_whose_decoder_is_not_found_falls_back_to_the_model_types(eagle3_pp2):
    """GPT2LMHeadModel keeps its decoder in ``.transformer`` (gpt2.py): no ``.model`` to read."""
    with pytest.raises(preflight.PreflightError) as info:
        eagle3_pp2(GPT2)
    message = str(info.value)
    assert "\n" not in message
    assert f"which vLLM {VLLM} does not do for model type 'gpt2'" in message
    assert "GPT2LMHeadModel" in message and "llama, qwen2, qwen3" in message
    assert message.endswith("--pipeline-parallel-size 1.")


@pytest.mark.slow
@pytest.mark.skipif(REAL_RUN_IN_SUBPROCESS is None, reason="this vLLM's registry has no _run_in_subprocess")
def test_the_class_is_loaded_in_vllms_registry_subprocess(eagle3_pp2, monkeypatch):
    """The front end imports no model module (some start CUDA when imported): the class is loaded
    where vLLM's registry loads classes it inspects, in a subprocess."""
    calls = []

    def spy(fn):
        calls.append(fn)
        return REAL_RUN_IN_SUBPROCESS(fn)

    cfg = eagle3_pp2({"architectures": ["MistralForCausalLM"], "model_type": "mistral", **TINY})
    monkeypatch.setattr(vllm_registry, "_run_in_subprocess", spy)
    assert preflight.check(cfg, 2) == []
    assert len(calls) == 1


# --- the decoder class, on vLLM's classes -------------------------------------------------------


@pytest.mark.parametrize("module,outer,decoder,relays", [
    ("llama", "LlamaForCausalLM", "LlamaModel", True),             # llama.py:496 via _init_model :529; flag :358
    ("mistral", "MistralForCausalLM", "MistralModel", True),       # mistral.py:275 _init_model; LlamaModel's flag
    ("phi3", "Phi3ForCausalLM", "LlamaModel", True),               # phi3.py:10, LlamaForCausalLM's __init__
    ("qwen3", "Qwen3ForCausalLM", "Qwen3Model", True),             # Qwen3Model(Qwen2Model), qwen2.py:335
    ("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeModel", False),  # the mixin's False, interfaces.py:1611
    ("mimo", "MiMoForCausalLM", "MiMoModel", False),               # mimo.py:104; MiMoModel(Qwen2Model) sets False, :58
    ("sarvam", "SarvamMLAForCausalLM", "SarvamMLAModel", True),    # sarvam.py:675; flag :466
    ("sarvam", "SarvamMoEForCausalLM", "BailingMoeModel", False),  # sarvam.py:751, BailingMoeForCausalLM's __init__
    ("internlm2", "InternLM2ForCausalLM", "InternLM2Model", False),  # internlm2.py:336, a parameter's default
])
def test_decoder_class_and_flag(module, outer, decoder, relays):
    from vllm_dualgpu.engine import aux_pp

    try:
        mod = importlib.import_module(f"vllm.model_executor.models.{module}")
    except ImportError as exc:
        pytest.skip(f"this vLLM has no importable models/{module}.py here: {exc}")
    cls = getattr(mod, outer, None)
    if cls is None:
        pytest.skip(f"this vLLM's models/{module}.py has no {outer}")
    if module == "mimo" and FLAG not in vars(mod.MiMoModel):
        pytest.skip("this vLLM's MiMoModel inherits Qwen2Model's flag (0.33 sets it False, mimo.py:58)")
    if module == "sarvam" and relays and tuple(int(x) for x in VLLM.split(".")[:2]) < (0, 33):
        pytest.skip("SarvamMLAModel declares the flag from vLLM 0.33 (sarvam.py:466); 0.30.0's does not")
    relay = aux_pp.relay_of(cls)
    assert (relay.model_class, relay.decoder_class, relay.relays, relay.why) == (outer, decoder, relays, "")


def test_no_decoder_found_is_no_answer():
    from vllm.model_executor.models.gpt2 import GPT2LMHeadModel

    from vllm_dualgpu.engine import aux_pp

    relay = aux_pp.relay_of(GPT2LMHeadModel)
    assert relay.model_class == "GPT2LMHeadModel" and relay.relays is None and relay.decoder_class == ""
    assert "self.model" in relay.why


def test_a_fake_model_config_is_not_sent_to_a_subprocess(monkeypatch):
    """Configs that are not vLLM's (the tests' stand-ins) get no answer, without a subprocess."""
    from types import SimpleNamespace

    from vllm_dualgpu.engine import aux_pp

    monkeypatch.setattr(vllm_registry, "_run_in_subprocess", lambda fn: pytest.fail("a subprocess was started"))
    relay = aux_pp.find(SimpleNamespace(architectures=["LlamaForCausalLM"]))
    assert relay.relays is None and relay.why


# vLLM reads a multimodal model's flag from its language model's ``.model`` (``_inner_decoder``:
# ``get_language_model()``, the module assigned under ``_mark_language_model``, interfaces.py:270-313).
@pytest.mark.parametrize("module,outer,text_archs,decoder,relays", [
    # qwen2_5_vl.py:1443-1448, init_vllm_registered_model(architectures=["Qwen2ForCausalLM"]); qwen2.py's flag
    ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", (), "Qwen2Model", True),
    # qwen3_vl.py:2043, Qwen3LLMForCausalLM(...) called; its self.model = Qwen3LLMModel(Qwen3Model), :1846/:1910
    ("qwen3_vl", "Qwen3VLForConditionalGeneration", (), "Qwen3LLMModel", True),
    # mllama4.py:780-785, initialize_model(model_class=Llama4ForCausalLM); Llama4Model(LlamaModel), llama4.py:384
    ("mllama4", "Llama4ForConditionalGeneration", (), "Llama4Model", True),
    # gemma4_mm.py:1145-1149 architectures=["Gemma4ForCausalLM"]; Gemma4Model keeps the mixin's False, gemma4.py:989
    ("gemma4_mm", "Gemma4ForConditionalGeneration", (), "Gemma4Model", False),
    # llava.py:568-573: hf_config=config.text_config, no architectures: the text config's say which
    ("llava", "LlavaForConditionalGeneration", ("MistralForCausalLM",), "MistralModel", True),
    ("llava", "LlavaForConditionalGeneration", ("Qwen3MoeForCausalLM",), "Qwen3MoeModel", False),
    # mistral3.py:498-500, as Llava: its text config (transformers' MistralForCausalLM for type mistral)
    ("mistral3", "Mistral3ForConditionalGeneration", ("MistralForCausalLM",), "MistralModel", True),
])
def test_a_multimodal_model_answers_for_its_language_model(module, outer, text_archs, decoder, relays):
    from vllm_dualgpu.engine import aux_pp

    try:
        cls = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), outer)
    except (ImportError, AttributeError) as exc:
        pytest.skip(f"this vLLM has no {outer} importable here: {exc}")
    relay = aux_pp.relay_of(cls, text_architectures=text_archs)
    assert (relay.model_class, relay.decoder_class, relay.relays, relay.why) == (outer, decoder, relays, "")


def test_a_text_config_without_architectures_builds_transformers_causal_lm_for_its_type():
    """vLLM 0.33's with_hf_config (config/vllm.py:964-981): a text config that names no
    architecture (as Llava's and Mistral 3's usually do) is built as transformers' causal-LM
    class of its model type."""
    from transformers import LlamaConfig, MistralConfig

    from vllm_dualgpu.engine import aux_pp

    assert MistralConfig().architectures is None
    assert aux_pp.text_architectures(MistralConfig()) == ("MistralForCausalLM",)
    assert aux_pp.text_architectures(LlamaConfig(architectures=["MyLlama"])) == ("MyLlama",)
    assert aux_pp.text_architectures(None) == ()


def test_a_multimodal_model_whose_text_config_names_no_architecture_is_no_answer():
    from vllm_dualgpu.engine import aux_pp

    try:
        from vllm.model_executor.models.llava import LlavaForConditionalGeneration
    except ImportError as exc:  # vLLM 0.30's llava.py imports torchvision, which the CPU torch here lacks
        pytest.skip(f"this vLLM's llava.py does not import here: {exc}")
    relay = aux_pp.relay_of(LlavaForConditionalGeneration)
    assert relay.relays is None and relay.model_class == "LlavaForConditionalGeneration"
    assert "text config" in relay.why and "architectures" in relay.why


def test_a_multimodal_model_whose_language_model_is_not_found_is_no_answer():
    from torch import nn
    from vllm.model_executor.models.llama import LlamaModel

    from vllm_dualgpu.engine import aux_pp

    def build():
        return LlamaModel

    class Multimodal(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = LlamaModel()  # not the language model: vLLM reads get_language_model()'s .model
            self.language_model = build()()

        def get_language_model(self):
            return self.language_model

    relay = aux_pp.relay_of(Multimodal)
    assert relay.relays is None and "multimodal" in relay.why and "language model" in relay.why
