"""CPU checks of the GPU-machine scripts (issue #7): arguments, models, prompts, comparison,
soak client and statistics, and the GPU suite runner. Nothing here needs a GPU."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import GPU_SCRIPTS, gpu_script_dry_run

sys.path.insert(0, str(GPU_SCRIPTS))  # the scripts import each other by name
import e2e_correctness as e2e  # noqa: E402
import make_model  # noqa: E402
import soak  # noqa: E402


@pytest.fixture(autouse=True)
def _e2e_default_dtype(monkeypatch):
    """The e2e harness's default dtype (bf16) unless a test sets E2E_DTYPE itself."""
    monkeypatch.delenv("E2E_DTYPE", raising=False)


# --- arguments ----------------------------------------------------------------------------------


def test_e2e_arguments(tmp_path):
    a = e2e.parse_args([str(tmp_path)])
    assert a.outdir == tmp_path and not a.quick and not a.strict and a.tie_tol == e2e.TIE_TOL
    a = e2e.parse_args([str(tmp_path), "--quick", "--strict", "--tie-tol", "0.2", "--run-timeout", "99"])
    assert a.quick and a.strict and a.tie_tol == 0.2 and a.run_timeout == 99
    with pytest.raises(SystemExit):
        e2e.parse_args([])  # OUTDIR is required outside --child
    assert e2e.parse_args(["--child", "spec.json"]).child == "spec.json"


def test_soak_arguments(tmp_path):
    a = soak.parse_args([str(tmp_path)])
    assert (a.minutes, a.concurrency, a.sample_s, a.preset) == (10.0, 8, 30.0, "small-hybrid")
    a = soak.parse_args([str(tmp_path), "--minutes", "0.5", "--concurrency", "3", "--no-mtp"])
    assert (a.minutes, a.concurrency, a.no_mtp) == (0.5, 3, True)
    for bad in (["--minutes", "0"], ["--concurrency", "0"], ["--request-timeout", "-1"], ["--preset", "nope"]):
        with pytest.raises(SystemExit):
            soak.parse_args([str(tmp_path), *bad])
    with pytest.raises(SystemExit):
        soak.parse_args([])


def test_make_model_rejects_unknown_preset(tmp_path):
    r = subprocess.run([sys.executable, str(GPU_SCRIPTS / "make_model.py"), "no-such-preset", str(tmp_path / "m")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "invalid choice" in r.stderr
    assert not (tmp_path / "m").exists()


# --- models -------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", sorted(make_model.PRESETS))
def test_make_model_writes_config_and_tokenizer(preset, tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("tokenizers", reason="tokenizers is not installed")
    out = tmp_path / preset
    monkeypatch.setattr(sys, "argv", ["make_model.py", preset, str(out), "--weights", "dummy"])
    make_model.main()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg == make_model.PRESETS[preset]()
    hf = transformers.AutoConfig.from_pretrained(str(out))
    assert hf.model_type == cfg["model_type"] and hf.num_hidden_layers == cfg["num_hidden_layers"]
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    sentence = "the sun and the moon over planet earth, 42 times!"
    ids = tok(sentence)["input_ids"]
    assert ids and max(ids) < cfg["vocab_size"]
    assert tok.decode(ids) == sentence
    assert not make_model.has_mtp(out)  # dummy: no weights at all


def test_hybrid_preset_is_a_qwen35_gdn_model_with_mtp():
    cfg = make_model.PRESETS["small-hybrid"]()
    assert cfg["architectures"] == ["Qwen3_5ForCausalLM"] and cfg["model_type"] == "qwen3_5_text"
    kinds = cfg["layer_types"]
    assert len(kinds) == cfg["num_hidden_layers"] and set(kinds) == {"linear_attention", "full_attention"}
    assert kinds.count("linear_attention") == 3 * kinds.count("full_attention")
    assert cfg["mtp_num_hidden_layers"] == 1 and make_model.is_hybrid(cfg)
    assert not make_model.is_hybrid(make_model.PRESETS["small-dense"]())


def test_attn_mtp_preset_is_the_hybrid_with_attention_everywhere():
    """float32's stand-in for the hybrid differs from it only in the layer kinds."""
    hybrid, attn = make_model.PRESETS["small-hybrid"](), make_model.PRESETS["small-attn-mtp"]()
    assert set(attn["layer_types"]) == {"full_attention"} and not make_model.is_hybrid(attn)
    assert len(attn["layer_types"]) == attn["num_hidden_layers"] == hybrid["num_hidden_layers"]
    assert {k: v for k, v in attn.items() if k != "layer_types"} == \
        {k: v for k, v in hybrid.items() if k != "layer_types"}


def test_mtp_tensors_named_and_shaped_like_qwen35():
    torch = pytest.importorskip("torch")
    cfg = make_model.PRESETS["small-hybrid"]()
    full = cfg["layer_types"].index("full_attention")
    h = cfg["hidden_size"]
    state = {f"model.layers.{full}.self_attn.q_proj.weight": torch.zeros(2 * 8 * 256, h),
             f"model.layers.{full}.self_attn.q_norm.weight": torch.zeros(256),
             f"model.layers.{full}.mlp.down_proj.weight": torch.zeros(h, 1536),
             "model.layers.0.linear_attn.in_proj_qkv.weight": torch.zeros(1024, h)}
    t = make_model.mtp_tensors(cfg, state, seed=0)
    assert set(t) == {"mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight",
                      "mtp.pre_fc_norm_embedding.weight", "mtp.layers.0.self_attn.q_proj.weight",
                      "mtp.layers.0.self_attn.q_norm.weight", "mtp.layers.0.mlp.down_proj.weight"}
    assert tuple(t["mtp.fc.weight"].shape) == (h, 2 * h)
    assert tuple(t["mtp.layers.0.self_attn.q_proj.weight"].shape) == (2 * 8 * 256, h)
    assert not t["mtp.norm.weight"].any() and t["mtp.fc.weight"].float().std() > 0.01
    again, other = make_model.mtp_tensors(cfg, state, seed=0), make_model.mtp_tensors(cfg, state, seed=1)
    assert all(torch.equal(t[k], again[k]) for k in t)
    assert not torch.equal(t["mtp.fc.weight"], other["mtp.fc.weight"])


@pytest.mark.parametrize("preset", ["small-hybrid", "small-attn-mtp"])
def test_qwen35_random_weights_include_mtp(tmp_path, preset):
    pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("safetensors", reason="safetensors is not installed")
    out = tmp_path / "hy"
    out.mkdir()
    cfg = make_model.PRESETS[preset]()
    cfg.update(num_hidden_layers=4, layer_types=cfg["layer_types"][:4], hidden_size=128,
               intermediate_size=256, vocab_size=512)
    make_model.write_random_weights(out, cfg, seed=0)
    (out / "config.json").write_text(json.dumps(cfg))
    main_names = set().union(*(make_model._safetensors_names(f) for f in out.glob("*.safetensors")
                               if f.name != "model-mtp.safetensors"))
    mtp_names = set(make_model._safetensors_names(out / "model-mtp.safetensors"))
    gdn = "model.layers.0.linear_attn.in_proj_qkv.weight"
    assert (gdn in main_names) == make_model.is_hybrid(cfg)
    assert ("model.layers.0.self_attn.q_proj.weight" in main_names) != make_model.is_hybrid(cfg)
    assert not any(n.startswith("mtp.") for n in main_names)
    layer = {n.split("model.layers.3.", 1)[1] for n in main_names if n.startswith("model.layers.3.")}
    assert {n.split("mtp.layers.0.", 1)[1] for n in mtp_names if n.startswith("mtp.layers.0.")} == layer
    assert make_model.has_mtp(out)


def test_vllm_resolves_the_hybrid_and_its_mtp_drafter(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    out = tmp_path / "hy"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(make_model.PRESETS["small-hybrid"]()))
    monkeypatch.setenv("VLLM_PLUGINS", "")
    from vllm.engine.arg_utils import EngineArgs

    cfg = EngineArgs(model=str(out), skip_tokenizer_init=True, load_format="dummy", max_model_len=4096,
                     enforce_eager=True, speculative_config=dict(e2e.MTP)).create_engine_config()
    assert cfg.model_config.architectures == ["Qwen3_5ForCausalLM"]
    assert cfg.speculative_config.draft_model_config.architectures == ["Qwen3_5MTP"]
    assert cfg.speculative_config.num_speculative_tokens == e2e.MTP["num_speculative_tokens"]


# --- prompts ------------------------------------------------------------------------------------


def test_prompts_mixed_lengths_and_shared_prefixes():
    p = e2e.build_prompts(seed=0, vocab=4096)
    prompts, fam = p["prompts"], p["family"]
    assert len(prompts) >= 32 and len(fam) == len(prompts) == len(p["max_tokens"])
    lengths = [len(x) for x in prompts]
    assert min(lengths) < 20 and max(lengths) > 2000 and len(set(lengths)) >= 16
    assert len(set(p["max_tokens"])) >= 3
    assert all(n + m <= e2e.MAX_MODEL_LEN for n, m in zip(lengths, p["max_tokens"]))
    assert all(3 <= t < 4096 for x in prompts for t in x)
    families = sorted({f for f in fam if f is not None})
    assert len(families) == len(p["prefixes"]) >= 4
    for f in families:
        members = [x for x, g in zip(prompts, fam) if g == f]
        assert len(members) >= 2 and len(p["prefixes"][f]) >= 100
        assert all(x[: len(p["prefixes"][f])] == p["prefixes"][f] and len(x) > len(p["prefixes"][f]) for x in members)
    singles = [x for x, g in zip(prompts, fam) if g is None]
    heads = [tuple(x[:16]) for x in prompts]
    assert all(heads.count(tuple(x[:16])) == 1 for x in singles if len(x) >= 16)


def test_prompts_deterministic_per_seed():
    assert e2e.build_prompts(seed=0) == e2e.build_prompts(seed=0)
    assert e2e.build_prompts(seed=0)["prompts"] != e2e.build_prompts(seed=1)["prompts"]


# --- comparison ---------------------------------------------------------------------------------


def test_first_difference():
    assert e2e.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert e2e.first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert e2e.first_difference([5], [6]) == 0
    assert e2e.first_difference([1, 2, 3], [1, 2]) == 2
    assert e2e.first_difference([], [4]) == 0


def _lps(outputs, gap_at=None, gap=1.0, alt=None):
    """Top-2 logprobs per position: the emitted token first; at gap_at, alt second with gap."""
    res = []
    for i, toks in enumerate(outputs):
        row = []
        for j, t in enumerate(toks):
            second = alt if (gap_at == (i, j) and alt is not None) else 9999
            row.append([[t, -0.1], [second, -0.1 - (gap if gap_at == (i, j) else 3.0)]])
        res.append(row)
    return res


def test_token_logprobs_is_what_compare_reads():
    """vLLM's per-position {token: Logprob} dicts become [token, logprob] pairs, best first."""
    from types import SimpleNamespace as NS

    completion = NS(logprobs=[{7: NS(logprob=-2.0), 5: NS(logprob=-0.1234567)}, {9: NS(logprob=-0.5)}])
    assert e2e.token_logprobs(completion) == [[[5, -0.12346], [7, -2.0]], [[9, -0.5]]]
    assert e2e.token_logprobs(NS(logprobs=None)) == []


def test_compare_reports_first_differing_index():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11], [7, 7]]
    got = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 42, 43], [7, 7]]
    c = e2e.compare(ref, got)
    assert not c["ok"] and c["identical"] == 2 and c["prompts"] == 3
    (m,) = c["mismatches"]
    assert (m["prompt"], m["first_diff"], m["ref_token"], m["got_token"]) == (1, 5, 10, 42)
    assert e2e.compare(ref, [list(x) for x in ref]) == {"prompts": 3, "identical": 3, "near_ties": 0,
                                                       "mismatches": [], "ok": True}


def test_compare_near_ties_only_when_not_strict():
    ref, got = [[1, 2, 3]], [[1, 2, 8]]
    tie_ref, tie_got = _lps(ref, (0, 2), 0.02, alt=8), _lps(got, (0, 2), 0.03, alt=3)
    loose = e2e.compare(ref, got, tie_ref, tie_got, tie_tol=0.1, strict=False)
    assert loose["ok"] and loose["near_ties"] == 1
    m = loose["mismatches"][0]
    assert m["near_tie"] and m["gap_ref"] == pytest.approx(0.02) and m["gap_got"] == pytest.approx(0.03)
    assert not e2e.compare(ref, got, tie_ref, tie_got, tie_tol=0.1, strict=True)["ok"]
    # A wide gap in either run is a real divergence.
    wide = e2e.compare(ref, got, tie_ref, _lps(got, (0, 2), 0.9, alt=3), tie_tol=0.1, strict=False)
    assert not wide["ok"] and not wide["mismatches"][0]["near_tie"]
    # The other run's token missing from the top-k: no gap, no tie.
    absent = e2e.compare(ref, got, _lps(ref), tie_got, tie_tol=0.1, strict=False)
    assert not absent["ok"] and absent["mismatches"][0]["gap_ref"] is None


def test_compare_length_differences_are_never_ties():
    c = e2e.compare([[1, 2, 3]], [[1, 2]], _lps([[1, 2, 3]]), _lps([[1, 2]]), strict=False)
    assert not c["ok"] and c["mismatches"][0]["first_diff"] == 2 and c["mismatches"][0]["got_token"] is None
    assert not e2e.compare([[1]], [[1], [2]])["ok"]


# --- runs and comparisons wiring ----------------------------------------------------------------


@pytest.mark.parametrize("quick", [True, False])
def test_plan_covers_every_comparison(quick):
    runs = [r for phase in e2e.plan_runs(quick) for lane in phase for r in lane]
    names = {r.name for r in runs}
    assert len(runs) == (4 if quick else 6) and len(names) == len(runs)
    assert all(r.pp == 1 and r.gpu is not None for r in e2e.plan_runs(quick)[0][0] + e2e.plan_runs(quick)[0][1])
    assert all(r.pp == 2 and r.gpu is None for phase in e2e.plan_runs(quick)[1:] for lane in phase for r in lane)
    comps = e2e.planned_comparisons(quick)
    assert len({c[0] for c in comps}) == len(comps)
    for _, ra, pa, rb, pb in comps:
        assert ra in names and rb in names and pa in e2e.PASSES and pb in e2e.PASSES
    assert any(ra.endswith("1gpu") and rb.endswith("pp2") and "mtp" in ra for _, ra, _, rb, _ in comps)
    assert any(ra == rb and "mtp" in ra and pa == "no-hits" and pb in e2e.HIT_PASSES for _, ra, pa, rb, pb in comps)


def test_engine_settings_per_run(tmp_path, monkeypatch):
    monkeypatch.delenv("E2E_BATCH_INVARIANT", raising=False)
    monkeypatch.delenv("GDN_PREFILL_BACKEND", raising=False)
    stock = e2e.Run("dense-1gpu", "dense", 1, gpu="0")
    plug = e2e.Run("hybrid-mtp-pp2", "hybrid", 2, mtp=True)
    ks, kp = e2e.engine_kwargs(stock, tmp_path), e2e.engine_kwargs(plug, tmp_path)
    assert "distributed_executor_backend" not in ks and "pipeline_parallel_size" not in ks
    assert kp["distributed_executor_backend"] == "dualgpu" and kp["pipeline_parallel_size"] == 2
    assert kp["speculative_config"] == e2e.MTP and "speculative_config" not in ks
    for k in (ks, kp):
        assert k["enforce_eager"] and k["dtype"] == "bfloat16" and k["max_model_len"] == e2e.MAX_MODEL_LEN
        assert k["skip_tokenizer_init"] and not k["disable_log_stats"]
    es, ep = e2e.run_env(stock, tmp_path), e2e.run_env(plug, tmp_path)
    # Batch invariance is opt-in: its NCCL_ALGO leaves the PP sampled-token broadcast no algorithm.
    assert es["CUDA_VISIBLE_DEVICES"] == "0" and "VLLM_BATCH_INVARIANT" not in es
    assert es["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert "CUDA_VISIBLE_DEVICES" not in ep and "VLLM_BATCH_INVARIANT" not in ep
    assert ep["CUBLAS_WORKSPACE_CONFIG"] == ":16:8" and ep["VLLM_DUALGPU_PLAN_FILE"].endswith(".plan.json")
    # Hybrid runs name their GDN prefill kernel (the same in every run); dense ones do not.
    assert kp["additional_config"] == e2e.gdn_prefill_config() == {"gdn_prefill_backend": "triton"}
    assert "additional_config" not in ks
    # bf16 (the default): vLLM picks the attention backend; Triton's float32 default is untouched.
    assert "attention_backend" not in ks and "attention_backend" not in kp
    assert "TRITON_F32_DEFAULT" not in es and "TRITON_F32_DEFAULT" not in ep
    monkeypatch.setenv("E2E_BATCH_INVARIANT", "1")
    assert e2e.run_env(stock, tmp_path)["VLLM_BATCH_INVARIANT"] == "1" and stock.invariant


def _fake_run(out: Path, name: str, model: str, prompts: dict, outputs: dict, mtp: bool, cached: dict):
    """A run's info and outputs file, as execute() and child() leave them."""
    spec = {"num_drafts": 5, "num_draft_tokens": 10 if mtp else 0, "num_accepted_tokens": 1}
    passes = {p: {"outputs": outputs[p], "logprobs": _lps(outputs[p]), "num_cached_tokens": cached[p],
                  "spec": spec} for p in e2e.PASSES}
    (out / "outputs").mkdir(exist_ok=True)
    (out / "outputs" / f"{name}.json").write_text(json.dumps({"error": None, "passes": passes}))
    engine = {"enable_prefix_caching": True} | ({"speculative_config": e2e.MTP} if mtp else {})
    return {"ok": True, "run": {"name": name, "model": model, "invariant": model == "dense"}, "engine": engine,
            "passes": {p: {k: v for k, v in d.items() if k not in ("outputs", "logprobs")} for p, d in passes.items()}}


def test_make_comparisons_flags_what_differs(tmp_path):
    prompts = {"prompts": [[3] * 5, [4] * 5, [5] * 9], "max_tokens": [3, 2, 2], "family": [None, 0, 0],
               "prefixes": [[4] * 4]}
    good = {p: [[10, 11, 12], [13, 14], [15, 16]] for p in e2e.PASSES}
    hits = {"no-hits": [0, 0, 0], "prefix-hits": [0, 4, 4], "full-hits": [0, 4, 8]}
    runs = {n: _fake_run(tmp_path, n, m, prompts, good, mtp, hits)
            for n, m, mtp in (("dense-1gpu", "dense", False), ("dense-pp2", "dense", False),
                              ("hybrid-mtp-1gpu", "hybrid", True))}
    bad = {p: [list(x) for x in v] for p, v in good.items()}
    bad["prefix-hits"][2][1] = 99  # the plugin's hybrid diverges in one pass
    runs["hybrid-mtp-pp2"] = _fake_run(tmp_path, "hybrid-mtp-pp2", "hybrid", prompts, bad, True, hits)
    res = {c["name"]: c for c in e2e.make_comparisons(tmp_path, runs, prompts, True, False, 0.1)}
    assert set(res) == {c[0] for c in e2e.planned_comparisons(True)}
    failed = {n for n, c in res.items() if not c["ok"]}
    assert failed == {"hybrid-mtp 1gpu-vs-pp2 prefix-hits", "hybrid-mtp-pp2 no-hits-vs-prefix-hits"}
    m = res["hybrid-mtp 1gpu-vs-pp2 prefix-hits"]["mismatches"][0]
    assert (m["prompt"], m["first_diff"]) == (2, 1)
    assert res["dense 1gpu-vs-pp2 full-hits"]["strict"] and not res["hybrid-mtp 1gpu-vs-pp2 no-hits"]["strict"]


def test_make_comparisons_rejects_vacuous_passes(tmp_path):
    prompts = {"prompts": [[3] * 5, [4] * 5], "max_tokens": [2, 2], "family": [None, 0], "prefixes": [[4] * 4]}
    out = {p: [[1, 2], [3, 4]] for p in e2e.PASSES}
    no_hits = dict.fromkeys(e2e.PASSES, [0, 0])
    runs = {"dense-1gpu": _fake_run(tmp_path, "dense-1gpu", "dense", prompts, out, False, no_hits),
            "hybrid-mtp-1gpu": _fake_run(tmp_path, "hybrid-mtp-1gpu", "hybrid", prompts, out, False,
                                         {"no-hits": [0, 0], "prefix-hits": [0, 4], "full-hits": [0, 4]})}
    runs["hybrid-mtp-1gpu"]["engine"]["speculative_config"] = e2e.MTP  # MTP on, but no drafts
    res = {c["name"]: c for c in e2e.make_comparisons(tmp_path, runs, prompts, True, False, 0.1)}
    assert "no prefix-cache hit" in res["dense-1gpu no-hits-vs-prefix-hits"]["reason"]
    assert "no draft tokens" in res["hybrid-mtp-1gpu no-hits-vs-full-hits"]["reason"]
    assert "without outputs: dense-pp2" in res["dense 1gpu-vs-pp2 no-hits"]["reason"]
    assert not any(c["ok"] for c in res.values())


# --- E2E_DTYPE=float32 ----------------------------------------------------------------------------


def test_e2e_float32_engine_configs(tmp_path, monkeypatch):
    """Every planned float32 run gets a float32 vLLM config with Triton attention (the dry run
    builds the real configs); the hybrid, which has no float32 GDN prefill kernel, is left out
    and its all-attention twin runs MTP in its place, drafter in float32 too."""
    monkeypatch.setenv("E2E_DTYPE", "float32")
    result = json.loads((gpu_script_dry_run("e2e_correctness", tmp_path, timeout=180)
                         / "e2e_dry_run.json").read_text())
    planned = [r for phase in e2e.plan_runs(quick=False) for lane in phase for r in lane]
    assert result["dtype"] == "float32" and set(result["runs"]) == {r.name for r in planned}
    assert {r.name for r in planned} == {"dense-1gpu", "dense-pp2", "attn-1gpu", "attn-mtp-1gpu",
                                         "attn-mtp-pp2", "attn-mtp-pp2-nocache"}
    assert {r.model for r in planned if r.mtp} == {"attn"}
    assert {n: r["draft_dtype"] for n, r in result["runs"].items() if r["draft_dtype"]} == \
        dict.fromkeys(("attn-mtp-1gpu", "attn-mtp-pp2", "attn-mtp-pp2-nocache"), "float32")
    assert result["runs"]["attn-mtp-pp2-nocache"]["enable_prefix_caching"] is False
    for name, run in result["runs"].items():
        assert run["dtype"] == "float32" and run["attention_backend"] == "TRITON_ATTN", (name, run)
    assert result["runs"]["dense-pp2"]["pipeline_parallel_size"] == 2
    assert result["runs"]["dense-pp2"]["executor"] == "DualGpuExecutor"
    assert result["runs"]["dense-1gpu"]["pipeline_parallel_size"] == 1
    assert not any("hybrid" in c[0] for q in (True, False) for c in e2e.planned_comparisons(q))
    names = {c[0] for c in e2e.planned_comparisons(quick=False)}
    assert {"attn-mtp 1gpu-vs-pp2 prefix-hits", "attn-mtp-pp2 full-hits-vs-cache-off"} <= names
    assert all(e2e.run_env(r, tmp_path)["TRITON_F32_DEFAULT"] == "ieee" for r in planned)


def _near_tie_runs(out: Path, dtype: str) -> tuple[dict, dict]:
    """Fake dense runs of one dtype, neither batch invariant, where the PP=2 run takes the
    runner-up token at prompt 2, position 1 in every pass: 0.02 / 0.03 nats behind, a near tie."""
    prompts = {"prompts": [[3] * 5, [4] * 5, [5] * 9], "max_tokens": [3, 2, 2], "family": [None, 0, 0],
               "prefixes": [[4] * 4]}
    hits = {"no-hits": [0, 0, 0], "prefix-hits": [0, 4, 4], "full-hits": [0, 4, 8]}
    ref = [[10, 11, 12], [13, 14], [15, 16]]
    got = [[10, 11, 12], [13, 14], [15, 99]]
    runs = {}
    for name, outs, lps in (("dense-1gpu", ref, _lps(ref, (2, 1), 0.02, alt=99)),
                            ("dense-pp2", got, _lps(got, (2, 1), 0.03, alt=16))):
        runs[name] = _fake_run(out, name, "dense", prompts, dict.fromkeys(e2e.PASSES, outs), False, hits)
        runs[name]["run"]["invariant"] = False
        runs[name]["engine"]["dtype"] = dtype
        f = out / "outputs" / f"{name}.json"
        data = json.loads(f.read_text())
        for p in e2e.PASSES:
            data["passes"][p]["logprobs"] = lps
        f.write_text(json.dumps(data))
    return runs, prompts


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_e2e_near_tie_fails_only_in_float32(tmp_path, monkeypatch, dtype):
    monkeypatch.setenv("E2E_DTYPE", dtype)
    runs, prompts = _near_tie_runs(tmp_path, dtype)
    res = {c["name"]: c for c in e2e.make_comparisons(tmp_path, runs, prompts, True, False, e2e.TIE_TOL)}
    for p in e2e.PASSES:
        c = res[f"dense 1gpu-vs-pp2 {p}"]
        (m,) = c["mismatches"]
        assert m["near_tie"] and (m["gap_ref"], m["gap_got"]) == (pytest.approx(0.02), pytest.approx(0.03))
        assert c["near_ties"] == 1 and c["identical"] == 2
        # float32: strict without --strict, so the near tie is a failure; bf16 tolerates it.
        assert (c["strict"], c["ok"]) == ((True, False) if dtype == "float32" else (False, True)), c
    assert all(res[f"{r} no-hits-vs-{p}"]["ok"] for r in ("dense-1gpu", "dense-pp2") for p in e2e.HIT_PASSES)


def test_e2e_rejects_an_unknown_dtype(tmp_path, monkeypatch):
    monkeypatch.setenv("E2E_DTYPE", "float16")
    with pytest.raises(ValueError, match="E2E_DTYPE='float16': must be one of bfloat16, float32"):
        e2e.e2e_dtype()
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(GPU_SCRIPTS / "e2e_correctness.py"), str(out), "--dry-run"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "E2E_DTYPE": "float16"})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert errors == ["e2e_correctness.py: error: E2E_DTYPE='float16': must be one of bfloat16, float32"]
    assert not out.exists()


# --- soak: workload, client, statistics, plot ---------------------------------------------------


def test_soak_workload_mixed_and_fits_context():
    w = soak.Workload(seed=0, count=lambda text: len(text.split()), max_model_len=4096)
    reqs = [w.next() for _ in range(300)]
    assert all(r["prompt_tokens"] + r["max_tokens"] <= 4096 - 8 for r in reqs)
    lengths = [r["prompt_tokens"] for r in reqs]
    assert min(lengths) < 64 and max(lengths) > 2000
    assert {r["max_tokens"] for r in reqs} == set(soak.MAX_TOKENS)
    shared = [r for r in reqs if r["shared_prefix"]]
    assert 60 < len(shared) < 140
    assert all(any(r["prompt"].startswith(p) for p in w.prefixes) for r in shared)
    again = soak.Workload(seed=0, count=lambda text: len(text.split()))
    assert [again.next()["prompt"] for _ in range(5)] == [r["prompt"] for r in reqs[:5]]


def _samples():
    # 4 windows of 30 s; the server generates 600, 900, 0 (stall) and 300 tokens per window.
    server = [0, 600, 1500, 1500, 1800]
    return [{"t_s": 30.0 * i, "tokens": server[i] // 2, "requests": 3 * i, "in_flight": 8, "errors": 0,
             "timeouts": 0, "server_tokens": float(server[i])} for i in range(5)]


def test_soak_rates_and_summary():
    win = soak.rates(_samples())
    assert [w["server_tok_s"] for w in win] == [20.0, 30.0, 0.0, 10.0]
    assert [w["client_tok_s"] for w in win] == [10.0, 15.0, 0.0, 5.0]
    assert all(w["requests"] == 3 and w["window_s"] == 30.0 for w in win)
    records = [{"status": "ok", "stream": i % 2 == 0, "shared_prefix": i % 3 == 0, "latency_s": float(i),
                "ttft_s": 0.1 * i if i % 2 == 0 else None, "completion_tokens": 10} for i in range(1, 11)]
    records.append({"status": "timeout", "stream": False, "shared_prefix": False, "latency_s": 120.0})
    s = soak.summarize(records, _samples())
    assert (s["requests"], s["ok"], s["errors"], s["timeouts"], s["streamed"]) == (11, 10, 0, 1, 5)
    assert s["completion_tokens"] == 100 and s["latency_s"]["p50"] == 5.5 and s["latency_s"]["max"] == 10.0
    assert s["tok_s"] == {"mean": 15.0, "min": 0.0, "max": 30.0}
    assert soak.percentile([], 0.5) is None and soak.percentile([4.0], 0.9) == 4.0


def test_soak_records_its_command_without_machine_paths():
    rest = ["--port", "8017", "--pipeline-parallel-size", "2"]
    cli = ["/opt/site/bin/vllm"]
    assert soak.shown_command(cli, [*cli, "serve", "/tmp/x/model", *rest]) == "vllm serve MODEL " + " ".join(rest)
    cli = ["/usr/bin/python3", "-m", "vllm.entrypoints.cli.main"]
    assert soak.shown_command(cli, [*cli, "serve", "/tmp/x/model", *rest]) == (
        "python -m vllm.entrypoints.cli.main serve MODEL " + " ".join(rest))


def test_soak_drain_window_stays_out_of_the_rates():
    """The fourth session's soak: a last 4.9-s window (the drain) at half the rate was the run's
    "min"; it is flagged and left out of the statistics."""
    samples = _samples()
    samples.append({**samples[-1], "t_s": 125.0, "server_tokens": 1825.0, "tokens": 910})
    s = soak.summarize([], samples)
    assert [w["partial"] for w in s["windows"]] == [False] * 4 + [True]
    assert s["tok_s"] == {"mean": 15.0, "min": 0.0, "max": 30.0}  # as without the drain window
    assert s["windows"][-1]["server_tok_s"] == 5.0


def test_soak_reads_the_prefix_cache_counters():
    page = ("# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.\n"
            'vllm:prefix_cache_hits_total{engine="0",model_name="soak"} 300.0\n'
            'vllm:prefix_cache_queries_total{engine="0",model_name="soak"} 1200.0\n'
            'vllm:generation_tokens_total{engine="0",model_name="soak"} 50.0\n')
    got = soak.parse_counters(page)
    assert got == {"server_tokens": 50.0, "prefix_cache_hits": 300.0, "prefix_cache_queries": 1200.0}
    samples = _samples()
    samples[-1].update(prefix_cache_hits=300.0, prefix_cache_queries=1200.0)
    assert soak.summarize([], samples)["prefix_cache_hit_rate"] == 0.25
    assert soak.summarize([], _samples())["prefix_cache_hit_rate"] is None  # counters unread
    assert soak.parse_counters("")["prefix_cache_hits"] is None


def test_soak_report_of_an_interrupted_run_keeps_the_samples(tmp_path):
    """A stage limit that cuts the soak short (seen on GPUs) must still leave soak.json and the
    plot, marked interrupted and not ok."""
    stats = soak.Stats()
    for i in range(3):
        stats.begin()
        stats.end({"status": "ok", "stream": False, "shared_prefix": False, "latency_s": 1.0,
                   "completion_tokens": 16})
    log = tmp_path / "soak_server.log"
    log.write_text("INFO vllm-dualgpu plan: GPUs 1,0 split 4,4\n")
    result = {"ready": True, "interrupted_by": "SIGTERM"}
    soak.report(tmp_path, result, stats, _samples(), True, 8, log)
    data = json.loads((tmp_path / "soak.json").read_text())
    assert data["interrupted_by"] == "SIGTERM" and data["ok"] is False
    assert data["summary"]["ok"] == 3 and len(data["samples"]) == 5
    assert (tmp_path / "soak.png").exists() and data["plugin_lines"]


def _png_pixels(data: bytes):
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    w, h, depth, ctype = struct.unpack(">IIBB", data[16:26])
    pos, idat = 8, b""
    while pos < len(data):
        (n,), tag = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        if tag == b"IDAT":
            idat += data[pos + 8:pos + 8 + n]
        pos += 12 + n
    return w, h, depth, ctype, zlib.decompress(idat)


def test_soak_plot_writes_png(tmp_path):
    path = tmp_path / "soak.png"
    backend = soak.plot(_samples(), path)
    assert backend in ("matplotlib", "stdlib") and path.exists()
    w, h, _, _, _ = _png_pixels(path.read_bytes())
    assert w >= 300 and h >= 150


def test_stdlib_png_draws_the_series(tmp_path):
    path = tmp_path / "line.png"
    soak.write_line_png(path, [0.0, 1.0, 2.0], [[0.0, 10.0, 5.0]], w=200, h=100)
    w, h, depth, ctype, raw = _png_pixels(path.read_bytes())
    assert (w, h, depth, ctype) == (200, 100, 8, 2) and len(raw) == h * (1 + 3 * w)
    rows = [raw[y * (1 + 3 * w) + 1:(y + 1) * (1 + 3 * w)] for y in range(h)]
    blue = [(x, y) for y, r in enumerate(rows) for x in range(w) if tuple(r[3 * x:3 * x + 3]) == (31, 119, 180)]
    assert blue and min(y for _, y in blue) < 40  # the peak (10) is drawn near the top
    assert max(x for x, _ in blue) > 150


def test_soak_plot_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (the stdlib PNG is used)")
    assert soak.plot(_samples(), tmp_path / "m.png") == "matplotlib"
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _FakeServer:
    """A stand-in OpenAI completions server on 127.0.0.1: behaviour per request chosen by `mode`."""

    def __init__(self, mode: str = "ok"):
        self.mode, self.generated, self.lock = mode, 0, threading.Lock()
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                body = (f'# HELP x\nvllm:generation_tokens_total{{model_name="soak"}} {outer.generated}.0\n'
                        f'vllm:prompt_tokens_total{{model_name="soak"}} 5.0\n').encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                n = req["max_tokens"] - (1 if outer.mode == "short" else 0)
                if outer.mode == "slow":
                    time.sleep(1.0)
                with outer.lock:
                    outer.generated += n
                usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
                if not req.get("stream"):
                    body = json.dumps({"choices": [{"text": "x" * n, "finish_reason": "length"}],
                                       "usage": usage}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for i in range(n):
                    ch = {"choices": [{"text": "x", "finish_reason": "length" if i == n - 1 else None}]}
                    self.wfile.write(f"data: {json.dumps(ch)}\n\n".encode())
                self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _small_workload():
    w = soak.Workload(seed=0, count=lambda text: len(text.split()))
    w.next = lambda: {"prompt": "the sun", "prompt_tokens": 2, "max_tokens": 4, "shared_prefix": False}
    return w


def test_soak_client_against_fake_server():
    srv = _FakeServer("ok")
    try:
        stats = soak.Stats()
        with soak.Sampler(stats, srv.base, period=0.2) as sampler:
            soak.drive(srv.base, "soak", _small_workload(), stats, concurrency=4, seconds=0.6, timeout=5)
        s = soak.summarize(stats.records, sampler.samples)
        assert s["requests"] > 8 and s["ok"] == s["requests"] and s["errors"] == s["timeouts"] == 0
        assert abs(s["streamed"] - s["requests"] / 2) <= 4
        assert all(r.get("ttft_s") is not None for r in stats.records if r["stream"])
        assert stats.snapshot()["in_flight"] == 0
        assert len(sampler.samples) >= 3 and sampler.samples[-1]["server_tokens"] == srv.generated
        assert soak.server_counters(srv.base)["server_tokens"] == float(4 * s["requests"])
    finally:
        srv.close()


def test_soak_client_counts_short_outputs_as_errors():
    srv = _FakeServer("short")
    try:
        stats = soak.Stats()
        soak.drive(srv.base, "soak", _small_workload(), stats, concurrency=2, seconds=0.2, timeout=5)
        s = soak.summarize(stats.records, [])
        assert s["requests"] > 0 and s["errors"] == s["requests"] and s["ok"] == 0
        assert "completion_tokens=3 (wanted 4)" in stats.records[0]["error"]
    finally:
        srv.close()


def test_soak_client_counts_timeouts():
    srv = _FakeServer("slow")
    try:
        stats = soak.Stats()
        soak.drive(srv.base, "soak", _small_workload(), stats, concurrency=2, seconds=0.2, timeout=0.4)
        s = soak.summarize(stats.records, [])
        assert s["requests"] >= 2 and s["timeouts"] == s["requests"] and s["errors"] == 0
    finally:
        srv.close()


def test_soak_server_errors_and_unreachable_metrics():
    assert soak.server_counters("http://127.0.0.1:9") == dict.fromkeys(soak.SERVER_COUNTERS)
    rec = soak.one_request("http://127.0.0.1:9", "soak", {"prompt": "x", "prompt_tokens": 1, "max_tokens": 2,
                                                         "shared_prefix": False}, stream=False, timeout=2)
    assert rec["status"] == "error" and ("refused" in rec["error"] or "Connection" in rec["error"]), rec


# --- GPU suite runner ---------------------------------------------------------------------------

SUITE = GPU_SCRIPTS / "run_gpu_suite.sh"


def _suite_env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUALGPU_SUITE")}
    env.update({"STAGING_ENV": "", "PYTHON": sys.executable,
                "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", **extra})
    return env


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_suite_runner_writes_junit_and_kills_what_it_started(tmp_path):
    tests = tmp_path / "fake_tests"
    tests.mkdir()
    pidfile = tmp_path / "pid"
    (tests / "test_fake_gpu.py").write_text(
        "import subprocess, pytest\n"
        "@pytest.mark.gpu\n"
        "def test_leaves_a_process():\n"
        "    p = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
        f"    open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
        "def test_not_gpu():\n"
        "    pass\n")
    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)
    out = tmp_path / "out"
    try:
        r = subprocess.run(["bash", str(SUITE), str(out)], env=_suite_env(tmp_path, DUALGPU_SUITE_TESTS=str(tests)),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        summary = json.loads((out / "gpu-suite-summary.json").read_text())
        assert (summary["tests"], summary["passed"]) == (1, 1)  # -m gpu deselects test_not_gpu
        assert "test_leaves_a_process" in (out / "gpu-junit.xml").read_text()
        assert "1 passed, 0 failed" in r.stdout
        leftover = int(pidfile.read_text())
        end = time.time() + 5
        while _alive(leftover) and time.time() < end:
            time.sleep(0.1)
        assert not _alive(leftover), "the suite runner left the test's process running"
        assert _alive(bystander.pid), "the suite runner killed a process it did not start"
    finally:
        os.killpg(bystander.pid, signal.SIGKILL)
        bystander.wait()


def test_suite_runner_fails_when_no_gpu_test_ran(tmp_path):
    tests = tmp_path / "fake_tests"
    tests.mkdir()
    (tests / "test_skipped.py").write_text(
        "import pytest\n@pytest.mark.gpu\n@pytest.mark.skip(reason='no GPU here')\ndef test_x():\n    pass\n")
    r = subprocess.run(["bash", str(SUITE), str(tmp_path / "out")], env=_suite_env(tmp_path, DUALGPU_SUITE_TESTS=str(tests)),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "no GPU test ran" in r.stdout
    assert json.loads((tmp_path / "out" / "gpu-suite-summary.json").read_text())["skipped"] == 1


def test_suite_runner_needs_pytest(tmp_path):
    fake = tmp_path / "python-without-site"
    fake.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    fake.chmod(0o755)
    r = subprocess.run(["bash", str(SUITE), str(tmp_path / "out")], env=_suite_env(tmp_path, PYTHON=str(fake)),
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 4:  # pytest in the interpreter's own stdlib path: nothing to check here
        pytest.skip("pytest importable without site-packages")
    assert "pytest is not importable" in r.stderr


def test_session_stages_exist():
    text = (GPU_SCRIPTS / "session.sh").read_text()
    for stage, script in (("e2e", "e2e_correctness.py"), ("soak", "soak.py"), ("suite", "run_gpu_suite.sh"),
                          ("embedq", "embed_quant_pp.py")):
        assert f"[{stage}]=" in text and script in text
        assert (GPU_SCRIPTS / script).exists()
    assert subprocess.run(["bash", "-n", str(SUITE)]).returncode == 0


# --- the e2e harness end to end, with a stand-in vLLM ---------------------------------------------

FAKE_VLLM = '''
"""A stand-in for vllm.LLM: deterministic greedy outputs from the prompt, a block prefix cache."""
import os
from types import SimpleNamespace as NS

class SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)

class LLM:
    def __init__(self, **kw):
        self.kw, self.blocks, self.drafts = kw, set(), 0
        self.llm_engine = NS(vllm_config=NS(cache_config=NS(block_size=16, num_gpu_blocks=99, mamba_cache_mode=None),
                                            scheduler_config=NS(async_scheduling=False)))
        self.diverge = (os.environ.get("FAKE_DIVERGE") == "pp2-mtp" and kw.get("pipeline_parallel_size") == 2
                        and kw.get("speculative_config"))

    def reset_prefix_cache(self):
        self.blocks.clear()
        return True

    def get_metrics(self):
        return [NS(name="vllm:spec_decode_num_draft_tokens", value=self.drafts),
                NS(name="vllm:spec_decode_num_drafts", value=self.drafts // 2)]

    def generate(self, inputs, params, use_tqdm=False):
        params = params if isinstance(params, list) else [params] * len(inputs)
        outs = []
        for i, (inp, sp) in enumerate(zip(inputs, params)):
            ids = inp["prompt_token_ids"]
            full = [tuple(ids[:k]) for k in range(16, len(ids) + 1, 16)]
            hit = 0 if (sp.__dict__.get("skip_reading_prefix_cache") or not self.kw.get("enable_prefix_caching", True)) \\
                else max([len(b) for b in full if b in self.blocks] + [0])
            self.blocks.update(full)
            toks = [(sum(ids) * 31 + 7 * j) % 4093 + 3 for j in range(sp.max_tokens)]
            if self.diverge and i == 5 and len(toks) > 3:
                toks[3] += 1
            if self.kw.get("speculative_config"):
                self.drafts += 2 * len(toks)
            lps = [{t: NS(logprob=-0.5), t + 1: NS(logprob=-2.5)} for t in toks] if getattr(sp, "logprobs", None) else None
            outs.append(NS(outputs=[NS(token_ids=toks, logprobs=lps)], num_cached_tokens=hit))
        return outs
'''


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    pkg = tmp_path / "fakevllm" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    monkeypatch.setenv("PYTHONPATH", str(pkg.parent))
    monkeypatch.delenv("VLLM_TARGET_DEVICE")  # as tests/e2e starts the script: its children refuse it
    monkeypatch.setattr(e2e, "ballast", lambda free, logdir: __import__("contextlib").nullcontext())
    out = tmp_path / "out"
    for preset, mtp in (("small-dense", False), ("small-hybrid", True)):
        d = out / "models" / preset
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps(make_model.PRESETS[preset]()))
        header = json.dumps({"mtp.fc.weight" if mtp else "x": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]}})
        (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode() + b"\0\0")
    return out


def test_e2e_harness_end_to_end_with_a_stand_in_engine(fake_vllm, monkeypatch):
    monkeypatch.delenv("FAKE_DIVERGE", raising=False)
    monkeypatch.setenv("E2E_BATCH_INVARIANT", "1")  # opt-in: dense runs then compare strictly
    rc = e2e.main([str(fake_vllm), "--quick", "--run-timeout", "60"])
    report = json.loads((fake_vllm / "e2e_correctness.json").read_text())
    bad = [(c["name"], c.get("reason")) for c in report["comparisons"] if not c["ok"]]
    assert rc == 0 and report["ok"] and not bad, bad
    assert set(report["runs"]) == {"dense-1gpu", "hybrid-mtp-1gpu", "dense-pp2", "hybrid-mtp-pp2"}
    assert report["runs"]["dense-1gpu"]["env"]["VLLM_BATCH_INVARIANT"] == "1"
    assert report["runs"]["hybrid-mtp-pp2"]["engine"]["distributed_executor_backend"] == "dualgpu"
    hits = report["runs"]["dense-pp2"]["passes"]
    assert not any(hits["no-hits"]["num_cached_tokens"]) and any(hits["prefix-hits"]["num_cached_tokens"])


def test_e2e_harness_fails_on_a_divergence(fake_vllm, monkeypatch):
    monkeypatch.setenv("FAKE_DIVERGE", "pp2-mtp")
    rc = e2e.main([str(fake_vllm), "--quick", "--run-timeout", "60"])
    report = json.loads((fake_vllm / "e2e_correctness.json").read_text())
    failed = {c["name"]: c for c in report["comparisons"] if not c["ok"]}
    assert rc == 1 and not report["ok"]
    assert set(failed) == {f"hybrid-mtp 1gpu-vs-pp2 {p}" for p in e2e.PASSES}
    m = failed["hybrid-mtp 1gpu-vs-pp2 no-hits"]["mismatches"][0]
    assert (m["prompt"], m["first_diff"], m["near_tie"]) == (5, 3, False)


# --- soak end to end, with a stand-in `vllm serve` ------------------------------------------------

FAKE_VLLM_CLI = r'''#!PYTHON
"""Stand-in for `vllm serve MODEL ... --port N`: an OpenAI completions server on 127.0.0.1."""
import json, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
open(sys.argv[0] + ".args", "w").write(json.dumps(argv))
generated = [0]
lock = threading.Lock()

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        body = f"vllm:generation_tokens_total{{model_name=\"soak\"}} {generated[0]}.0\n".encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = req["max_tokens"]
        with lock:
            generated[0] += n
        usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
        if req.get("stream"):
            self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
            self.wfile.write(("data: " + json.dumps({"choices": [{"text": "x", "finish_reason": "length"}]}) + "\n\n").encode())
            self.wfile.write(("data: " + json.dumps({"choices": [], "usage": usage}) + "\n\ndata: [DONE]\n\n").encode())
        else:
            body = json.dumps({"choices": [{"text": "x", "finish_reason": "length"}], "usage": usage}).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
            self.wfile.write(body)

srv = ThreadingHTTPServer(("127.0.0.1", port), H)
print("INFO vllm-dualgpu 0.1.0 (frontend, vLLM 0.30.0): applied stand-in", flush=True)
print("INFO:     Application startup complete.", flush=True)
srv.serve_forever()
'''


def test_soak_end_to_end_with_a_stand_in_server(tmp_path, monkeypatch):
    import socket

    import gpurun

    bindir = tmp_path / "bin"
    bindir.mkdir()
    cli = bindir / "vllm"
    cli.write_text(FAKE_VLLM_CLI.replace("#!PYTHON", "#!" + sys.executable))
    cli.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(gpurun, "ballast", lambda free, logdir: __import__("contextlib").nullcontext())
    out = tmp_path / "soak"
    model = out / "models" / "small-hybrid"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(make_model.PRESETS["small-hybrid"]()))
    header = json.dumps({"mtp.fc.weight": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]}})
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode() + b"\0\0")
    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = soak.main([str(out), "--minutes", "0.02", "--concurrency", "3", "--sample-s", "0.4",
                    "--request-timeout", "5", "--port", str(port)])
    result = json.loads((out / "soak.json").read_text())
    assert rc == 0 and result["ok"], result
    args = json.loads((cli.parent / "vllm.args").read_text())
    assert args[:2] == ["serve", str(model)] and "--speculative-config" in args
    assert args[args.index("--distributed-executor-backend") + 1] == "dualgpu"
    assert args[args.index("--host") + 1] == "127.0.0.1"
    assert result["config"]["mtp"] and result["summary"]["requests"] > 0 and result["summary"]["errors"] == 0
    assert len(result["samples"]) >= 2 and (out / "soak.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(OSError):  # the server's process group is gone: its port is free again
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_serve_smoke_finds_the_plugin_line_of_every_process(tmp_path):
    """The log lines as vLLM 0.30 prints them (front end unprefixed, others with a pid)."""
    import serve_smoke  # GPU_SCRIPTS is on sys.path (top of this module)

    log = tmp_path / "serve.log"
    v = "vllm-dualgpu 0.1.0"
    log.write_text("\n".join([
        f"INFO 11-30 11:13:30 [plugin.py:86] {v} (frontend, vLLM 0.30.0): applied executor-by-name; skipped none",
        f"(EngineCore pid=3754) INFO 11-30 11:13:32 [plugin.py:86] {v} (engine, vLLM 0.30.0): applied pp-inflight-batches; skipped none",
        f"(Worker pid=3776) INFO 11-30 11:13:33 [plugin.py:86] {v} (worker, vLLM 0.30.0): applied fp8-configs-per-rank; skipped none",
        "(Worker_PP1 pid=3777) INFO 11-30 11:13:38 [model_runner.py:428] Model loading took 10.52 GiB memory",
    ]) + "\n")
    got = serve_smoke.summarize_log(log)
    assert got["plugin_line_per_process"] == {"frontend": True, "engine": True, "two workers": False}
    with log.open("a") as f:
        f.write(f"(Worker pid=3777) INFO 11-30 11:13:33 [plugin.py:86] {v} (worker, vLLM 0.30.0): applied x; skipped none\n")
    assert serve_smoke.summarize_log(log)["plugin_line_per_process"]["two workers"] is True
    # Spawned workers log the plugin line before vLLM's "(Worker pid=...)" prefix exists: the
    # line's own pid tells them apart (as in the 2026-11-30 `vllm serve` log).
    log.write_text("\n".join([
        f"INFO 11-30 12:38:46 [plugin.py:86] {v} (frontend, pid 1200, vLLM 0.30.0): applied a; skipped none",
        f"(EngineCore pid=4297) INFO 11-30 12:39:08 [plugin.py:86] {v} (engine, pid 4297, vLLM 0.30.0): applied b; skipped none",
        f"INFO 11-30 12:39:29 [plugin.py:86] {v} (worker, pid 4424, vLLM 0.30.0): applied c; skipped none",
    ]) + "\n")
    assert serve_smoke.summarize_log(log)["plugin_line_per_process"]["two workers"] is False
    with log.open("a") as f:
        f.write(f"INFO 11-30 12:39:30 [plugin.py:86] {v} (worker, pid 4425, vLLM 0.30.0): applied c; skipped none\n")
    assert serve_smoke.summarize_log(log)["plugin_line_per_process"] == {
        "frontend": True, "engine": True, "two workers": True}


def test_bench_memory_table_compares_prediction_with_measurement():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "gpu"))
    import bench_memory

    runs = [
        {"name": "stock_u0.10", "booted": True, "kv_tokens": 37376, "peak_used_gib": [1.0, 2.0], "wall_s": 43.3},
        {"name": "dualgpu", "booted": True, "kv_tokens": 133968, "peak_used_gib": [31.99, 14.46], "wall_s": 245.6,
         "boot_s": 120.5, "block_size": 16, "plan": {"partition": [10, 30], "num_blocks": 8570},
         "rank_lines": ["(Worker_PP1 pid=1) INFO 11-30 [worker.py:150] vllm-dualgpu rank 1/2: used: 30.5 GiB"]},
    ]
    md = bench_memory.table(runs)
    # 8,570 blocks x 16 = 137,120 predicted vs 133,968 measured: +2.4%.
    assert "| dualgpu | 10/30 | yes | 133,968 | 137,120 | +2.4% | 120.5 |" in md
    assert "| stock_u0.10 | even | yes | 37,376 | - | - | - |" in md
    assert "    vllm-dualgpu rank 1/2: used: 30.5 GiB" in md


def test_gpu_children_refuse_the_cpu_platform(tmp_path, monkeypatch):
    """conftest's VLLM_TARGET_DEVICE=cpu reaching a real GPU child is said at once, not as a
    failed engine start-up deep in vLLM (seen on the GPU host: the suite's e2e runs all failed)."""
    import gpurun

    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    with pytest.raises(RuntimeError, match="VLLM_TARGET_DEVICE=cpu is set"):
        gpurun.require_cuda_platform()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"result_path": str(tmp_path / "result.json"), "engine": {}}))
    subprocess.run([sys.executable, str(GPU_SCRIPTS / "e2e_correctness.py"), "--child", str(spec)],
                   check=True, timeout=120, capture_output=True)  # the child reports in its result
    assert "VLLM_TARGET_DEVICE=cpu is set" in json.loads((tmp_path / "result.json").read_text())["error"]
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cuda")
    gpurun.require_cuda_platform()


def test_gpu_suite_e2e_runs_without_the_cpu_platform(monkeypatch):
    """tests/e2e starts its GPU script without the VLLM_TARGET_DEVICE that conftest sets."""
    from e2e.test_correctness import script_env

    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    monkeypatch.setenv("E2E_DTYPE", "float32")
    env = script_env()
    assert "VLLM_TARGET_DEVICE" not in env and env["E2E_DTYPE"] == "float32"
