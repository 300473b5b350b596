"""One real vLLM engine (offline `vllm.LLM`, token-id prompts) serving generate
commands over stdin/stdout: tests, benchmarks and the demo keep one engine for many
prompts and act in between.

    python -m kvtier_testenv.vllm_driver '{"model": DIR, "kv_transfer_config": {...} | null, ...}'

It runs under the vLLM venv's python (`vllm_engine.VllmEngine` starts it) and imports
nothing but the standard library and vLLM.

stdin, one JSON object per line:
    {"op": "generate", "prompts": [[ids...], ...], "salts": [str|null, ...], "max_tokens": 8}
    {"op": "quit"}
stdout: a line "READY {...}" once the engine is up, then one "RESULT {...}" line per
command: {"outputs": [[ids...]], "cached": [num_cached_tokens...], "seconds": s,
"ttft": [s...]}. Everything else vLLM prints, in this process or its engine core,
goes to stderr.
"""
from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    spec = json.loads(sys.argv[1])
    # The protocol keeps the real stdout; everything else writing to fd 1 — vLLM's prints
    # and the engine-core process it starts, which inherits the descriptor — goes to stderr.
    real_stdout = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from vllm import LLM, SamplingParams

    kwargs = dict(model=spec["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                  block_size=spec.get("block_size", 32), max_model_len=spec.get("max_model_len", 4096),
                  enable_prefix_caching=spec.get("enable_prefix_caching", False), seed=0,
                  max_num_seqs=spec.get("max_num_seqs", 8), load_format="safetensors")
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    llm = LLM(**kwargs)
    print("READY " + json.dumps({"pid": os.getpid()}), file=real_stdout, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            break
        prompts = []
        for i, ids in enumerate(cmd["prompts"]):
            p = {"prompt_token_ids": list(ids)}
            salt = (cmd.get("salts") or [None] * len(cmd["prompts"]))[i]
            if salt:
                p["cache_salt"] = salt
            prompts.append(p)
        params = SamplingParams(max_tokens=cmd.get("max_tokens", 8), temperature=0.0, detokenize=False)
        started = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        result = {"outputs": [list(o.outputs[0].token_ids) for o in outs],
                  "cached": [o.num_cached_tokens or 0 for o in outs], "seconds": seconds,
                  "ttft": [_ttft(o) for o in outs]}
        print("RESULT " + json.dumps(result), file=real_stdout, flush=True)
    return 0


def _ttft(out) -> float | None:
    m = getattr(out, "metrics", None)
    if m is None:
        return None
    first = getattr(m, "first_token_latency", None)
    if first is not None:
        return float(first)
    arrival, first_ts = getattr(m, "arrival_time", None), getattr(m, "first_token_ts", None)
    if arrival and first_ts:
        return float(first_ts - arrival)
    return None


if __name__ == "__main__":
    sys.exit(main())
