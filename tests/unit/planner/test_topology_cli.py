"""``vllm-dualgpu plan`` for a box or a fleet: ``;`` hosts, the fleet file, JSON, exit codes."""

from __future__ import annotations

import json

import pytest

from vllm_dualgpu.cli import main

TINY = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
    "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("VLLM_DUALGPU_RESERVE", "0")
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)


@pytest.fixture()
def tiny(tmp_path):
    d = tmp_path / "tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY))
    return str(d)


def run_cli(capsys, *argv):
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_semicolon_hosts_select_the_fleet_plan(capsys, tiny):
    rc, out, err = run_cli(capsys, tiny, "--gpus", "A:4GiB:bw=100,A:4GiB:bw=100;B:6GiB:bw=200", "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert [h["name"] for h in d["fleet"]["hosts"]] == ["host1", "host2"]
    assert [len(h["gpus"]) for h in d["fleet"]["hosts"]] == [2, 1]
    ids = [t["id"] for t in d["topologies"]]
    assert ids[:3] == ["host-tp1", "group-tp1", "fleet-tp1"] and "host-tp2" in ids
    assert d["recommended"] in ids and d["reason"].startswith(d["recommended"])
    assert d["request"]["max_model_len"] == -1  # context: the largest that fits, unless asked


def test_named_hosts_and_the_plain_plan_is_untouched(capsys, tiny):
    rc, out, err = run_cli(capsys, tiny, "--gpus", "box1=A:4GiB:bw=100,A:4GiB:bw=100", "--json", "--max-model-len", "2048")
    assert rc == 0, err
    d = json.loads(out)
    assert [h["name"] for h in d["fleet"]["hosts"]] == ["box1"]
    assert all(r["max_model_len"] == 2048 for t in d["topologies"] if t["fits"] for r in t["replicas"] if r["fits"])
    rc, out, err = run_cli(capsys, tiny, "--gpus", "A:4GiB:bw=100,A:4GiB:bw=100")  # no ';', no name: one pipeline
    assert rc == 0 and "Stock vLLM, as 0.30.0 sizes it" in out and "Route weights" not in out


def test_the_bundled_example_prints_topologies_side_by_side_and_seed_weights(capsys):
    rc, out, err = run_cli(capsys, "--fleet", "example")
    assert rc == 0, err
    header = next(line for line in out.splitlines() if "host-tp1" in line and "fleet-tp2" in line)
    assert header.split() == ["host-tp1", "fleet-tp1", "host-tp2", "fleet-tp2"]  # the ones that fit
    assert "group-tp1: one replica per card - does not fit" in out
    assert "Recommended: " in out
    # the example carries the seed's measured concurrency-8 rates, 244 and 177 tokens/s
    assert "Route weights for host-tp2 (measured): box1 58, box2 42" in out
    assert "vllm-router --service-discovery static --static-backends http://box1:8000,http://box2:8000" in out


def test_a_fleet_file(capsys, tmp_path, tiny):
    f = tmp_path / "fleet.json"
    f.write_text(json.dumps({
        "hosts": [{"name": "a", "gpus": ["A:4GiB:bw=100", "A:4GiB:bw=100"]}, {"name": "b", "gpus": "A:4GiB:bw=50"}],
        "model": {"path": tiny}, "serve": {"max_model_len": 1024, "max_num_seqs": 4},
        "tp_sizes": [1], "link": {"network_gbits_per_s": 25}, "prefer": "latency",
    }))
    rc, out, err = run_cli(capsys, "--fleet", str(f), "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert [t["id"] for t in d["topologies"]] == ["host-tp1", "group-tp1", "fleet-tp1"]
    assert d["link"]["network_gbits_per_s"] == 25.0 and d["prefer"] == "latency"
    assert all(r["batch"] <= 4 for t in d["topologies"] for r in t["replicas"])
    assert d["routes"]["group-tp1"]["gpustack"]["body"]["name"] == "tiny"


def test_a_measured_file_gives_the_weights(capsys, tmp_path, tiny):
    m = tmp_path / "measured.json"
    m.write_text(json.dumps({"a": 300, "b": 100}))
    rc, out, err = run_cli(capsys, tiny, "--gpus", "a=A:4GiB:bw=100;b=A:4GiB:bw=100", "--measured", str(m),
                           "--topology", "host-tp1", "--json")
    assert rc == 0, err
    assert json.loads(out)["routes"]["host-tp1"]["weights"] == {"a": 75, "b": 25}


def test_mixed_tp_group_asked_for_exits_1_with_the_reason(capsys, tiny):
    rc, out, err = run_cli(capsys, tiny, "--gpus", "box=A:8GiB:bw=200,B:4GiB:bw=100;", "-tp", "2")
    assert rc == 1
    assert "mixed TP group" in err and "nothing fits" in err


def test_nothing_fits_exits_1_and_says_what_fits(capsys, tiny):
    # 32 blocks of 16 tokens, one the null block: 496 tokens, not 4,096
    rc, out, err = run_cli(capsys, tiny, "--gpus", "a=A:4GiB:bw=100", "--num-gpu-blocks-override", "32",
                           "--max-model-len", "4096")
    assert rc == 1 and "the largest --max-model-len that fits: 496 on host-tp1 (a)" in err
    rc, out, err = run_cli(capsys, tiny, "--gpus", "a=A:4GiB:bw=100", "--layer-partition", "2,2")
    assert rc == 2 and "not planned per topology" in err
    rc, out, err = run_cli(capsys, tiny, "--gpus", "a=A:1GiB:bw=100;b=A:1GiB:bw=100")
    assert rc == 1 and "nothing fits" in err and "no topology fits even one request" in err
    rc, out, err = run_cli(capsys, tiny, "--gpus", "a=A:1GiB:bw=100;b=A:1GiB:bw=100", "--json")
    assert rc == 1 and json.loads(out)["error"] == "nothing fits"


@pytest.mark.parametrize(
    "argv",
    [
        ["--gpus", "a=Mystery,Mystery;b=A:4GiB"],  # unknown card without a size
        ["--gpus", "a=A:4GiB;a=A:4GiB"],  # a host twice
        ["--gpus", "a=A:4GiB;b=A:4GiB", "--fleet", "example"],
        ["--gpus", "a=A:4GiB;b=A:4GiB", "--tp-sizes", "x"],
        ["--gpus", "a=A:4GiB;b=A:4GiB", "--topology", "nope"],
        ["--fleet", "/nonexistent/fleet.json"],
    ],
)
def test_bad_arguments_exit_2(capsys, tiny, argv):
    rc, out, err = run_cli(capsys, tiny, *argv)
    assert rc == 2 and err.startswith("vllm-dualgpu plan: ") and "Traceback" not in err


@pytest.mark.parametrize(
    "doc",
    [
        {"hosts": [{"gpus": "A:4GiB"}], "colour": "red"},  # unknown key
        {"hosts": []},
        {"hosts": [{"gpus": "A:4GiB"}], "serve": {"pp_size": 2}},  # the topology decides PP
        {"hosts": [{"gpus": "A:4GiB"}], "measured": {"host1": -3}},
        {"hosts": [{"gpus": "A:4GiB"}], "link": {"wifi": 1}},
        [1, 2],
    ],
)
def test_bad_fleet_files_exit_2(capsys, tmp_path, tiny, doc):
    f = tmp_path / "fleet.json"
    f.write_text(json.dumps(doc))
    rc, out, err = run_cli(capsys, tiny, "--fleet", str(f))
    assert rc == 2 and err.startswith("vllm-dualgpu plan: ")
    f.write_text("{not json")
    assert run_cli(capsys, tiny, "--fleet", str(f))[0] == 2


def test_fleet_planning_imports_nothing_heavy(tmp_path):
    import os
    import subprocess
    import sys

    code = (
        "import io, contextlib, json, sys\n"
        "from vllm_dualgpu.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    rc = main(['plan', '--fleet', 'example', '--json'])\n"
        "print(json.dumps({'rc': rc, 'heavy': sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch', 'pynvml'))}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PP_LAYER_PARTITION"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"rc": 0, "heavy": []}
