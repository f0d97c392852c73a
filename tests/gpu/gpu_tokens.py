"""Token-for-token comparison of vLLM runs (issue #7): prompts, the engine settings of each run,
and the comparison itself. Used by tests/gpu/test_gpu_e2e_correctness.py (on GPUs) and by the
CPU tests that build each run's VllmConfig (tests/integration/test_gpu_run_configs.py).

Every run generates the same 32 prompts (token ids, 3 to ~2600 tokens, 4 families of 6 sharing
a prefix of 150-1700 tokens; 8 to 64 new tokens each, greedy, ``ignore_eos``) in three passes:
``no-hits`` (prefix cache reset, every request with ``skip_reading_prefix_cache``), ``prefix-hits``
(cache reset, the 4 family prefixes first, then all 32) and ``full-hits`` (all 32 again).

Exactness: vLLM 0.30 refuses batch-invariant mode for every Mamba/GDN backend, and the GDN
prefill kernels compute a prompt in chunks whose boundaries move with a prefix-cache hit and with
the scheduler's batch, so bf16 runs cannot promise bitwise-equal logits: they run with split-K off
(``CUBLAS_WORKSPACE_CONFIG=:16:8``, ``CUBLASLT_WORKSPACE_SIZE=1``) and a token budget that holds a
whole pass, and a divergence is accepted only where both runs saw a near tie: the two candidate
tokens within ``TIE_TOL`` nats in BOTH runs' top-5 logprobs at the first differing position.
``VLLM_BATCH_INVARIANT=1`` is not used: it sets ``NCCL_ALGO=allreduce:tree``, under which NCCL 2.32
has no algorithm for the broadcast vLLM 0.30's pipeline uses for sampled tokens, so no PP=2
engine boots with it (docs/gpu-runs.md). E2E_DTYPE=float32 runs every engine in float32 and
every comparison strictly (a near tie fails), with ``attention_backend="TRITON_ATTN"`` and
``TRITON_F32_DEFAULT=ieee``; the hybrid is left out there (no float32 GDN prefill kernel), its MTP
runs use ``small-attn-mtp`` (the same Qwen3.5 class and MTP layer, every layer full attention).
"""

from __future__ import annotations

import os
import random

from gpu_models import gdn_prefill_config

MAX_MODEL_LEN = 4096
MAX_BATCHED_TOKENS = 32768  # holds one whole pass: prompts are not split by the token budget
LOGPROBS = 5
TIE_TOL = 0.1  # nats; logits near 4 are 0.03 apart in bf16
MTP = {"method": "mtp", "num_speculative_tokens": 2}
PASSES = ("no-hits", "prefix-hits", "full-hits")
DTYPES = ("bfloat16", "float32")  # E2E_DTYPE values, the default first
PRESETS = {"dense": "small-dense", "hybrid": "small-hybrid", "attn": "small-attn-mtp"}
FP32_LEFT_OUT = {"hybrid": "vLLM 0.30 has no float32 GDN prefill kernel (FLA's chunk_gated_delta_rule "
                           "asserts q.dtype != float32; FlashInfer's SM90 kernel takes fp16/bf16 only)"}

# --- prompts ------------------------------------------------------------------------------------

SINGLE_LENGTHS = (3, 17, 64, 129, 400, 800, 1500, 2600)
PREFIX_LENGTHS = (150, 520, 1030, 1700)
SUFFIX_LENGTHS = (1, 5, 33, 100, 257, 610)
MAX_TOKENS_CYCLE = (16, 48, 8, 64, 32, 24)


def build_prompts(seed: int = 0, vocab: int = 4096) -> dict:
    """32 token-id prompts: 8 single prompts and 4 families of 6 that share a long prefix.

    Returns ``prompts``, ``max_tokens`` (mixed, 8-64), ``family`` (family index or None per
    prompt) and ``prefixes`` (the family prefixes, to be seen before the family prompts).
    Ids avoid 0-2 (unk/bos/eos of the test tokenizer). Deterministic for a seed.
    """
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    prefixes = [ids(n) for n in PREFIX_LENGTHS]
    singles = [ids(n) for n in SINGLE_LENGTHS]
    prompts: list[list[int]] = []
    family: list[int | None] = []
    # Interleave: one single prompt, then one family, so hits and misses share batches.
    for f, prefix in enumerate(prefixes):
        for s in singles[2 * f:2 * f + 2]:
            prompts.append(s)
            family.append(None)
        for n in SUFFIX_LENGTHS:
            prompts.append(prefix + ids(n))
            family.append(f)
    max_tokens = [MAX_TOKENS_CYCLE[i % len(MAX_TOKENS_CYCLE)] for i in range(len(prompts))]
    for i, p in enumerate(prompts):
        assert len(p) + max_tokens[i] <= MAX_MODEL_LEN, (i, len(p))
    return {"prompts": prompts, "max_tokens": max_tokens, "family": family, "prefixes": prefixes}


# --- comparison ---------------------------------------------------------------------------------


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token; the shorter length if one is a prefix of the other;
    None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _lp(position: list | None, token: int) -> float | None:
    """Logprob of token in one position's top-k list ([[token, logprob], ...]), or None."""
    for t, lp in position or ():
        if t == token:
            return lp
    return None


def token_logprobs(completion) -> list[list[list]]:
    """A vLLM completion's logprobs as :func:`compare` reads them: per position, [token, logprob]
    pairs, best first."""
    return [sorted(([tid, round(lp.logprob, 5)] for tid, lp in pos.items()), key=lambda x: -x[1])
            for pos in (completion.logprobs or [])]


def compare(ref: list[list[int]], got: list[list[int]], ref_lps: list | None = None,
            got_lps: list | None = None, tie_tol: float = TIE_TOL, strict: bool = True) -> dict:
    """Compare two runs' outputs prompt by prompt.

    Every mismatch gives the prompt, the first differing index and both tokens there. With
    logprobs (per prompt, per position: [[token, logprob], ...]), also the gap between the two
    candidates in each run; ``near_tie`` when both gaps are known and at most ``tie_tol``.
    ``ok``: no mismatch, or (not strict) only near ties.
    """
    if len(ref) != len(got):
        return {"prompts": len(ref), "identical": 0, "mismatches": [], "ok": False,
                "reason": f"{len(ref)} outputs vs {len(got)}"}
    mismatches = []
    for i, (a, b) in enumerate(zip(ref, got)):
        j = first_difference(a, b)
        if j is None:
            continue
        m: dict = {"prompt": i, "first_diff": j, "len_ref": len(a), "len_got": len(b),
                   "ref_token": a[j] if j < len(a) else None, "got_token": b[j] if j < len(b) else None}
        gaps = []
        if m["ref_token"] is not None and m["got_token"] is not None and ref_lps and got_lps:
            pos_r = ref_lps[i][j] if j < len(ref_lps[i]) else None
            pos_g = got_lps[i][j] if j < len(got_lps[i]) else None
            for pos, mine, other in ((pos_r, a[j], b[j]), (pos_g, b[j], a[j])):
                lm, lo = _lp(pos, mine), _lp(pos, other)
                gaps.append(None if lm is None or lo is None else round(lm - lo, 5))
            m["gap_ref"], m["gap_got"] = gaps
        m["near_tie"] = len(gaps) == 2 and all(g is not None and abs(g) <= tie_tol for g in gaps)
        mismatches.append(m)
    ok = not mismatches or (not strict and all(m["near_tie"] for m in mismatches))
    return {"prompts": len(ref), "identical": len(ref) - len(mismatches),
            "near_ties": sum(m["near_tie"] for m in mismatches), "mismatches": mismatches, "ok": ok}


# --- runs ---------------------------------------------------------------------------------------


def e2e_dtype() -> str:
    """The engines' dtype: E2E_DTYPE, bfloat16 when unset."""
    d = os.environ.get("E2E_DTYPE") or DTYPES[0]
    if d not in DTYPES:
        raise ValueError(f"E2E_DTYPE={d!r}: must be one of {', '.join(DTYPES)}")
    return d


def mtp_model(dtype: str) -> str:
    """The model of the MTP runs: the hybrid, or in float32 its all-attention twin."""
    return "attn" if dtype == "float32" else "hybrid"


def engine_kwargs(model: str, model_dir, pp: int, dtype: str, mtp: bool = False, prefix_caching: bool = True) -> dict:
    """One run's engine arguments: stock vLLM on one GPU (pp=1) or the plugin over two (pp=2)."""
    kw = {"model": str(model_dir), "skip_tokenizer_init": True, "enforce_eager": True,
          "dtype": dtype, "max_model_len": MAX_MODEL_LEN, "seed": 0,
          "max_num_batched_tokens": MAX_BATCHED_TOKENS, "max_num_seqs": 64,
          "enable_prefix_caching": prefix_caching, "disable_log_stats": False}
    if pp > 1:
        kw.update(pipeline_parallel_size=pp, distributed_executor_backend="dualgpu")
    if mtp:
        kw["speculative_config"] = dict(MTP)
    if model == "hybrid":
        kw["additional_config"] = gdn_prefill_config()  # the same GDN kernel in every run
    if dtype == "float32":  # the one attention backend that takes it (FLOAT32_NOTES)
        kw["attention_backend"] = "TRITON_ATTN"
    return kw


def run_env(dtype: str, gpu: str | None = None) -> dict:
    env = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}  # no split-K GEMMs
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    if dtype == "float32":  # IEEE float32 products in Triton kernels and cuBLAS, not TF32
        env["TRITON_F32_DEFAULT"] = "ieee"
        env["VLLM_FLOAT32_MATMUL_PRECISION"] = "highest"
    return env


def three_passes(llm, prompts: dict) -> dict:
    """In a vLLM process: the three passes' tokens, logprobs and prefix-cache hits."""
    from vllm import SamplingParams

    inputs = [{"prompt_token_ids": p} for p in prompts["prompts"]]

    def params(skip_read: bool):
        return [SamplingParams(temperature=0.0, max_tokens=mt, ignore_eos=True, logprobs=LOGPROBS,
                               skip_reading_prefix_cache=True if skip_read else None)
                for mt in prompts["max_tokens"]]

    passes = {}

    def generate(name: str, skip_read: bool) -> None:
        outs = llm.generate(inputs, params(skip_read), use_tqdm=False)
        passes[name] = {"outputs": [list(o.outputs[0].token_ids) for o in outs],
                        "logprobs": [token_logprobs(o.outputs[0]) for o in outs],
                        "num_cached_tokens": [o.num_cached_tokens or 0 for o in outs]}

    llm.reset_prefix_cache()
    generate("no-hits", skip_read=True)
    llm.reset_prefix_cache()
    llm.generate([{"prompt_token_ids": p} for p in prompts["prefixes"]],
                 SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    generate("prefix-hits", skip_read=False)
    generate("full-hits", skip_read=False)
    return {"passes": passes, "spec": spec_counters(llm)}


def spec_counters(llm) -> dict:
    """vLLM's speculative-decoding counters (``LLM.get_metrics()``), summed."""
    names = {"vllm:spec_decode_num_drafts": "num_drafts", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}
    totals = dict.fromkeys(names.values(), 0)
    for m in llm.get_metrics():
        if m.name in names and hasattr(m, "value"):
            totals[names[m.name]] += m.value
    return totals


# FLOAT32_NOTES: what vLLM 0.30.0 does with dtype=float32 on an H200 (SM 9.0), read from its
# sources (paths under site-packages/). The float32 runs planned from them have since passed on
# two H200s, every comparison strict (docs/gpu-runs.md, fifth and sixth sessions).
# - Attention: the SM 9.x non-MLA priority list is FLASH_ATTN, FLASHINFER, TRITON_ATTN,
#   FLEX_ATTENTION (vllm/platforms/cuda.py:166-178); FlashAttention and FlashInfer take fp16/bf16
#   only (vllm/v1/attention/backends/flash_attn.py:284, flashinfer.py:413; checked in
#   vllm/v1/attention/backend.py:299), Triton takes float32 (triton_attn.py:289-293). So auto
#   selection lands on TRITON_ATTN; it is named here (attention_backend, vllm/engine/arg_utils.py:
#   2494-2503) so a refusal is an error at boot (vllm/platforms/cuda.py:460-476), not a fallback.
# - TF32: the Triton attention kernel's tl.dot calls name no precision
#   (vllm/v1/attention/ops/triton_unified_attention.py:545-589), and Triton 3.9 defaults fp32 dots
#   to TF32 on NVIDIA (triton/language/core.py:2284, triton/backends/nvidia/compiler.py:139)
#   unless TRITON_F32_DEFAULT is set (triton/knobs.py:498; part of Triton's cache key): float32
#   runs set TRITON_F32_DEFAULT=ieee. cuBLAS stays IEEE: workers call
#   torch.set_float32_matmul_precision(VLLM_FLOAT32_MATMUL_PRECISION), default "highest"
#   (vllm/v1/worker/gpu_worker.py:199-201, vllm/envs.py:611-616); set explicitly here too.
#   Decode batches of at most 128 // kv_heads sequences use the 3D (split-softmax) kernel, others
#   the 2D one (triton_unified_attention.py:1046-1055): batch composition still changes the
#   reduction order, at float32 rounding (~1e-7) instead of bf16's.
# - GDN (Qwen3.5): refused. The prefill kernels take no float32: FLA's chunk_gated_delta_rule
#   asserts q.dtype != float32 (vllm/third_party/flash_linear_attention/ops/chunk.py:212-215,
#   used for gdn_prefill_backend=triton, which gpurun.gdn_prefill_config sets); FlashInfer's SM90
#   kernel raises for anything but fp16/bf16 (flashinfer/gdn_kernels/delta_rule_dsl/
#   delta_rule_sm90.py:2326-2331; its CP variant too, flashinfer/gdn_prefill.py:86-87); CuTe DSL
#   is SM100 only (vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py:133-148). No
#   setting avoids them. The profile-time warmup swallows the error (qwen_gdn_linear_attn.py:
#   1157-1178), so the engine would boot and fail at its first prefill: float32 runs leave the
#   hybrid out (FP32_LEFT_OUT). The rest would take float32: causal_conv1d casts to the conv-state
#   dtype with no check (vllm/model_executor/layers/mamba/ops/causal_conv1d.py:557, 1160), the
#   recurrent decode kernels compute in float32 (flash_linear_attention/ops/fused_recurrent.py:
#   120-143, fused_sigmoid_gating.py:120-136), the fused CUDA decode falls back to Triton for
#   non-bf16 models (qwen_gdn_linear_attn.py:510-557), and the GDN states follow the model dtype
#   (vllm/model_executor/layers/mamba/mamba_utils.py:98-110).
# - MTP: the drafter gets the target's dtype (vllm/config/speculative.py:1281); no dtype check.
#   Prefix caching with mamba_cache_mode "align" has none either
#   (vllm/model_executor/models/config.py:622-650). CUDA graphs: these runs are enforce_eager;
#   TRITON_ATTN supports them anyway (triton_attn.py:100).
