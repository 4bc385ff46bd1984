"""Speed and memory of quantized weights vs dense bf16, in one run.

Loads each model (a label=DIR pair: a dense checkpoint or a `kiln quantize` output) into its
own `LLM` in bf16, then alternates them round by round, so load from other work on a shared
machine drifts over all alike; medians over rounds are reported. Per model:
  decode      batch-1 decode tok/s: 128 random prompt tokens, 128 new tokens, greedy, no EOS
  throughput  N requests x 128 prompt / 128 new tokens, all submitted at once (tok/s out)
  weights     resident bytes of every tensor the model holds (params, buffers and any
              other tensor attribute, e.g. prepacked copies), and the checkpoint's bytes
Runs with OpenMP's default wait policy (PASSIVE halves batch-1 decode on 2 cores); measure on a
quiet machine.

    python benchmarks/quantization.py bf16=~/.cache/kiln/models/SmolLM2-135M-Instruct \\
        int8=/tmp/kq/int8 int4=/tmp/kq/int4 [--rounds 3] [--requests 32] [--threads 2]
        [--out benchmarks/results/quantization.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def resident_bytes(model) -> int:
    """Bytes of every distinct tensor the model's modules hold (opaque prepacked tensors are
    counted at their logical size)."""
    import torch

    seen, total = set(), 0
    for module in model.modules():
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False),
                   *(v for v in vars(module).values() if isinstance(v, torch.Tensor))]
        for t in tensors:
            key = (t.data_ptr() if not t.is_mkldnn else id(t), t.numel())
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def tokens_per_s(llm, prompts: list[list[int]], max_tokens: int) -> float:
    from kiln import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.engine.kv.pool.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="label=DIR, e.g. int4=/tmp/kq/int4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32, help="requests in `throughput`")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from kiln import LLM
    from kiln.bench.offline import random_prompts

    models = dict(m.split("=", 1) for m in args.models)
    llms = {label: LLM(path, dtype="bfloat16", num_threads=args.threads, max_model_len=2048,
                       kv_cache_memory=256 << 20) for label, path in models.items()}
    vocab = next(iter(llms.values())).engine.vocab_size
    one, many = random_prompts(1, 128, vocab, seed=1), random_prompts(args.requests, 128,
                                                                       vocab, seed=2)
    for llm in llms.values():
        tokens_per_s(llm, one, 8)  # warm-up
    runs = {label: {"decode": [], "throughput": []} for label in llms}
    for r in range(args.rounds):
        for label, llm in llms.items():
            runs[label]["decode"].append(tokens_per_s(llm, one, 128))
            runs[label]["throughput"].append(tokens_per_s(llm, many, 128))
            print(f"round {r}: {label}: decode {runs[label]['decode'][-1]:.1f} tok/s, "
                  f"throughput {runs[label]['throughput'][-1]:.1f} tok/s", flush=True)
    report(models, llms, runs, args.out)


def report(models, llms, runs, out: Path | None) -> None:
    first = next(iter(runs))
    rows = {}
    for label, llm in llms.items():
        model = llm.engine.runner.model
        rows[label] = {
            "decode_tok_s": statistics.median(runs[label]["decode"]),
            "throughput_tok_s": statistics.median(runs[label]["throughput"]),
            "resident_weight_bytes": resident_bytes(model),
            "checkpoint_bytes": checkpoint_bytes(Path(models[label])),
            "runs": runs[label]}
    base = rows[first]
    print(f"\n{'model':<10}{'decode tok/s':>14}{'vs ' + first:>10}{'throughput':>12}"
          f"{'vs ' + first:>10}{'resident MB':>13}{'on disk MB':>12}")
    for label, row in rows.items():
        print(f"{label:<10}{row['decode_tok_s']:>14.1f}"
              f"{row['decode_tok_s'] / base['decode_tok_s']:>9.2f}x"
              f"{row['throughput_tok_s']:>12.1f}"
              f"{row['throughput_tok_s'] / base['throughput_tok_s']:>9.2f}x"
              f"{row['resident_weight_bytes'] / 1e6:>13.1f}{row['checkpoint_bytes'] / 1e6:>12.1f}")
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
