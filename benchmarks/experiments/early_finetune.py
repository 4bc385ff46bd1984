"""Does a head agree with the target more often on text that is not yet a loop when it has
seen more such text? Record more openings continued briefly, fine-tune a shipped head on
them, then measure it with `benchmarks/experiments/head_agreement.py`.

  python benchmarks/experiments/early_finetune.py record --openings 4096 --seed 1 --out early-1.safetensors
  python benchmarks/experiments/early_finetune.py tune --records REC [REC ...] --out DIR
  python benchmarks/experiments/head_agreement.py --head DIR --prompts 32

The default model's greedy continuation of a documentation page turns into a phrase loop
after a few dozen tokens (docs/speculative.md), so most of a preset's 160-token training
continuations are loop, and the benchmark's 48-token window is not. `record` self-distils
fresh openings of the domain's training pages (as `kiln train-speculator --self-distill`
does, other seeds giving other windows) with continuations just long enough for the window:
48 tokens plus the draft steps the training unroll needs past it. `tune` goes on training a
head (default: the domain's preset) on the first `--keep` positions of the given records,
e.g. a preset's cached record (`$KILN_HOME/speculators/.records/*.safetensors`, written by
`kiln train-speculator --preset prose-head`) with and without fresh ones: the same epochs
on twice the distinct windows shows whether more data of this kind moves agreement.
`--soft-labels` trains on the target's whole distribution over the draft vocabulary rather
than its greedy token, `--all-positions` also where the tokens the head is given are not the
target's own choices (the openings' raw text): neither moved agreement on held-out pages
(docs/decisions/0010), nor did
`--regression-weight 0` (no feature regression, as EAGLE-3). `widen` writes a head with a
wider MLP that computes what the given one does (the new units' gate and up rows at
PyTorch's init, their down columns zero), to go on training with `kiln train-speculator
--init`: whether capacity rather than data limits a head (it did not: docs/decisions/0010).
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import Progress
from transformers import AutoTokenizer  # noqa: F401  (import before engines start threads)

from kiln import LLM
from kiln.config import CacheConfig, ModelConfig, ParallelConfig
from kiln.runner.model_runner import ModelRunner
from kiln.speculative.head.model import EagleHead, load_head, save_head
from kiln.speculative.resolve import speculator_path
from kiln.speculative.training import data
from kiln.speculative.training.train import HeadTrainer, TrainConfig, _num_steps, split_sequences


def _runner(model_path: str, threads: int | None) -> ModelRunner:
    return ModelRunner(ModelConfig(model=model_path), model_path, CacheConfig(),
                       ParallelConfig(threads), frozenset())


def continue_openings(domain: str, openings: int, prompt_tokens: int, answer_tokens: int,
                      seed: int, threads: int | None) -> tuple[list[list[int]], str]:
    """`openings` windows of the domain's training texts at seeded offsets, each continued
    greedily by the default model for `answer_tokens`: the preset's self-distillation
    (`kiln.speculative.training.data.continue_openings` on the texts shuffled by the same seed); and the
    model's path."""
    llm = LLM(num_threads=threads, max_num_seqs=128, max_num_batched_tokens=4096,
              repetition_guard="off")
    texts = data.domain_corpus(domain)
    random.Random(seed).shuffle(texts)
    with Progress() as progress:
        task = progress.add_task("the target continues the openings", total=None)
        sequences = data.continue_openings(
            llm, llm.get_tokenizer(), texts, openings, prompt_tokens, answer_tokens, seed,
            lambda done, total: progress.update(task, completed=done, total=total))
    return sequences, str(llm.engine.model_path)


def record(args: argparse.Namespace) -> None:
    sequences, model_path = continue_openings(args.domain, args.openings, args.prompt_tokens,
                                              args.answer_tokens, args.seed, args.threads)
    head = load_head(speculator_path(args.head or f"{args.domain}-head"), torch.float32)
    chunks = torch.tensor(sequences)
    with Progress() as progress:
        task = progress.add_task("recording the target", total=chunks.numel())
        rec = data.record_target(_runner(model_path, args.threads), chunks,
                                 head.c.feature_layers,
                                 progress=lambda n: progress.advance(task, n))
    rec.save(Path(args.out))
    print(f"wrote {args.out}: {len(sequences)} openings of {args.prompt_tokens} tokens, "
          f"each continued for {args.answer_tokens}")


def tune(args: argparse.Namespace) -> None:
    from kiln.engine.core import resolve_model_path

    records = [data.TargetRecord.load(Path(p)) for p in args.records]
    rec = data.TargetRecord(*(torch.cat([getattr(r, name)[:, :args.keep] for r in records])
                              .contiguous() for name in ("tokens", "features", "labels")))
    del records
    init = load_head(speculator_path(args.head or f"{args.domain}-head"), torch.float32)
    model_path = str(resolve_model_path(None))
    cfg = TrainConfig(epochs=args.epochs, lr=args.lr, ttt_steps=3,
                      feature_layers=tuple(init.c.feature_layers),
                      soft_labels=args.soft_labels, consistent_only=not args.all_positions,
                      regression_weight=args.regression_weight, seed=args.seed)
    trainer = HeadTrainer(_runner(model_path, args.threads).model, rec, cfg,
                          Path(model_path).name, init)
    started = time.perf_counter()
    with Progress() as progress:
        total = _num_steps(len(split_sequences(len(rec.tokens), cfg)[0]), cfg)
        task = progress.add_task(f"fine-tuning on {len(rec.tokens)} windows", total=total)
        history = trainer.fit(lambda step, h: progress.update(task, completed=step))
    save_head(trainer.head, Path(args.out), torch.bfloat16)
    print(f"wrote {args.out} ({time.perf_counter() - started:.0f} s; agreement per draft step "
          f"on held-out windows {[round(x, 3) for x in history.eval_accuracy]})")


def widen(args: argparse.Namespace) -> None:
    import dataclasses

    head = load_head(speculator_path(args.head or f"{args.domain}-head"), torch.float32)
    n = head.c.intermediate_size
    if args.intermediate_size <= n:
        raise SystemExit(f"--intermediate-size must be above the head's {n}")
    torch.manual_seed(0)  # the new units' init
    wide = EagleHead(dataclasses.replace(head.c, intermediate_size=args.intermediate_size),
                     head.draft_vocab.clone()).float()
    state = wide.state_dict()
    for name, value in head.state_dict().items():
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            state[name][:n] = value
        elif name.endswith("down_proj.weight"):
            state[name].zero_()
            state[name][:, :n] = value
        else:
            state[name] = value
    wide.load_state_dict(state)
    x = torch.randn(4, head.c.hidden_size)
    same = torch.allclose(*(h.layer.down_proj(F.silu(h.layer.gate_proj(x)) * h.layer.up_proj(x))
                            for h in (head, wide)), atol=1e-5)
    assert same, "the widened MLP must compute what the head's did"
    save_head(wide, Path(args.out), torch.float32)
    print(f"wrote {args.out}: MLP {n} -> {args.intermediate_size} units")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="self-distil and record fresh short continuations")
    rec.add_argument("--openings", type=int, default=4096)
    rec.add_argument("--prompt-tokens", type=int, default=96)
    rec.add_argument("--answer-tokens", type=int, default=51,
                     help="48 for the benchmark's window + 3 for the unrolled draft steps")
    rec.add_argument("--seed", type=int, default=1, help="the presets use 0")
    rec.add_argument("--out", required=True)
    rec.set_defaults(func=record)
    ft = sub.add_parser("tune", help="go on training a head on records' first positions")
    ft.add_argument("--records", nargs="+", required=True)
    ft.add_argument("--keep", type=int, default=147,
                    help="positions of each window: opening + 51 tokens of continuation")
    ft.add_argument("--epochs", type=int, default=3)
    ft.add_argument("--lr", type=float, default=1e-3)
    ft.add_argument("--soft-labels", action="store_true",
                    help="learn the target's whole distribution (over the draft vocabulary), "
                         "not only its greedy token")
    ft.add_argument("--all-positions", action="store_true",
                    help="learn at every position, not only where the tokens the head is "
                         "given are the target's own greedy choices")
    ft.add_argument("--regression-weight", type=float, default=0.1,
                    help="weight of EAGLE-1's feature regression in the loss (EAGLE-3: 0)")
    ft.add_argument("--seed", type=int, default=0,
                    help="held-out split and batch order (a preset stage's: its --seed)")
    ft.add_argument("--out", required=True)
    ft.set_defaults(func=tune)
    wd = sub.add_parser("widen", help="a head with a wider MLP that computes the same")
    wd.add_argument("--intermediate-size", type=int, required=True)
    wd.add_argument("--out", required=True)
    wd.set_defaults(func=widen)
    for p in (rec, ft, wd):
        p.add_argument("--domain", choices=["code", "prose"], default="prose")
        p.add_argument("--head", help="speculator (default: the domain's preset)")
        p.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    args.func(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
