"""Pipeline parallelism on one machine: PP=1 (one process, T threads) vs PP=2 (2 stage
processes, T/2 threads each), and the per-call latency of one stage-to-stage send.

Rows per model: batch-1 decode tok/s (128-token prompt, 128 new tokens; decode time is the
whole request's minus a 1-token request's), and 64 x 128/128 throughput (output tok/s), at
PP=2 for each micro-batch count asked (`--micro-batches 1,2,4`; default: the engine's own,
1). The engine keeps one step per stage in flight, each of half the sequences, so the
64-sequence rows show the stages overlapping; batch-1 decode has one sequence, so the stages
run one after the other and PP=2 cannot beat one process there.
Models: with --random-1b (or by default) a random-weight Llama of ~1.1B parameters
(TinyLlama's shape: 22 layers, 11 per stage) made on the fly; --default-model adds the
bundled default. The send probe times a gloo send + receive of one micro-batch's
activations [2, rows, hidden] (x and the residual, bf16) between 2 processes.

usage: python benchmarks/pp_decode.py [--threads 2] [--random-1b] [--micro-batches 1,2,4]
       [--reps 3] [--out benchmarks/results/pp_decode.json]
       smoke check (tiny model, few tokens): python benchmarks/pp_decode.py --tiny
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tp_decode import ONE_B, prompts, timed  # noqa: E402  (a sibling script)

ROOT = Path(__file__).resolve().parents[1]


def make_models(args, workdir: Path) -> dict[str, str | None]:
    from kiln.testing.tiny import make_tiny_checkpoint

    if args.tiny:
        return {"tiny": str(make_tiny_checkpoint(workdir / "tiny", "llama"))}
    models: dict[str, str | None] = {"default": None} if args.default_model else {}
    if args.random_1b or not models:
        models["random-1.1b"] = str(make_tiny_checkpoint(
            workdir / "llama-1b", "llama", dtype="bfloat16", **ONE_B))
    return models


def measure(model: str | None, pp: int, threads: int, args,
            micro_batches: int | None = None) -> dict:
    from kiln import LLM

    llm = LLM(model, pipeline_parallel_size=pp, num_threads=threads,
              pipeline_micro_batches=micro_batches, enable_prefix_caching=False,
              max_num_seqs=max(64, args.batch))
    try:
        vocab = llm.engine.vocab_size
        one = prompts(1, args.prompt_len, vocab, 0)
        timed(llm, one, 4, 1)  # warm up
        decode_s = timed(llm, one, args.new_tokens, args.reps) - timed(llm, one, 1, args.reps)
        batch = prompts(args.batch, args.prompt_len, vocab, 1)
        batch_s = timed(llm, batch, args.new_tokens, max(1, args.reps // 2))
        return {"pp": pp, "threads_per_rank": threads,
                "micro_batches": (micro_batches or 1) if pp > 1 else None,
                "batch1_decode_tok_s": (args.new_tokens - 1) / decode_s,
                f"batch{args.batch}_out_tok_s": args.batch * args.new_tokens / batch_s}
    finally:
        llm.close()


# -- the send probe ----------------------------------------------------------------------------

def _probe_rank(rank: int, port: int, rows: list[int], hidden: int, calls: int,
                results) -> None:
    from kiln.distributed.launch import join_groups, join_store

    torch.set_num_threads(1)
    group = join_groups(join_store(port, 2, 60), rank, 2, 60, stages=2)
    pipe, out = group.pipe, {}
    for n in rows:
        tensor = torch.randn(2, n, hidden).to(torch.bfloat16)
        if rank == 1:  # the first stage sends, the last (rank 0) receives and answers
            out[f"send+receive bfloat16 [2, {n}, {hidden}]"] = _time_round_trips(
                lambda t=tensor: _send_then_receive(pipe, t), calls)
        else:
            for _ in range(calls + 10):
                pipe.wait(pipe.post_receive(tensor, 0))
                _reply(group, tensor)
    if rank == 1:
        results.update(out)
    group.close()


def _send_then_receive(pipe, tensor: torch.Tensor) -> None:
    pipe.send_next(tensor, 0)
    pipe.flush()
    pipe.group.recv([tensor], 0, 1).wait()


def _reply(group, tensor: torch.Tensor) -> None:
    group.pipe.group.send([tensor], 1, 1).wait()


def _time_round_trips(call, calls: int) -> float:
    for _ in range(10):
        call()
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) / 2 * 1e6  # one way, microseconds


def probe_sends(hidden: int, rows: list[int], calls: int) -> dict[str, float]:
    from kiln.distributed.launch import open_store

    store = open_store(2, 60)
    with mp.Manager() as manager:
        results = manager.dict()
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_probe_rank, args=(r, store.port, rows, hidden, calls,
                                                       results)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        return dict(results)


def main() -> int:
    from kiln.engine.core import resolve_model_path
    from kiln.models.loader import read_hf_config

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="cores: PP=1 threads, PP=2 each half")
    p.add_argument("--random-1b", action="store_true",
                   help="a random-weight ~1.1B Llama (the model measured unless --default-model)")
    p.add_argument("--default-model", action="store_true", help="also the default model")
    p.add_argument("--micro-batches", default="",
                   help="comma-separated micro-batch counts to run PP=2 with (default: 1)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--calls", type=int, default=500, help="sends timed per size")
    p.add_argument("--tiny", action="store_true", help="smoke check: tiny model, few tokens")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/pp_decode.json")
    args = p.parse_args()
    if args.tiny:
        args.reps, args.prompt_len, args.new_tokens, args.batch, args.calls = 1, 8, 4, 4, 20
    counts = [int(c) for c in args.micro_batches.split(",") if c] or [None]
    results: dict = {"threads": args.threads, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in make_models(args, Path(tmp)).items():
            rows = [measure(model, 1, args.threads, args)]
            rows += [measure(model, 2, max(1, args.threads // 2), args, m) for m in counts]
            hidden = read_hf_config(resolve_model_path(model))["hidden_size"]
            # rows of one micro-batch: a step holds half the sequences, cut m ways
            sizes = sorted({1, *(-(-args.batch // (2 * (m or 1))) for m in counts)})
            results["models"][name] = {"runs": rows,
                                       "send_us": probe_sends(hidden, sizes, args.calls)}
            print(json.dumps({name: results["models"][name]}, indent=1))
    if not args.tiny:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
