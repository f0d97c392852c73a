"""Token-for-token comparison of vLLM runs (issue #7): prompts, each run's settings, the comparison.

32 prompts (token ids, 3 to ~2600 tokens, 4 families of 6 sharing a prefix; 8 to 64 new tokens,
greedy, ``ignore_eos``) in three passes: ``no-hits`` (cache reset, ``skip_reading_prefix_cache``),
``prefix-hits`` (cache reset, the family prefixes first) and ``full-hits`` (all again). bf16 runs
cannot promise bitwise-equal logits (no batch-invariant mode for GDN in vLLM 0.30, and
``VLLM_BATCH_INVARIANT`` leaves NCCL no algorithm for PP's broadcast): split-K GEMMs are off and a
divergence passes only as a near tie (both candidates within ``TIE_TOL`` nats in BOTH runs' top-5
at the first differing position). float32 (E2E_DTYPE) is strict, with Triton attention and IEEE
products; the hybrid is left out there, ``small-attn-mtp`` runs MTP (docs/gpu-runs.md, float32 notes).
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
    # Stock (pp=1) keeps vLLM's default utilization and must have the GPU to itself: its profile
    # reads device-wide free memory, so another run's allocations during it count as its own
    # (seen: "Available KV cache memory: -25.18 GiB" at 0.1 next to a headline arm).
    if mtp:
        kw["speculative_config"] = dict(MTP)
    if model == "hybrid":
        kw["additional_config"] = gdn_prefill_config()  # the same GDN kernel in every run
    if dtype == "float32":  # the one attention backend that takes it (docs/gpu-runs.md, float32 notes)
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
