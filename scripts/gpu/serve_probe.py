#!/usr/bin/env python3
"""Where does ``vllm serve`` with PP=2 through the plugin stop answering? (issue #23)

    python3 scripts/gpu/serve_probe.py OUTDIR [--variants default,no-async,...] [--pair 8,12]
                                              [--wait 40] [--limit 420]

On the GPU machine after staging, from the repository root. Each variant boots ``vllm serve``
(the tiny dense model, dummy weights, eager, PP=2, ``--distributed-executor-backend dualgpu``)
on its own virtual pair, all variants at once, then asks in turn: one completion of one prompt,
one completion of four prompts, four streams at once. The first request that gets no answer in
``--wait`` seconds ends the variant: every process of its server writes its stacks to its log
(``gpu_harness.stop_group(dump=True)``). The variants differ in one thing each:

- ``default``    the test's flags (tests/gpu/test_gpu_serve.py) with vLLM's own attention backend
                 (every variant but ``triton-attn`` passes ``--attention-backend auto``: the GPU harness
                 would otherwise give a virtual pair's children TRITON_ATTN);
- ``no-async``   ``--no-async-scheduling``;
- ``v1-runner``  ``VLLM_USE_V2_MODEL_RUNNER=0`` (vLLM's V1 model runner: PP without async scheduling);
- ``uncapped``   the package's ``pp-inflight-batches`` cap lifted in every process (a
                 ``sitecustomize`` on PYTHONPATH makes ``capped_batches`` return vLLM's value);
- ``eager-load`` ``CUDA_MODULE_LOADING=EAGER`` (every kernel loaded at start, none on first use);
- ``small-dense`` the e2e test's model (8 layers, hidden 512) instead of the tiny one;
- ``long-prompt`` the first request's prompt is ~120 tokens, not 3;
- ``few-blocks`` ``--num-gpu-blocks-override 512`` (a small KV cache);
- ``triton-attn`` ``--attention-backend TRITON_ATTN`` (no FlashAttention kernel);
- ``llm``        no server: ``vllm.LLM`` in a process of its own, the same first prompt.

When a request gets no answer, ``<variant>.proc.txt`` records each process's threads' system
calls and kernel wait channels, and the GPU's utilization, before the stacks are taken.

Writes OUTDIR/<variant>.log and OUTDIR/probe.json (per variant: ready_s, and per request what
came back and when). A diagnosis aid, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "gpu"))
from gpu_harness import VllmServer, members, on_signals_stop_all, pair_env, run_llm  # noqa: E402
from gpu_models import write_model  # noqa: E402

ARGS = ["--distributed-executor-backend", "dualgpu", "--load-format", "dummy", "--max-model-len", "4096",
        "--enforce-eager", "--pipeline-parallel-size", "2"]
UNCAP = ("import vllm_dualgpu.patches.config_vllm as _c\n"
         "_c.capped_batches = lambda cfg, stock: stock\n")


class NoAnswer(Exception):
    pass


LONG = " ".join(["the planet water one day the sun and the moon people call their"] * 10)


# vLLM's own attention choice (FlashAttention 2 on the SM 8.9 rank): "auto" is a choice the GPU
# harness keeps (it gives virtual-pair children TRITON_ATTN otherwise) and vLLM reads as none.
VLLMS_CHOICE = ["--attention-backend", "auto"]


def variant_setup(name: str, tmp: Path) -> tuple[list[str], dict]:
    if name in ("default", "small-dense", "long-prompt", "llm"):
        return list(VLLMS_CHOICE), {}
    if name == "eager-load":
        return list(VLLMS_CHOICE), {"CUDA_MODULE_LOADING": "EAGER"}
    if name == "few-blocks":
        return ["--num-gpu-blocks-override", "512", *VLLMS_CHOICE], {}
    if name == "triton-attn":
        return ["--attention-backend", "TRITON_ATTN"], {}
    if name == "no-async":
        return ["--no-async-scheduling", *VLLMS_CHOICE], {}
    if name == "v1-runner":
        return list(VLLMS_CHOICE), {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    if name == "uncapped":
        site = tmp / "uncapped-site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(UNCAP)
        import os

        return list(VLLMS_CHOICE), {"PYTHONPATH": f"{site}:{os.environ.get('PYTHONPATH', '')}"}
    raise SystemExit(f"unknown variant {name}")


def post(server: VllmServer, body: dict, wait: float) -> dict:
    req = urllib.request.Request(server.url("/v1/completions"), json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.time()
    try:
        with urllib.request.urlopen(req, timeout=wait) as r:
            if body.get("stream"):
                chunks = sum(1 for line in r if line.startswith(b"data: ") and line.strip() != b"data: [DONE]")
                return {"ok": True, "chunks": chunks, "s": round(time.time() - t0, 2)}
            out = json.loads(r.read())
            return {"ok": True, "texts": [c["text"] for c in out["choices"]], "s": round(time.time() - t0, 2)}
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:200], "s": round(time.time() - t0, 2)}


def snapshot(pgid: int, path: Path) -> None:
    """Each process's threads: the system call they are in and where the kernel holds them; the GPU."""
    import subprocess

    lines = []
    for pid in members(pgid):
        base = Path(f"/proc/{pid}")
        try:
            comm = (base / "comm").read_text().strip()
            tasks = sorted((base / "task").iterdir(), key=lambda t: int(t.name))
        except OSError:
            continue
        lines.append(f"pid {pid} {comm}")
        for t in tasks:
            try:
                sysc = (t / "syscall").read_text().split()[0]
                wchan = (t / "wchan").read_text().strip()
                tcomm = (t / "comm").read_text().strip()
                stat = (t / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            lines.append(f"  tid {t.name} {tcomm} state {stat} syscall {sysc} wchan {wchan}")
    for q in (["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv"],
              ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv"]):
        try:
            lines.append(subprocess.run(q, capture_output=True, text=True, timeout=20).stdout)
        except Exception as exc:  # noqa: BLE001
            lines.append(f"{q[1]}: {exc}")
    path.write_text("\n".join(lines) + "\n")


def first_prompt(name: str) -> str:
    return LONG if name == "long-prompt" else "the planet"


def probe(server: VllmServer, wait: float, rec: dict, name: str) -> None:
    model = server.model
    one = post(server, {"model": model, "prompt": first_prompt(name), "max_tokens": 8, "temperature": 0}, wait)
    rec["one"] = one
    if not one["ok"]:
        snapshot(server.proc.pid, server.log.with_suffix(".proc.txt"))
        raise NoAnswer("one")
    four = post(server, {"model": model, "prompt": ["the planet", "water is", "one day the sun", "people call"],
                         "max_tokens": 16, "temperature": 0}, wait)
    rec["four"] = four
    if not four["ok"]:
        snapshot(server.proc.pid, server.log.with_suffix(".proc.txt"))
        raise NoAnswer("four")
    streams: dict = {}

    def stream(i: int) -> None:
        streams[i] = post(server, {"model": model, "prompt": f"count {i}", "max_tokens": 64, "temperature": 0,
                                   "ignore_eos": True, "stream": True}, wait)

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(wait + 5)
    rec["streams"] = streams
    if len(streams) < 4 or not all(s["ok"] for s in streams.values()):
        snapshot(server.proc.pid, server.log.with_suffix(".proc.txt"))
        raise NoAnswer("streams")


def llm_job(llm) -> dict:
    from vllm import SamplingParams

    t0 = time.time()
    out = llm.generate(["the planet"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    return {"texts": [o.outputs[0].text for o in out], "s": round(time.time() - t0, 2)}


def run_llm_variant(model: Path, out: Path, pair: list[float], limit: float, rec: dict) -> None:
    kwargs = {"model": str(model), "load_format": "dummy", "enforce_eager": True, "max_model_len": 4096,
              "pipeline_parallel_size": 2, "distributed_executor_backend": "dualgpu",
              "attention_backend": "auto"}
    res = run_llm(kwargs, llm_job, log=out / "llm.log", timeout=limit, env=pair_env(pair))
    rec.update({k: v for k, v in res.items() if k != "log"})
    rec["answered"] = "texts" in res


def run_variant(name: str, models: dict, out: Path, pair: list[float], wait: float, limit: float,
                tmp: Path, results: dict) -> None:
    extra_args, extra_env = variant_setup(name, tmp)
    rec: dict = {"args": extra_args, "env": extra_env}
    results[name] = rec
    t0 = time.time()
    model = models["small-dense" if name == "small-dense" else "tiny-dense"]
    if name == "llm":
        run_llm_variant(model, out, pair, limit + wait, rec)
        rec["wall_s"] = round(time.time() - t0, 1)
        return
    try:
        with VllmServer(str(model), ARGS + extra_args, log=out / f"{name}.log",
                        env={**pair_env(pair), **extra_env}, timeout=limit) as server:
            rec["ready_s"] = server.ready_s
            probe(server, wait, rec, name)
            rec["answered"] = True
    except NoAnswer as stop:
        rec["answered"] = False
        rec["stopped_at"] = str(stop)
    except BaseException as exc:  # a boot that failed: the log says why
        rec["answered"] = False
        rec["error"] = f"{type(exc).__name__}: {exc}"[-600:]
    rec["wall_s"] = round(time.time() - t0, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--variants", default="default,no-async,v1-runner,uncapped")
    ap.add_argument("--pair", default="8,12", help="GiB of the two virtual cards (default 8,12)")
    ap.add_argument("--wait", type=float, default=40.0, help="seconds a request may take")
    ap.add_argument("--limit", type=float, default=420.0, help="seconds a server may take to boot")
    a = ap.parse_args()
    on_signals_stop_all()
    a.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="serve-probe-"))
    models = {m: write_model(m, tmp / m) for m in ("tiny-dense", "small-dense")}
    pair = [float(x) for x in a.pair.split(",")]
    results: dict = {}
    threads = [threading.Thread(target=run_variant, args=(v, models, a.out, pair, a.wait, a.limit, tmp, results))
               for v in a.variants.split(",")]
    for t in threads:
        t.start()
        time.sleep(2.0)
    for t in threads:
        t.join()
    (a.out / "probe.json").write_text(json.dumps(results, indent=1))
    for name, rec in results.items():
        print(name, "answered" if rec.get("answered") else f"stopped at {rec.get('stopped_at', rec.get('error'))}",
              {k: v for k, v in rec.items() if k in ("ready_s", "wall_s")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
