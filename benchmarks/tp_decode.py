"""Tensor parallelism on one machine: TP=1 (one process, T threads) vs TP=2 (2 ranks, T/2
threads each), the fused decoder stack vs the layers one call each, and the per-call latency
of the all-reduce between ranks.

Rows per model: batch-1 decode tok/s (128-token prompt, 128 new tokens; decode time is the
whole request's minus a 1-token request's), and 64 x 128/128 throughput (output tok/s), for
  TP=1 fused and per-layer; TP=2 over gloo (per-layer: the stack reduces through shared
  memory only); TP=2 over shared memory, fused (the all-reduces inside the C++ stack) and
  per-layer (KILN_DISABLE_FUSED_STACK=1, which the ranks inherit).
Each row says whether the fused stack was built (`fused_stack`) and on how many of rank 0's
steps it ran (`fused_steps`). Models: the bundled default (SmolLM2-135M, bf16) and, with
--random-1b, a random-weight Llama of ~1.1B parameters (TinyLlama's shape) made on the fly.
The all-reduce probe times gloo and the shared-memory all-reduce between 2 ranks at batch 1
and 64 rows of the model's hidden size, and estimates a decode step's communication time as
2 all-reduces per layer (plus the embedding's) at batch 1.

usage: python benchmarks/tp_decode.py [--threads 2] [--random-1b] [--reps 3]
       [--out benchmarks/results/tp_decode.json]
       smoke check (tiny model, few tokens): python benchmarks/tp_decode.py --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
# TinyLlama-1.1B's shape: 22 layers, hidden 2048, 32 heads over 4 KV heads
ONE_B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
             num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)


def make_models(args, workdir: Path) -> dict[str, str | None]:
    from kiln.testing.tiny import make_tiny_checkpoint

    if args.tiny:
        # bf16: the fused stack's dtype
        return {"tiny": str(make_tiny_checkpoint(workdir / "tiny", "llama",
                                                 dtype="bfloat16"))}
    # the default model's 9 heads over 3 KV heads do not split in two: TP=2 refuses it, so
    # it is measured only with --default-model (for TP sizes that divide it, on more cores)
    models: dict[str, str | None] = {"default": None} if args.default_model else {}
    if args.random_1b or not models:
        models["random-1.1b"] = str(make_tiny_checkpoint(
            workdir / "llama-1b", "llama", dtype="bfloat16", **ONE_B))
    return models


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 1, (n, length), generator=g).tolist()


def timed(llm, batch: list[list[int]], max_tokens: int, reps: int) -> float:
    from kiln import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(model: str | None, tp: int, threads: int, args, all_reduce: str = "gloo",
            fused: bool = True) -> dict:
    """One engine's row; `fused` False: the layers one call each on every rank."""
    from kiln import LLM

    if not fused:  # read when the engine starts, by rank 0 and the ranks it spawns
        os.environ["KILN_DISABLE_FUSED_STACK"] = "1"
    try:
        llm = LLM(model, tensor_parallel_size=tp, num_threads=threads, all_reduce=all_reduce,
                  enable_prefix_caching=False, max_num_seqs=max(64, args.batch))
    finally:
        os.environ.pop("KILN_DISABLE_FUSED_STACK", None)
    try:
        vocab, runner = llm.engine.vocab_size, llm.engine.runner
        one = prompts(1, args.prompt_len, vocab, 0)
        timed(llm, one, 4, 1)  # warm up
        decode_s = timed(llm, one, args.new_tokens, args.reps) - timed(llm, one, 1, args.reps)
        batch = prompts(args.batch, args.prompt_len, vocab, 1)
        batch_s = timed(llm, batch, args.new_tokens, max(1, args.reps // 2))
        return {"tp": tp, "threads_per_rank": threads,
                "all_reduce": all_reduce if tp > 1 else None,
                "fused_stack": runner.stack is not None, "fused_steps": runner.fused_steps,
                "batch1_decode_tok_s": (args.new_tokens - 1) / decode_s,
                f"batch{args.batch}_out_tok_s": args.batch * args.new_tokens / batch_s}
    finally:
        llm.close()


def engine_rows(model: str | None, args) -> list[dict]:
    """TP=1 fused and per-layer, TP=2 over gloo, TP=2 over shared memory fused and
    per-layer (the last two where the shared-memory all-reduce runs here)."""
    from kiln.distributed.communicator import shm_available

    half = max(1, args.threads // 2)
    rows = [measure(model, 1, args.threads, args), measure(model, 1, args.threads, args,
                                                           fused=False),
            measure(model, 2, half, args, "gloo")]
    if shm_available():
        rows += [measure(model, 2, half, args, "shm"),
                 measure(model, 2, half, args, "shm", fused=False)]
    return rows


# -- the all-reduce probe ----------------------------------------------------------------------

def _probe_rank(rank: int, port: int, rows: list[int], hidden: int, calls: int,
                results) -> None:
    from kiln.distributed.launch import join_groups, join_store

    torch.set_num_threads(1)
    group = join_groups(join_store(port, 2, 60), rank, 2, 60)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for n in rows:
            out[f"gloo {str(dtype)[6:]} [{n}, {hidden}]"] = _time_calls(
                group.comm.all_reduce_, torch.randn(n, hidden).to(dtype), calls)
            if dtype == torch.bfloat16:  # gloo's own bf16 sum (the communicator widens)
                out[f"gloo-raw bfloat16 [{n}, {hidden}]"] = _time_calls(
                    lambda t: group.comm.group.allreduce([t]).wait(),
                    torch.randn(n, hidden).to(dtype), calls)
            shm = _shm_reducer(rank, n * hidden * 4)
            if shm is not None:
                out[f"shm {str(dtype)[6:]} [{n}, {hidden}]"] = _time_calls(
                    shm.all_reduce_, torch.randn(n, hidden).to(dtype), calls)
                shm.close()
    if rank == 0:
        results.update(out)
    group.close()


def _shm_reducer(rank: int, max_bytes: int):
    try:
        from kiln.distributed.shm_allreduce import ShmAllReduce
    except ImportError:
        return None
    return ShmAllReduce(f"kiln-tp-probe-{max_bytes}", rank, 2, max_bytes)


def _time_calls(call, tensor: torch.Tensor, calls: int) -> float:
    for _ in range(10):
        call(tensor)
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        call(tensor)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1e6  # microseconds


def probe_all_reduce(hidden: int, calls: int) -> dict[str, float]:
    from kiln.distributed.launch import open_store

    store = open_store(2, 60)
    with mp.Manager() as manager:
        results = manager.dict()
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_probe_rank, args=(r, store.port, [1, 64], hidden, calls,
                                                       results)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        return dict(results)


def step_comm_ms(latency: dict[str, float], cfg: dict) -> dict[str, float]:
    """A batch-1 bf16 decode step's all-reduce time per backend: 2 per layer and the
    embedding's, at the probe's median latency."""
    calls = 2 * cfg["num_hidden_layers"] + 1
    return {f"decode_step_comm_ms_{backend}_bf16": calls * latency[key] / 1e3
            for backend in ("gloo", "shm")
            if (key := f"{backend} bfloat16 [1, {cfg['hidden_size']}]") in latency}


def main() -> int:
    from kiln.engine.core import resolve_model_path
    from kiln.models.loader import read_hf_config

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="cores: TP=1 threads, TP=2 each half")
    p.add_argument("--random-1b", action="store_true",
                   help="a random-weight ~1.1B Llama (the model measured unless --default-model)")
    p.add_argument("--default-model", action="store_true",
                   help="also the default model (its 9 heads / 3 KV heads refuse TP=2)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--calls", type=int, default=2000, help="all-reduce calls timed per size")
    p.add_argument("--tiny", action="store_true", help="smoke check: tiny model, few tokens")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/tp_decode.json")
    args = p.parse_args()
    if args.tiny:
        args.reps, args.prompt_len, args.new_tokens, args.batch, args.calls = 1, 8, 4, 4, 20
    results: dict = {"threads": args.threads, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in make_models(args, Path(tmp)).items():
            rows = engine_rows(model, args)
            cfg = read_hf_config(resolve_model_path(model))
            latency = probe_all_reduce(cfg["hidden_size"], args.calls)
            results["models"][name] = {"runs": rows, "all_reduce_us": latency,
                                       **step_comm_ms(latency, cfg)}
            print(json.dumps({name: results["models"][name]}, indent=1))
    if not args.tiny:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
