#!/usr/bin/env python3
"""`vllm serve` with PP=2 through the plugin, one OpenAI completion, every process's plugin line.

    python scripts/gpu/serve_smoke.py [--compare-hook] OUTDIR [PRESET]

--compare-hook boots a second server with VLLM_DUALGPU_SM_HOOK=0 and requires the same greedy
tokens. Writes OUTDIR/serve_smoke.json and OUTDIR/serve_smoke.log. Exit code 0 only if the server
answered and every process logged its plugin line.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpurun import grep, kill, start, wait_for  # noqa: E402

PORT = 8011


PROMPTS = ["the planet", "water is", "one day the sun and the moon", "people call their"]


def summarize_log(log: Path) -> dict:
    """The plugin's lines from a serve log, and whether every process logged its own."""
    res = {
        "plugin_lines": grep(log, r"vllm-dualgpu \d+\.\d+\.\d+ \("),
        "rank_lines": grep(log, r"vllm-dualgpu rank \d"),
        "plan_lines": grep(log, r"vllm-dualgpu plan:|DualGpuExecutor|sm hook"),
        "timeline": grep(log, r"Loading weights took|Model loading took|Available KV cache|"
                              r"GPU KV cache size|init engine|Application startup complete|"
                              r"warm|Warm|autotun|compil")[:60],
    }
    lines = res["plugin_lines"]
    # The plugin's line names its pid ("(worker, pid 4424, ..."); vLLM's prefix may add "pid=".
    workers = {m.group(1) or m.group(2) for l in lines if "(worker," in l
               for m in [re.search(r"\(worker, pid (\d+)|pid=(\d+)", l)] if m}
    res["plugin_line_per_process"] = {
        "frontend": any("(frontend," in l for l in lines),
        "engine": any("(engine," in l for l in lines),
        "two workers": len(workers) == 2,
    }
    return res


def serve_once(out: Path, model: Path, tag: str, env: dict | None = None) -> dict:
    """Boot `vllm serve` PP=2 through the plugin, ask the completions API, collect the log lines."""
    log = out / f"serve_smoke{tag}.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--pipeline-parallel-size", "2",
           "--distributed-executor-backend", "dualgpu", "--load-format", "dummy",
           "--max-model-len", "4096", "--enforce-eager", "--port", str(PORT)]
    t0 = time.time()
    proc = start(cmd, log, env)
    result: dict = {"command": "vllm serve MODEL " + " ".join(cmd[5:]), "env": env or {}}
    try:
        ready = wait_for(log, r"Application startup complete", 250, proc)
        result["boot_s"] = round(time.time() - t0, 1)
        result["ready"] = bool(ready)
        if ready:
            body = json.dumps({"model": str(model), "prompt": PROMPTS, "max_tokens": 16,
                               "temperature": 0}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{PORT}/v1/completions", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                resp = json.loads(r.read())
            texts = [c["text"] for c in sorted(resp["choices"], key=lambda c: c["index"])]
            result["completion"] = {"texts": texts, "usage": resp["usage"]}
    finally:
        kill(proc, dump=not result.get("ready") and proc.poll() is None)
    result.update(summarize_log(log))
    return result


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = Path(args[0])
    preset = args[1] if len(args) > 1 else "tiny-dense"
    model = out / "models" / preset
    subprocess.run([sys.executable, str(Path(__file__).parent / "make_model.py"), preset, str(model)], check=True)
    result = serve_once(out, model, "")
    ok = bool(result.get("completion")) and all(result["plugin_line_per_process"].values())
    if "--compare-hook" in sys.argv:
        # The same server without the native sm hook must answer with the same tokens.
        off = serve_once(out, model, "_nohook", {"VLLM_DUALGPU_SM_HOOK": "0"})
        same = bool(off.get("completion")) and off["completion"]["texts"] == (result.get("completion") or {}).get("texts")
        result["without_hook"] = off
        result["same_tokens_without_hook"] = same
        ok = ok and same
    (out / "serve_smoke.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result.get(k) for k in ("boot_s", "ready", "plugin_line_per_process",
                                                  "same_tokens_without_hook")}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
