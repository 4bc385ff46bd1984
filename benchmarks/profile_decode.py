"""Where a batch-1 decode step's time goes: torch.profiler over decode steps of the default model.

Profiles the same decode (a 128-token prompt, then `--steps` greedy steps, EOS ignored) on the
reference torch path (torch matmuls, torch attention and elementwise ops) and on kiln's default
fast path (oneDNN-prepacked bf16 linears, C++ CPU kernels, the cpu attention backend), and
prints, per path, the mean wall time per step and the ops that take it (self CPU time per
step, grouped). Pass `--quantization int8` to profile 8-bit weights.

    python benchmarks/profile_decode.py [--steps 64] [--threads 2] [--top 12]
        [--paths reference,default] [--out benchmarks/results/profile_decode.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

import kiln.quant  # noqa: F401  (registers --quantization's formats)
from kiln.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from kiln.engine.core import EngineCore, EngineRequest
from kiln.models.default import pull_default_model
from kiln.sampling_params import SamplingParams

PATHS = {
    "reference": dict(kernels="torch", attention_backend="torch", linear_backend="torch"),
    "default": dict(kernels="auto", attention_backend="auto", linear_backend="auto"),
}


def prefill(engine: EngineCore, steps: int, prompt: list[int], tag: str) -> None:
    """Add a request for `steps` decode steps after its prompt, and run its prefill step."""
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    engine.add_request(EngineRequest(request_id=tag, prompt_token_ids=prompt, params=params))
    engine.step()


def decode(engine: EngineCore) -> None:
    while engine.has_unfinished():
        engine.step()


def profile_path(name: str, args) -> dict:
    model = ModelConfig(model=str(args.model or pull_default_model()), dtype="bfloat16",
                        max_model_len=1024, quantization=args.quantization, **PATHS[name])
    engine = EngineCore(EngineConfig(model=model, cache=CacheConfig(kv_cache_memory=256 << 20),
                                     parallel=ParallelConfig(num_threads=args.threads)))
    prompt = [int(t) for t in torch.randint(100, 40000, (128,), generator=torch.Generator()
                                            .manual_seed(0))]
    prefill(engine, 16, prompt, "warm")
    decode(engine)
    prefill(engine, args.steps, prompt[::-1], "timed")
    start = time.perf_counter()
    decode(engine)
    wall = time.perf_counter() - start
    prefill(engine, args.steps, prompt[1:], "profiled")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decode(engine)
    events = prof.key_averages()
    total_self = sum(e.self_cpu_time_total for e in events)
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:args.top]
    per_step = {e.key: round(e.self_cpu_time_total / args.steps / 1000, 3) for e in rows}
    return {"path": name, "settings": PATHS[name], "steps": args.steps,
            "wall_ms_per_step": round(wall / args.steps * 1000, 2),
            "profiled_self_cpu_ms_per_step": round(total_self / args.steps / 1000, 2),
            "top_ops_self_cpu_ms_per_step": per_step,
            "calls_per_step": {e.key: round(e.count / args.steps, 1) for e in rows}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--paths", default="reference,default")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = [profile_path(p, args) for p in args.paths.split(",")]
    for r in results:
        print(f"\n== {r['path']}: {r['wall_ms_per_step']} ms/step wall "
              f"({r['profiled_self_cpu_ms_per_step']} ms/step self CPU under the profiler)")
        print(f"{'op':<48} {'ms/step':>8} {'calls/step':>10}")
        for op, ms in r["top_ops_self_cpu_ms_per_step"].items():
            print(f"{op[:48]:<48} {ms:>8.3f} {r['calls_per_step'][op]:>10}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
