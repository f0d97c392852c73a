#!/usr/bin/env python3
"""Where does ``vllm serve`` with PP=2 through the plugin stop answering? (issue #23)

    python3 scripts/gpu/serve_probe.py OUTDIR [--variants default,no-async,v1-runner,uncapped]
                                              [--pair 8,12] [--wait 40] [--limit 420]

On the GPU machine after staging, from the repository root. Each variant boots ``vllm serve``
(the tiny dense model, dummy weights, eager, PP=2, ``--distributed-executor-backend dualgpu``)
on its own virtual pair, all variants at once, then asks in turn: one completion of one prompt,
one completion of four prompts, four streams at once. The first request that gets no answer in
``--wait`` seconds ends the variant: every process of its server writes its stacks to its log
(``gpu_harness.stop_group(dump=True)``). The variants differ in one thing each:

- ``default``    the test's flags (tests/gpu/test_gpu_serve.py);
- ``no-async``   ``--no-async-scheduling``;
- ``v1-runner``  ``VLLM_USE_V2_MODEL_RUNNER=0`` (vLLM's V1 model runner: PP without async scheduling);
- ``uncapped``   the package's ``pp-inflight-batches`` cap lifted in every process (a
                 ``sitecustomize`` on PYTHONPATH makes ``capped_batches`` return vLLM's value).

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
from gpu_harness import VllmServer, on_signals_stop_all, pair_env  # noqa: E402
from gpu_models import write_model  # noqa: E402

ARGS = ["--distributed-executor-backend", "dualgpu", "--load-format", "dummy", "--max-model-len", "4096",
        "--enforce-eager", "--pipeline-parallel-size", "2"]
UNCAP = ("import vllm_dualgpu.patches.config_vllm as _c\n"
         "_c.capped_batches = lambda cfg, stock: stock\n")


class NoAnswer(Exception):
    pass


def variant_setup(name: str, tmp: Path) -> tuple[list[str], dict]:
    if name == "default":
        return [], {}
    if name == "no-async":
        return ["--no-async-scheduling"], {}
    if name == "v1-runner":
        return [], {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    if name == "uncapped":
        site = tmp / "uncapped-site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(UNCAP)
        import os

        return [], {"PYTHONPATH": f"{site}:{os.environ.get('PYTHONPATH', '')}"}
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


def probe(server: VllmServer, wait: float, rec: dict) -> None:
    model = server.model
    one = post(server, {"model": model, "prompt": "the planet", "max_tokens": 8, "temperature": 0}, wait)
    rec["one"] = one
    if not one["ok"]:
        raise NoAnswer("one")
    four = post(server, {"model": model, "prompt": ["the planet", "water is", "one day the sun", "people call"],
                         "max_tokens": 16, "temperature": 0}, wait)
    rec["four"] = four
    if not four["ok"]:
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
        raise NoAnswer("streams")


def run_variant(name: str, model: Path, out: Path, pair: list[float], wait: float, limit: float,
                tmp: Path, results: dict) -> None:
    extra_args, extra_env = variant_setup(name, tmp)
    rec: dict = {"args": extra_args, "env": extra_env}
    results[name] = rec
    t0 = time.time()
    try:
        with VllmServer(str(model), ARGS + extra_args, log=out / f"{name}.log",
                        env={**pair_env(pair), **extra_env}, timeout=limit) as server:
            rec["ready_s"] = server.ready_s
            probe(server, wait, rec)
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
    model = write_model("tiny-dense", tmp / "tiny-dense")
    pair = [float(x) for x in a.pair.split(",")]
    results: dict = {}
    threads = [threading.Thread(target=run_variant, args=(v, model, a.out, pair, a.wait, a.limit, tmp, results))
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
