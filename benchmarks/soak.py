#!/usr/bin/env python3
"""Issue #7 soak: the OpenAI server with PP=2 through the plugin, MTP on, under steady load.

    python benchmarks/soak.py OUTDIR [--minutes 10] [--concurrency 8] [--preset small-hybrid]
                                      [--request-timeout 120] [--sample-s 30] [--no-mtp] [--models DIR]

On the GPU machine after staging: ``bash scripts/gpu/run.sh OUTDIR soak`` (a boot of up to
10 min on a fresh machine + 10 min load + drain: longer than one 10-minute command, so start it
with ``setsid nohup ... &`` and poll for ``OUTDIR/soak/soak.json``). Needs the GPUs free.

What it does: writes the model (``gpu_models.write_model(PRESET, weights="random")``, default
``small-hybrid`` with MTP) under ``--models``, one folder per content kept between runs
(model_folders.py), not under OUTDIR: vLLM's compile cache is keyed by the model's path. Then
it makes the pair (two GPUs: ballast leaving GPU 0 32 GiB free and GPU 1 16 GiB; one GPU: the
virtual pair of those sizes, ``gpu_harness.pair``) and starts ``vllm serve`` with PP=2 through
the plugin (MTP with 2 tokens when the model has MTP weights; eager, max_model_len 4096,
127.0.0.1 only). CONCURRENCY client threads send /v1/completions for MINUTES:
prompts of 8 to ~2,800 tokens, a third opening with one of three long shared prefixes, max_tokens
16 to 512 (``ignore_eos``), every other request streamed. A request past REQUEST_TIMEOUT is a
timeout; one that fails, is not 200, does not end with ``finish_reason == "length"`` or returns
another number of tokens is an error. Every SAMPLE_S seconds the server's ``/metrics`` and the
client's counters are sampled. With --gpu-memory-utilization U (or SOAK_GPU_UTIL=U) there is no
ballast: each rank is capped at U of its card, so other GPU work can run beside it.

Writes OUTDIR/soak.json (config, boot time, MTP on or off and why, totals, latency percentiles,
every sample, the first errors) and OUTDIR/soak.png (tokens/s over time, matplotlib: the
``benchmark`` extra); recorded runs go to benchmarks/results/. Exit code 0 only if the server
booted, requests were served, and there were 0 errors and 0 timeouts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
from gpu_harness import VllmServer, grep, pair, stop_all  # noqa: E402
from gpu_models import PRESETS, gdn_prefill_config, has_mtp, write_model  # noqa: E402
from model_folders import add_models_option, kept_folder  # noqa: E402

FREE_GIB = [32.0, 16.0]
MAX_MODEL_LEN = 4096
MTP = {"method": "mtp", "num_speculative_tokens": 2}
WORDS = ("the a of to and in is it you that he was for on are with as I his they be at one have "
         "this from or had by hot word but what some we can out other were all there when up use "
         "your how said an each she which do their time if will way about many then them write "
         "would like so these her long make thing see him two has look more day could go come "
         "did number sound no most people my over know water than call first who may down side "
         "been now find any new work part take get place made live where after back little only "
         "round man year came show every good me give our under planet mercury venus earth mars "
         "jupiter saturn uranus neptune sun moon star").split()
PROMPT_TOKENS = ((8, 64), (64, 400), (400, 1200), (1200, 2800))  # ranges, picked evenly
MAX_TOKENS = (16, 32, 64, 128, 256, 512)


# --- workload -----------------------------------------------------------------------------------


class Workload:
    """Deterministic request parameters: prompt text, prompt length and max_tokens.

    ``count(text)`` gives the prompt's token count (the model's tokenizer when given, else an
    upper estimate of 4 tokens per word); prompts are cut so prompt + max_tokens fits the context.
    """

    def __init__(self, seed: int = 0, count=None, max_model_len: int = MAX_MODEL_LEN):
        self.rng = random.Random(seed)
        self.count = count or (lambda text: 4 * len(text.split()))
        self.max_model_len = max_model_len
        prefix_rng = random.Random(seed + 1)
        self.prefixes = [" ".join(prefix_rng.choice(WORDS) for _ in range(n)) for n in (300, 700, 1100)]
        self.lock = threading.Lock()

    def _words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(max(1, n)))

    def next(self) -> dict:
        with self.lock:
            lo, hi = self.rng.choice(PROMPT_TOKENS)
            target = self.rng.randint(lo, hi)
            max_tokens = self.rng.choice(MAX_TOKENS)
            shared = self.rng.random() < 1 / 3
            prefix = self.rng.choice(self.prefixes) if shared else ""
            text = (prefix + " " if prefix else "") + self._words(target)
        budget = self.max_model_len - max_tokens - 8
        n = self.count(text)
        while n > budget:  # cut words from the end until it fits
            words = text.split()
            text = " ".join(words[: max(1, int(len(words) * budget / n) - 1)])
            n = self.count(text)
        return {"prompt": text, "prompt_tokens": n, "max_tokens": max_tokens, "shared_prefix": shared}


# --- client -------------------------------------------------------------------------------------


class Stats:
    """Thread-safe counters and per-request records."""

    def __init__(self):
        self.lock = threading.Lock()
        self.records: list[dict] = []
        self.tokens = 0
        self.in_flight = 0

    def begin(self):
        with self.lock:
            self.in_flight += 1

    def end(self, rec: dict):
        with self.lock:
            self.in_flight -= 1
            self.records.append(rec)
            self.tokens += rec.get("completion_tokens") or 0

    def snapshot(self) -> dict:
        with self.lock:
            return {"requests": len(self.records), "tokens": self.tokens, "in_flight": self.in_flight,
                    "errors": sum(r["status"] == "error" for r in self.records),
                    "timeouts": sum(r["status"] == "timeout" for r in self.records)}


def one_request(base: str, model: str, req: dict, stream: bool, timeout: float) -> dict:
    """Send one completion; a record with status ok / error / timeout, tokens and latencies."""
    body = {"model": model, "prompt": req["prompt"], "max_tokens": req["max_tokens"],
            "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    rec = {"stream": stream, "max_tokens": req["max_tokens"], "prompt_tokens_est": req["prompt_tokens"],
           "shared_prefix": req["shared_prefix"], "start": time.time()}
    deadline = rec["start"] + timeout
    http = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                                  {"Content-Type": "application/json"})
    finish = usage = None
    chunks = 0
    try:
        with urllib.request.urlopen(http, timeout=timeout) as r:
            if stream:
                for raw in r:
                    if time.time() > deadline:
                        raise TimeoutError("stream past its deadline")
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    msg = json.loads(data)
                    if msg.get("error"):
                        raise RuntimeError(f"error event: {msg['error']}")
                    for ch in msg.get("choices") or []:
                        chunks += 1
                        if "ttft_s" not in rec:
                            rec["ttft_s"] = round(time.time() - rec["start"], 3)
                        finish = ch.get("finish_reason") or finish
                    usage = msg.get("usage") or usage
            else:
                msg = json.loads(r.read())
                finish = msg["choices"][0].get("finish_reason")
                usage = msg.get("usage")
        rec["latency_s"] = round(time.time() - rec["start"], 3)
        rec["completion_tokens"] = (usage or {}).get("completion_tokens")
        rec["prompt_tokens"] = (usage or {}).get("prompt_tokens")
        if rec["latency_s"] > timeout:
            rec.update(status="timeout", error=f"took {rec['latency_s']} s > {timeout} s")
        elif finish != "length" or rec["completion_tokens"] != req["max_tokens"]:
            rec.update(status="error", error=f"finish_reason={finish} completion_tokens="
                                             f"{rec['completion_tokens']} (wanted {req['max_tokens']}), chunks={chunks}")
        else:
            rec["status"] = "ok"
    except (TimeoutError, OSError) as exc:  # socket timeouts are OSError subclasses
        rec["latency_s"] = round(time.time() - rec["start"], 3)
        timed_out = isinstance(exc, TimeoutError) or "timed out" in str(exc) or rec["latency_s"] >= timeout
        if isinstance(exc, urllib.error.HTTPError):
            detail = exc.read()[:300].decode(errors="replace")
            rec.update(status="error", error=f"HTTP {exc.code}: {detail}")
        else:
            rec.update(status="timeout" if timed_out else "error", error=f"{type(exc).__name__}: {exc}"[:300])
    except Exception as exc:
        rec["latency_s"] = round(time.time() - rec["start"], 3)
        rec.update(status="error", error=f"{type(exc).__name__}: {exc}"[:300])
    return rec


def drive(base: str, model: str, work: Workload, stats: Stats, concurrency: int, seconds: float,
          timeout: float, stop: threading.Event | None = None) -> None:
    """CONCURRENCY threads send requests back to back until SECONDS pass (or stop is set); then
    wait for the in-flight ones. Thread i streams its even-numbered requests."""
    stop = stop or threading.Event()
    end = time.time() + seconds

    def worker(i: int):
        n = 0
        while time.time() < end and not stop.is_set():
            req = work.next()
            stats.begin()
            stats.end(one_request(base, model, req, stream=(n + i) % 2 == 0, timeout=timeout))
            n += 1

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, end - time.time()) + timeout + 30)


# --- samples, statistics, plot ------------------------------------------------------------------


SERVER_COUNTERS = {"server_tokens": "vllm:generation_tokens_total",
                   "prefix_cache_hits": "vllm:prefix_cache_hits_total",
                   "prefix_cache_queries": "vllm:prefix_cache_queries_total"}


def parse_counters(text: str) -> dict:
    """Each of SERVER_COUNTERS summed over its label sets from a /metrics page (None if absent)."""
    out = {}
    for key, name in SERVER_COUNTERS.items():
        values = [float(m.group(1)) for m in re.finditer(
            rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+([0-9.eE+-]+)\s*$", text, re.M)]
        out[key] = sum(values) if values else None
    return out


def server_counters(base: str) -> dict:
    """The server's counters now (all None if /metrics cannot be read)."""
    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
            return parse_counters(r.read().decode(errors="replace"))
    except Exception:
        return dict.fromkeys(SERVER_COUNTERS)


class Sampler:
    """Every PERIOD s: one sample of client counters and the server's counters (generated tokens,
    prefix-cache hits and queries)."""

    def __init__(self, stats: Stats, base: str | None, period: float = 30.0):
        self.stats, self.base, self.period = stats, base, period
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self.t0 = time.time()

    def sample(self) -> dict:
        s = self.stats.snapshot()
        s["t_s"] = round(time.time() - self.t0, 1)
        s.update(server_counters(self.base) if self.base else dict.fromkeys(SERVER_COUNTERS))
        self.samples.append(s)
        return s

    def _run(self):
        while not self._stop.wait(self.period):
            s = self.sample()
            print(f"[soak] t={s['t_s']:.0f}s requests={s['requests']} tokens={s['tokens']} "
                  f"in_flight={s['in_flight']} errors={s['errors']} timeouts={s['timeouts']} "
                  f"prefix_cache_hit_rate={prefix_hit_rate([s])}", flush=True)

    def __enter__(self):
        self.t0 = time.time()
        self.sample()
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.sample()


def rates(samples: list[dict]) -> list[dict]:
    """Per window between consecutive samples: tokens/s from the server counter (when both ends
    have it) and from the client's finished requests."""
    out = []
    for a, b in zip(samples, samples[1:]):
        dt = b["t_s"] - a["t_s"]
        if dt <= 0:
            continue
        srv = None
        if a.get("server_tokens") is not None and b.get("server_tokens") is not None:
            srv = round((b["server_tokens"] - a["server_tokens"]) / dt, 2)
        out.append({"t_s": b["t_s"], "window_s": round(dt, 1), "server_tok_s": srv,
                    "client_tok_s": round((b["tokens"] - a["tokens"]) / dt, 2),
                    "requests": b["requests"] - a["requests"]})
    return out


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return round(v[lo] + (v[hi] - v[lo]) * (k - lo), 3)


def summarize(records: list[dict], samples: list[dict]) -> dict:
    ok = [r for r in records if r["status"] == "ok"]
    lat = [r["latency_s"] for r in ok]
    ttft = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    win = rates(samples)
    # The last sample comes when the drained requests have finished, seconds after the previous
    # one: a window under half the usual length is the drain, not load, and stays out of the
    # rate statistics (it is still listed, flagged).
    usual = statistics.median(w["window_s"] for w in win) if win else 0.0
    for w in win:
        w["partial"] = w["window_s"] < usual / 2
    tok_s = [w["server_tok_s"] if w["server_tok_s"] is not None else w["client_tok_s"]
             for w in win if not w["partial"]]
    return {
        "requests": len(records), "ok": len(ok),
        "errors": sum(r["status"] == "error" for r in records),
        "timeouts": sum(r["status"] == "timeout" for r in records),
        "streamed": sum(r["stream"] for r in records),
        "shared_prefix": sum(r["shared_prefix"] for r in records),
        "completion_tokens": sum(r.get("completion_tokens") or 0 for r in ok),
        "latency_s": {"p50": percentile(lat, 0.5), "p90": percentile(lat, 0.9), "p99": percentile(lat, 0.99),
                      "max": max(lat) if lat else None},
        "ttft_s": {"p50": percentile(ttft, 0.5), "p90": percentile(ttft, 0.9), "max": max(ttft) if ttft else None},
        "tok_s": {"mean": round(statistics.fmean(tok_s), 2) if tok_s else None,
                  "min": min(tok_s) if tok_s else None, "max": max(tok_s) if tok_s else None},
        "windows": win,
        "prefix_cache_hit_rate": prefix_hit_rate(samples),
    }


def prefix_hit_rate(samples: list[dict]) -> float | None:
    """Prefix-cache hit tokens / queried tokens over the run, from the server's counters."""
    last = samples[-1] if samples else {}
    hits, queries = last.get("prefix_cache_hits"), last.get("prefix_cache_queries")
    if hits is None or not queries:
        return None
    return round(hits / queries, 4)


def plot(samples: list[dict], path: Path, title: str = "vllm-dualgpu soak") -> None:
    """tokens/s per window to a PNG."""
    win = rates(samples)
    xs = [w["t_s"] / 60 for w in win]
    server = [w["server_tok_s"] for w in win]
    client = [w["client_tok_s"] for w in win]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    if any(v is not None for v in server):
        ax.plot(xs, [v if v is not None else float("nan") for v in server], "o-", label="server (generation tokens)")
    ax.plot(xs, client, "s--", label="client (finished requests)", alpha=0.7)
    ax.set_xlabel("minutes")
    ax.set_ylabel("tokens/s (per window)")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--preset", default="small-hybrid", choices=sorted(PRESETS))
    ap.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request")
    ap.add_argument("--sample-s", type=float, default=30.0, help="seconds between samples")
    ap.add_argument("--boot-timeout", type=float, default=420.0)
    ap.add_argument("--no-mtp", action="store_true", help="serve without speculative decoding")
    add_models_option(ap)
    ap.add_argument("--gpu-memory-utilization", type=float,
                    default=float(os.environ["SOAK_GPU_UTIL"]) if os.environ.get("SOAK_GPU_UTIL") else None,
                    help="share the GPUs with other work: no ballast, each rank's budget capped at this "
                         "share of its card (default from SOAK_GPU_UTIL; unset: ballast, whole free memory)")
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.concurrency < 1 or args.request_timeout <= 0 or args.sample_s <= 0:
        ap.error("--minutes, --request-timeout and --sample-s must be > 0 and --concurrency >= 1")
    return args


def tokenizer_counter(model_dir: Path):
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        return lambda text: len(tok.encode(text).ids)
    except Exception:
        return None


def report(out: Path, result: dict, stats: "Stats", samples: list[dict], mtp: bool, concurrency: int,
           log: Path) -> dict:
    """Summarize, plot and write OUTDIR/soak.json; also for a run a signal cut short."""
    summary = summarize(stats.records, samples)
    result.update(summary=summary, samples=samples,
                  first_errors=[r for r in stats.records if r["status"] != "ok"][:20])
    result["plugin_lines"] = grep(log, r"vllm-dualgpu \d+\.\d+\.\d+ \(|vllm-dualgpu rank \d|vllm-dualgpu plan:")[:12]
    result["server_errors"] = [l[-300:] for l in grep(log, r"Traceback|ERROR|EngineDeadError")][:20]
    if (out / "soak_plan.json").exists():
        result["plan"] = json.loads((out / "soak_plan.json").read_text())
    if samples:
        plot(samples, out / "soak.png",
                              f"vllm-dualgpu soak: PP=2, MTP {'on' if mtp else 'off'}, concurrency {concurrency}")
    result["ok"] = bool(result.get("ready") and summary["ok"] > 0 and summary["errors"] == 0
                        and summary["timeouts"] == 0 and not result.get("stuck_in_flight")
                        and result.get("server_alive_after", False))
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({"ok": result["ok"], "boot_s": result.get("boot_s"), "load_s": result.get("load_s"),
                      "requests": summary["requests"], "requests_ok": summary["ok"]}
                     | {k: summary[k] for k in ("errors", "timeouts", "completion_tokens", "tok_s")}), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.outdir
    out.mkdir(parents=True, exist_ok=True)
    # vLLM hashes the folder's path as given
    model = kept_folder(args.models.expanduser().resolve(), f"{args.preset}-random",
                        lambda d: write_model(args.preset, d, "random"))

    if args.no_mtp:
        mtp, mtp_why = False, "turned off with --no-mtp"
    elif has_mtp(model):
        mtp, mtp_why = True, "the model has MTP weights"
    else:
        mtp, mtp_why = False, f"preset {args.preset} has no MTP layer: serving without speculative decoding"
    print(f"[soak] MTP {'on' if mtp else 'off'}: {mtp_why}", flush=True)
    args_ = ["--served-model-name", "soak", "--host", "127.0.0.1", "--pipeline-parallel-size", "2",
             "--distributed-executor-backend", "dualgpu", "--max-model-len", str(MAX_MODEL_LEN),
             "--enforce-eager", "--dtype", "bfloat16", "--max-num-seqs", str(max(16, 2 * args.concurrency))]
    if mtp:
        args_ += ["--speculative-config", json.dumps(MTP)]
    if "hybrid" in args.preset:  # the same GDN prefill kernel as the GPU tests
        args_ += ["--additional-config", json.dumps(gdn_prefill_config())]
    shared = args.gpu_memory_utilization is not None
    if shared:
        args_ += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    log = out / "soak_server.log"
    result: dict = {"config": {"minutes": args.minutes, "concurrency": args.concurrency, "preset": args.preset,
                               "request_timeout_s": args.request_timeout, "sample_s": args.sample_s,
                               "ballast_free_gib": None if shared else FREE_GIB,
                               "shared_gpus": shared, "mtp": mtp, "mtp_why": mtp_why,
                               "command": " ".join(["vllm serve MODEL", *args_])}}
    stats = Stats()
    samples: list[dict] = []
    live: dict = {}  # the running sampler, for a report written on a signal

    def on_signal(signum, frame):  # a time limit or Ctrl-C: take the server down first,
        stop_all()  # then keep what was measured (marked interrupted)
        sampler = live.get("sampler")
        result["interrupted_by"] = signal.Signals(signum).name
        try:
            report(out, result, stats, sampler.samples if sampler else samples, mtp, args.concurrency, log)
        finally:
            os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # The pair: two GPUs with ballast, or a virtual pair on one (gpu_harness.pair); shared GPUs: as they are.
    with (contextlib.nullcontext({}) if shared else pair(FREE_GIB, out / "logs")) as pair_vars:
        result["config"]["virtual_gpus"] = pair_vars.get("VLLM_DUALGPU_VIRTUAL_GPUS")
        server = VllmServer(str(model), args_, log=log, timeout=args.boot_timeout,
                            env={"VLLM_DUALGPU_PLAN_FILE": str(out / "soak_plan.json"), **pair_vars})
        try:
            with server:
                result.update(ready=True, boot_s=server.ready_s)
                base = server.url("")
                work = Workload(seed=0, count=tokenizer_counter(model))
                with Sampler(stats, base, args.sample_s) as sampler:
                    live["sampler"] = sampler
                    drive(base, "soak", work, stats, args.concurrency, args.minutes * 60, args.request_timeout)
                samples = sampler.samples
                result["load_s"] = round(samples[-1]["t_s"], 1)
                # A worker still inside a request after drive() gave up waiting: count it.
                result["stuck_in_flight"] = stats.snapshot()["in_flight"]
                result["server_alive_after"] = server.proc.poll() is None
        except AssertionError as exc:  # the server did not become healthy
            result.update(ready=False, boot_error=str(exc)[:2000])
    result = report(out, result, stats, samples, mtp, args.concurrency, log)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
