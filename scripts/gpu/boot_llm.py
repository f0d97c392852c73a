#!/usr/bin/env python3
"""Boot vllm.LLM with the given engine arguments, optionally generate, print one RESULT line.

    python scripts/gpu/boot_llm.py '{"model": ..., "pipeline_parallel_size": 2, ...}' [PROMPTS_JSON]

PROMPTS_JSON: a list of token-id lists or strings; greedy, 32 new tokens each unless the JSON
argument has "max_tokens". Token ids of the outputs are printed so runs can be compared.
"""

import json
import sys
import time


def main() -> None:
    t0 = time.time()
    kwargs = json.loads(sys.argv[1])
    prompts = json.loads(sys.argv[2]) if len(sys.argv) > 2 else []
    max_tokens = kwargs.pop("max_tokens", 32)
    from vllm import LLM, SamplingParams

    llm = LLM(**kwargs)
    cfg = llm.llm_engine.vllm_config
    res = {
        "boot_s": round(time.time() - t0, 1),
        "num_gpu_blocks": cfg.cache_config.num_gpu_blocks,
        "block_size": cfg.cache_config.block_size,
        "max_model_len": cfg.model_config.max_model_len,
    }
    if prompts:
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        inputs = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
        t1 = time.time()
        outs = llm.generate(inputs, sp, use_tqdm=False)
        res["generate_s"] = round(time.time() - t1, 2)
        res["outputs"] = [list(o.outputs[0].token_ids) for o in outs]
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
