#!/usr/bin/env python3
"""`vllm serve` with PP=2 through the plugin, one OpenAI completion, every process's plugin line.

    python scripts/gpu/serve_smoke.py OUTDIR [PRESET]

Writes OUTDIR/serve_smoke.json and OUTDIR/serve_smoke.log. Exit code 0 only if the server
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


def main() -> int:
    out = Path(sys.argv[1])
    preset = sys.argv[2] if len(sys.argv) > 2 else "tiny-dense"
    model = out / "models" / preset
    subprocess.run([sys.executable, str(Path(__file__).parent / "make_model.py"), preset, str(model)], check=True)
    log = out / "serve_smoke.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--pipeline-parallel-size", "2",
           "--distributed-executor-backend", "dualgpu", "--load-format", "dummy",
           "--max-model-len", "4096", "--enforce-eager", "--port", str(PORT)]
    t0 = time.time()
    proc = start(cmd, log)
    result: dict = {"command": " ".join(cmd[:2] + ["MODEL"] + cmd[3:])}
    try:
        ready = wait_for(log, r"Application startup complete", 400, proc)
        result["boot_s"] = round(time.time() - t0, 1)
        result["ready"] = bool(ready)
        if ready:
            body = json.dumps({"model": str(model), "prompt": "the planet", "max_tokens": 16,
                               "temperature": 0}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{PORT}/v1/completions", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                resp = json.loads(r.read())
            result["completion"] = {"text": resp["choices"][0]["text"], "usage": resp["usage"]}
    finally:
        kill(proc)
    result["plugin_lines"] = grep(log, r"vllm-dualgpu \d+\.\d+\.\d+ \(")
    result["rank_lines"] = grep(log, r"vllm-dualgpu rank \d")
    result["plan_lines"] = grep(log, r"vllm-dualgpu plan:|DualGpuExecutor|sm-hook|sm hook")
    result["timeline"] = grep(log, r"Loading weights took|Model loading took|Available KV cache|"
                                   r"GPU KV cache size|init engine|Application startup complete|"
                                   r"warm|Warm|autotun|compil")[:60]
    lines = result["plugin_lines"]
    workers = {re.search(r"\((\w+) pid=(\d+)\)", l).group(0) for l in lines if "(worker," in l and re.search(r"pid=", l)}
    procs = {"frontend": any("(frontend," in l for l in lines),
             "engine": any("(engine," in l for l in lines),
             "two workers": len(workers) == 2}
    result["plugin_line_per_process"] = procs
    (out / "serve_smoke.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("boot_s", "ready", "plugin_line_per_process")}))
    ok = result.get("completion") and all(procs.values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
