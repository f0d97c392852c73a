"""``vllm-dualgpu plan`` as a new user meets it (issue 25, items 3-5): serve lines that start as
printed, advice that fits what was given, status words and pool figures that agree."""

from __future__ import annotations

import json
import re
import shlex
import sys

import pytest

from vllm_dualgpu.cli import main
from vllm_dualgpu.planner import reference_config
from vllm_dualgpu.planner.errors import ContextTooLong, ModelDoesNotFit

PAIR = "RTX 5090,RTX 4070 Ti SUPER"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("VLLM_PP_LAYER_PARTITION", "VLLM_DUALGPU_OBJECTIVE", "VLLM_DUALGPU_RESERVE",
                "VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def model_dir(tmp_path):
    cfg = reference_config()
    cfg.pop("_vllm_dualgpu")
    d = tmp_path / "Qwen3.8-27B-FP8"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def plan(capsys, *argv):
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


# --- item 3: the serve line -------------------------------------------------------------------

USERS_FLAGS = ["--served-model-name", "qwen3.8-27b", "--port", "8888", "--host", "0.0.0.0",
               "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder", "--reasoning-parser", "qwen3",
               "--mm-processor-kwargs", '{"max_pixels": 4194304}', "--enable-prefix-caching",
               "--trust-remote-code", "--chat-template", "sharp.jinja"]


def test_the_serve_line_keeps_the_users_flags_and_model(capsys, model_dir):
    rc, out, err = plan(capsys, model_dir, "--gpus", PAIR, "--kv-cache-dtype", "fp8", "--max-model-len", "65536",
                        *USERS_FLAGS, "--json")
    assert rc == 0, err
    words = shlex.split(json.loads(out)["command"])
    assert words[:3] == ["vllm", "serve", model_dir]
    for flag, value in zip(USERS_FLAGS, USERS_FLAGS[1:] + [None]):
        if not flag.startswith("--"):
            continue
        assert flag in words, flag
        if value is not None and not value.startswith("--"):
            assert words[words.index(flag) + 1] == value, flag


def test_the_reference_serve_line_says_what_to_put_for_model(capsys):
    rc, out, err = plan(capsys, "--gpus", PAIR)
    assert rc == 0, err
    serve = out.split("Serve it with the dualgpu executor")[1].splitlines()
    assert serve[1].strip().startswith("vllm serve MODEL ")
    assert "MODEL: put your checkpoint's folder there" in serve[2]


def test_model_fed_back_says_what_it_stands_for(capsys):
    rc, _, err = plan(capsys, "MODEL", "--gpus", PAIR)
    assert rc == 2
    assert "MODEL stands for your checkpoint's folder" in err


def test_a_request_that_does_not_fit_prints_the_serve_line_that_does(capsys, model_dir):
    args = [model_dir, "--gpus", PAIR, "--kv-cache-dtype", "auto", "--max-model-len", "262144", "--port", "8888"]
    rc, out, err = plan(capsys, *args, "--json")
    assert rc == 1
    refusal = json.loads(out)
    largest = refusal["largest_fitting_max_model_len"]
    assert 0 < largest < 262144
    words = shlex.split(refusal["command"])
    assert words[words.index("--max-model-len") + 1] == str(largest) and "--port" in words
    rc, out, err = plan(capsys, *words[2:], "--gpus", PAIR)  # that line, fed back, fits
    assert rc == 0, err
    rc, out, err = plan(capsys, *args)
    assert rc == 1
    assert f"Serve it at --max-model-len {largest:,}, the largest that fits:" in err
    assert f"  {refusal['command']}" in err.splitlines()


def test_fleet_serve_lines_carry_the_planned_length(capsys):
    rc, out, err = plan(capsys, "--fleet", "example")
    assert rc == 0, err
    lines = [line for line in out.splitlines() if "serve:" in line and "vllm serve" in line]
    assert len(lines) == 5, lines  # host-tp1 x 2, fleet-tp1, host-tp2 x 2
    for line in lines:
        assert re.search(r"--max-model-len \d+", line), line


# --- item 4: advice that fits the input --------------------------------------------------------

def test_no_fp8_advice_when_fp8_kv_is_given():
    assert "--kv-cache-dtype fp8" in str(ContextTooLong(1000, 2000, kv_cache_dtype="auto"))
    assert "--kv-cache-dtype fp8" not in str(ContextTooLong(1000, 2000, kv_cache_dtype="fp8"))
    assert "--kv-cache-dtype fp8" not in str(ModelDoesNotFit(0, "RTX 5080", 1 << 30, kv_cache_dtype="fp8_e4m3"))


def test_no_fp8_advice_from_plan_when_fp8_kv_is_given(capsys, model_dir):
    rc, _, err = plan(capsys, model_dir, "--gpus", PAIR, "--kv-cache-dtype", "fp8", "--max-model-len", "262144",
                      "--gpu-order", "0,1", "--layer-partition", "32,32")
    assert rc == 1
    first = err.splitlines()[0]
    assert "does not fit" in first and "--kv-cache-dtype fp8" not in first


def test_a_single_card_is_not_called_a_split(capsys):
    assert "split that comes closest" not in str(ModelDoesNotFit(0, "RTX 5080", 1 << 30))
    assert "split that comes closest" not in str(ModelDoesNotFit(0, "RTX 5080", 1 << 30, partition=[64]))
    assert "split that comes closest" in str(ModelDoesNotFit(1, "RTX 5080", 1 << 30, partition=[30, 34]))
    rc, out, err = plan(capsys, "--fleet", "example")  # group-tp1: one card a replica, none fits
    single = [line for line in out.splitlines() if re.match(r"\s+box\d:\d: the model does not fit", line)]
    assert len(single) == 4 and not any("split" in line for line in single), single


def test_a_typo_in_a_card_name_gets_the_close_known_names_first(capsys):
    rc, _, err = plan(capsys, "--gpus", "RTX 5900,RTX 4070 Ti SUPER")
    assert rc == 2
    assert "did you mean 'RTX 5090'" in err
    assert err.index("did you mean") < err.index("'RTX 5900:24GiB'")
    rc, _, err = plan(capsys, "--gpus", "Radeon 7900 XTX")  # nothing close: only the by-hand form
    assert rc == 2 and "did you mean" not in err and "'Radeon 7900 XTX:24GiB'" in err


def test_a_semicolon_for_a_comma_says_it_plans_machines(capsys):
    rc, out, err = plan(capsys, "--gpus", "RTX 5090;RTX 4070 Ti SUPER")
    note = [line for line in out.splitlines() if line.startswith("Note: ';' in --gpus separates machines")]
    assert note and "2 hosts" in note[0] and f"--gpus '{PAIR}'" in note[0], out[:600]
    rc, out, err = plan(capsys, "--gpus", "box1=RTX 5090;box2=RTX 4070 Ti SUPER")  # named: meant as hosts
    assert "separates machines" not in out


def test_a_negative_reserve_is_called_negative(capsys, monkeypatch):
    monkeypatch.setenv("VLLM_DUALGPU_RESERVE", "-1GiB")
    rc, _, err = plan(capsys, "--gpus", PAIR)
    assert rc == 2
    assert "VLLM_DUALGPU_RESERVE: '-1GiB' is negative" in err


def test_gpus_local_without_nvml_says_how_to_name_the_cards(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails: no NVML here
    rc, _, err = plan(capsys, "--gpus", "local")
    assert rc == 2
    assert "--gpus local: cannot read GPUs through NVML" in err
    assert "name the cards instead" in err and "--gpus 'RTX 5090,RTX 4070 Ti SUPER'" in err


# --- item 5: status words and pool figures -----------------------------------------------------

def test_the_fleet_recommends_what_runs_and_marks_the_rest(capsys):
    # 16 sequences (the example file says 8): the cross-host TP 2 x PP 2 pipeline's pool batches
    # more than a host's TP-2 pair holds, so the fastest prediction is a topology that does not
    # run yet. At 8 the host pairs come close enough that the example's fastest runs today.
    seqs = ("--max-num-seqs", "16")
    rc, out, err = plan(capsys, "--fleet", "example", *seqs, "--json")
    assert rc == 0, err
    d = json.loads(out)
    tops = {t["id"]: t for t in d["topologies"]}
    assert tops[d["recommended"]]["runs_today"] is True
    assert tops["fleet-tp1"]["status"] == "CPU-tested" and tops["fleet-tp2"]["status"] == "not yet"
    faster = max((t for t in tops.values() if t["fits"]), key=lambda t: t["tokens_per_s"] or 0)
    assert not faster["runs_today"]  # the example's fastest does not run yet: named, not recommended
    assert f"{faster['id']} predicts more" in d["reason"] and "does not run yet" in d["reason"]
    rc, out, err = plan(capsys, "--fleet", "example", *seqs)
    row = next(line for line in out.splitlines() if line.startswith("runs today"))
    assert row.split()[2:] == ["yes", "CPU-tested", "yes", "not", "yet"]


def test_the_stock_line_names_the_release_it_models(capsys, monkeypatch):
    import vllm_dualgpu.support as support

    monkeypatch.setattr(support, "installed_vllm_version", lambda: "0.33.0")
    rc, out, err = plan(capsys, "--gpus", PAIR)
    assert rc == 0, err
    stock = next(line for line in out.splitlines() if line.startswith("Stock vLLM"))
    assert stock.startswith("Stock vLLM, as 0.30.0 sizes it; vLLM 0.33.0 is installed (")


def test_the_three_pool_figures_say_what_they_count(capsys):
    rc, out, err = plan(capsys, "--gpus", PAIR)
    assert rc == 0, err
    pool = next(line for line in out.splitlines() if line.startswith("KV pool:"))
    m = re.match(r"KV pool: ([\d,]+) blocks x ([\d,]+) tokens \(([\d,]+) token slots\); one request can hold up "
                 r"to ([\d,]+) tokens.*one block is vLLM's null block, and a request takes (\d+) more", pool)
    assert m, pool
    blocks, size, slots, one, state = (int(g.replace(",", "")) for g in m.groups())
    assert slots == blocks * size
    assert (blocks - 1 - state) * size == one  # what the explanation says adds up
    reported = next(line for line in out.splitlines() if "vLLM reports a KV cache of" in line)
    m = re.search(r"--max-model-len ([\d,]+): vLLM reports a KV cache of ([\d,]+) tokens.*its figure: "
                  r"([\d,]+) blocks / the ([\d,]+) a request", reported)
    assert m, reported
    length, figure, blocks2, per = (int(g.replace(",", "")) for g in m.groups())
    assert blocks2 == blocks and per == state + -(-length // size)
    assert figure == int(blocks / per * length)
