"""scripts/gpu/vision_pp.py: the CPU dry run, and the checks applied to a GPU run's facts.

The dry run imports vLLM (and, without torchvision, stubs it): it runs in a subprocess, once per
module, so nothing leaks into the other tests."""

from __future__ import annotations

import json

import pytest

from conftest import gpu_script_dry_run, load_gpu_script

@pytest.fixture(scope="module")
def script():
    return load_gpu_script("vision_pp")


@pytest.fixture(scope="module")
def dry_run_dir(tmp_path_factory):
    return gpu_script_dry_run("vision_pp", tmp_path_factory.mktemp("vision-dry-run"), timeout=90)


@pytest.mark.slow
def test_dry_run_builds_both_engine_configs(dry_run_dir, script):
    result = json.loads((dry_run_dir / "vision_pp.json").read_text())
    assert result["ok"] and all(result["checks"].values())
    dual, stock = result["engine"]["dualgpu"], result["engine"]["stock"]
    assert dual["executor"] == "DualGpuExecutor" and stock["executor"] == "mp"
    assert dual["model_class"] == "Qwen3_5ForConditionalGeneration" and dual["image_limit"] == 1
    cfg = json.loads((dry_run_dir / "model" / "config.json").read_text())
    assert cfg["text_config"]["num_hidden_layers"] == 8 and cfg["vision_config"]["depth"] == 2
    assert cfg["vision_config"]["out_hidden_size"] == cfg["text_config"]["hidden_size"]
    assert max(cfg[k] for k in script.TOKEN_KEYS) < cfg["text_config"]["vocab_size"]
    assert all(max(p) < min(cfg[k] for k in script.TOKEN_KEYS) for p in script.prompts())
    for name in ("preprocessor_config.json", "video_preprocessor_config.json", "tokenizer.json"):
        assert (dry_run_dir / "model" / name).exists()
    if not result["torchvision"]:  # the processor sub-checks say why they did not run
        assert "skipped" in result["processor"] and "skipped" in result["profiling_inputs"]
    else:
        assert result["profiling_inputs"]["items"] > 0


LINE = ("(VllmWorker pid=7) INFO x [plugin.py:112] vllm-dualgpu 0.1.0 (worker, pid {pid}, vLLM 0.30.0): "
        "applied pp-inflight-batches, {patches}; skipped {skipped}")


def good_run(script) -> dict:
    def worker(rank, vision):
        return {"pp_rank": rank, "use_v2_model_runner": True, "vision_bytes": vision, "vision_params": 3 if vision else 0,
                "visual_class": "x.StageMissingLayer" if not vision else "x.Qwen3_VisionTransformer", "allocated": 1}

    return {
        "child": {"outputs": [[1]] * len(script.prompts()), "workers": [worker(1, 0), worker(0, 4096)]},
        "plugin_lines": [LINE.format(pid=p, patches=script.PATCH, skipped="none") for p in (11, 12)]
        + ["vllm-dualgpu 0.1.0 (engine, pid 9, vLLM 0.30.0): applied pp-inflight-batches; skipped none"],
    }


def test_checks_pass_on_a_good_run(script):
    assert all(script.checks(good_run(script)).values())


@pytest.mark.parametrize(
    "breakage, failed",
    [
        (lambda r: r["child"]["workers"][0].update(vision_bytes=8, vision_params=1), "rank 1 holds no vision weights"),
        (lambda r: r["child"]["workers"][1].update(vision_bytes=0), "rank 0 holds vision weights"),
        (lambda r: r["child"].update(error="RuntimeError: boom"), "booted and generated"),
        (lambda r: r["child"]["workers"][0].update(use_v2_model_runner=False), "two ranks probed on the V2 runner"),
        (lambda r: r["child"]["workers"].pop(), "two ranks probed on the V2 runner"),
        (lambda r: r["plugin_lines"].__setitem__(1, LINE.format(pid=12, patches="x", skipped="none")),
         "workers applied vision-tower-first-rank-only"),
        (lambda r: r["plugin_lines"].__setitem__(
            1, LINE.format(pid=12, patches="x", skipped="vision-tower-first-rank-only (target moved)")),
         "workers applied vision-tower-first-rank-only"),
        (lambda r: r.update(child=None), "booted and generated"),
    ],
)
def test_checks_fail_on_a_bad_run(script, breakage, failed):
    run = good_run(script)
    breakage(run)
    assert [k for k, v in script.checks(run).items() if not v] == [failed] or not script.checks(run)[failed]


def test_applied_names_ignores_skipped(script):
    line = LINE.format(pid=1, patches="a (note)", skipped="b (why); c (why)")
    assert script.applied_names(line) == ["pp-inflight-batches", "a"]
    assert script.applied_names("vllm-dualgpu 0.1.0 (worker, pid 1, vLLM 0.30.0): inactive") == []
