"""`kiln train-speculator`: train a draft head or distill a draft model for a target model.

  kiln train-speculator --model M (--data FILES | --prompts FILE) --kind head|draft --out DIR
  kiln train-speculator --preset code-head          # built-in data, into $KILN_HOME/speculators

A head preset has later stages: its head then goes on training on the target's short
continuations of fresh openings (see `Refine`), stage after stage; the heads of the stages
before the last are kept in $KILN_HOME/speculators/.stages.

Steps: gather token chunks (from text files, or prompts answered first by the target itself),
run the target over them recording its features and greedy choices, train, then write the
speculator (safetensors + speculator.json), `loss.png` and `train.json` into DIR.
`LLM(speculator=DIR)` and `kiln serve --speculator DIR` load the result.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Refine:
    """A preset's later stage: go on training its head (`--init`) on the target's short
    continuations of fresh openings of the same domain. The default model's greedy text turns
    into a phrase loop a few dozen tokens in (docs/speculative.md), so most of a 160-token
    continuation is loop; text that is not yet a loop is what a head has to guess, and
    agreement on it rises with the distinct windows of it seen (~0.1 accepted per verify step
    per doubling)."""

    answer_tokens: int  # continuation length: the benchmark's 48 + the 3 unrolled draft steps
    tokens: int  # self-distilled tokens: openings x (prompt tokens + answer tokens)
    seed: int  # other windows than the other stages' (the first: seed 0)
    epochs: int
    lr: float


@dataclasses.dataclass(frozen=True)
class Preset:
    domain: str
    kind: str
    tokens: int  # self-distilled tokens
    epochs: int | None  # None: the kind's default
    refine: tuple[Refine, ...] = ()  # the stages after the first, in order


_FRESH_OPENINGS = Refine(answer_tokens=51, tokens=12288 * (96 + 51), seed=1, epochs=3, lr=1e-3)
# 8,192 more each: the prose head's agreement on held-out pages rose with the distinct windows
# it had seen; a fifth such stage did not move it (see docs/decisions/0010)
_MORE_PROSE = tuple(Refine(answer_tokens=51, tokens=8192 * (96 + 51), seed=seed, epochs=3,
                           lr=1e-3) for seed in (3, 4))

PRESETS = {
    # the prose head trained 6 epochs on 1,048,576 tokens agrees with the target as often as
    # 3 epochs on twice the data did, 10 epochs more often still, and generating the data is
    # most of the time; the code head at 10 epochs: 0.76/0.63/0.49 held out at draft steps
    # 1/2/3, against 0.61/0.45/0.33 at 3; the prose head at 12 epochs 0.87/0.78/0.67, at 10
    # 0.86/0.76/0.65; then 3 epochs on 12,288 fresh openings continued for 51 tokens; the
    # code head likewise; the prose head then twice on 8,192 more (see docs/decisions/0010)
    "code-head": Preset("code", "head", 1048576, 10, (_FRESH_OPENINGS,)),
    "prose-head": Preset("prose", "head", 1048576, 12, (_FRESH_OPENINGS, *_MORE_PROSE)),
    "code-draft": Preset("code", "draft", 524288, None),
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-speculator", help="train a speculator (draft head or model)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="target HF model dir (default: bundled model)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--data", nargs="+", help="text files or directories to train on")
    src.add_argument("--prompts", help="prompts (lines or JSONL) the target answers first")
    src.add_argument("--domain", choices=("code", "prose"),
                     help="built-in corpus: stdlib source, or the Python docs' prose (python3-doc; "
                          "else the pydoc topics)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="built-in domain + kind + out")
    p.add_argument("--kind", choices=("head", "draft"), default=None)
    p.add_argument("--out", default=None, help="output directory")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="training tokens (default: a preset's own, 1048576 code-head and "
                        "prose-head, 524288 code-draft; with --self-distill 1048576 "
                        "for a head, 524288 for a draft model; else 65536)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--doc-tokens", type=int, default=2048,
                   help="at most this many tokens from each document (corpus variety)")
    p.add_argument("--answer-tokens", type=int, default=None,
                   help="--prompts: answer length (default 256); --self-distill: "
                        "continuation length (default 160)")
    p.add_argument("--self-distill", action=argparse.BooleanOptionalAction, default=None,
                   help="--data/--domain: train on the target's own greedy continuations of "
                        "--prompt-tokens openings cut from the texts, not on the texts "
                        "(default for presets)")
    p.add_argument("--prompt-tokens", type=int, default=96,
                   help="--self-distill: tokens in each opening")
    p.add_argument("--epochs", type=int, default=None,
                   help="default: code-head 10, prose-head 12 (their later stages: 3); 2 draft; "
                        "head 3 with --self-distill, else 5")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=None, help="default: 3e-3 head, 1e-3 draft")
    p.add_argument("--ttt-steps", type=int, default=3, help="head: unrolled draft steps")
    p.add_argument("--draft-vocab-size", type=int, default=4096,
                   help="tokens a head or distilled draft model may propose, most frequent "
                        "first (0 = all)")
    p.add_argument("--feature-layers", type=int, nargs="+", default=[-1],
                   help="head: target features (-1 = final hidden, i = output of layer i)")
    p.add_argument("--head-intermediate-size", type=int, default=None)
    p.add_argument("--draft-layers", type=int, default=2, help="draft: layers it keeps")
    p.add_argument("--init", default=None, metavar="DIR",
                   help="head: go on training this trained head (same target; its shape, "
                        "features and draft vocabulary are kept): more epochs, or new data")
    p.add_argument("--dtype", default="auto", help="target dtype while recording")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    _apply_preset(args)
    console = Console(stderr=True)
    stages = PRESETS[args.preset].refine if args.preset else ()
    if not stages:
        _stage(args, console)
        return 0
    previous, kept = _kept_stage(args, 1, console, None, True)
    for number, refine in enumerate(stages, 2):
        later = argparse.Namespace(**{
            **vars(args), "self_distill": True, "answer_tokens": refine.answer_tokens,
            "max_tokens": refine.tokens, "seed": refine.seed, "epochs": refine.epochs,
            "lr": refine.lr, "init": str(previous)})
        if number <= len(stages):  # kept under .stages for the stages after it
            previous, kept = _kept_stage(later, number, console, previous, kept)
        else:  # the last writes --out
            _stage(later, console, previous, number)
    return 0


def _kept_stage(args: argparse.Namespace, number: int, console, previous: Path | None,
                may_keep: bool) -> tuple[Path, bool]:
    """A preset's head of stage `number` (not its last), in
    $KILN_HOME/speculators/.stages/NAME-number, and whether it was kept: taken as it is when
    the same command trained it before on the stages before it as they are (`may_keep`: they
    were all kept), else trained there. A stage is up to an hour of generating and training,
    and the stages after it may be stopped."""
    from kiln.speculative.resolve import speculators_home

    out = speculators_home() / ".stages" / f"{args.preset}-{number}"
    stage = argparse.Namespace(**{**vars(args), "out": str(out)})
    try:
        before = _portable_paths(json.loads((out / "train.json").read_text())["command"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        before = None
    # how many cores trained it does not change it
    if (may_keep and isinstance(before, dict) and {**before, "threads": None} ==
            {**_command(stage), "threads": None} and (out / "speculator.json").is_file()):
        console.print(f"stage {number} of {args.preset}: {out} (trained by this command before)")
        return out, True
    console.print(f"stage {number} of {args.preset} -> {out}")
    _stage(stage, console, previous, number)
    return out, False


def _command(args: argparse.Namespace) -> dict:
    """The arguments as train.json records them (JSON types: a stage compares them), with no
    machine's absolute paths: a trained head ships with it."""
    return _portable_paths(json.loads(json.dumps(
        {k: v for k, v in vars(args).items() if k != "func"})))


_PATH_ARGS = ("model", "data", "prompts", "out", "init")


def _portable_paths(command: dict) -> dict:
    """`command` with its path arguments as `_portable` writes them."""
    def portable(value):
        return [portable(v) for v in value] if isinstance(value, list) else _portable(value)
    return {k: portable(v) if k in _PATH_ARGS else v for k, v in command.items()}


def _portable(value):
    """An absolute path as $KILN_HOME/..., relative to the working directory where it lies
    under it, else its name alone; anything else as it is."""
    from kiln.models.default import kiln_home

    if not isinstance(value, str) or not Path(value).is_absolute():
        return value
    path = Path(value)
    if path.is_relative_to(kiln_home()):
        return f"$KILN_HOME/{path.relative_to(kiln_home())}"
    if path.is_relative_to(Path.cwd()):
        return str(path.relative_to(Path.cwd()))
    return path.name


def _stage(args: argparse.Namespace, console, previous: Path | None = None,
           number: int = 1) -> None:
    started = time.perf_counter()
    plan = _Plan.from_args(args)
    if previous is not None:
        console.print(f"stage {number} of {args.preset}: go on training it on "
                      f"{args.max_tokens // (args.prompt_tokens + args.answer_tokens)} "
                      f"fresh openings continued for {args.answer_tokens} tokens")
    console.print(f"[bold]train-speculator[/]: {plan.kind} for {plan.model_path} "
                  f"from {plan.source} -> {plan.out}")
    plan.init = _init_head(args.init)
    record = _record(plan, console)
    trained, history = _train(plan, record, console)
    _save(plan, trained, history, record, time.perf_counter() - started, previous)
    held = " ".join(f"{x:.2f}" for x in history.eval_accuracy)
    console.print(f"wrote {plan.out} (loss {history.loss[0]:.3f} -> {history.loss[-1]:.3f}, "
                  f"held-out agreement {held or '-'}, {time.perf_counter() - started:.0f} s); "
                  f"use it with LLM(speculator={str(plan.out)!r})")


def _apply_preset(args: argparse.Namespace) -> None:
    from kiln.cli import CliError

    if args.preset:
        preset = PRESETS[args.preset]
        if args.kind not in (None, preset.kind):
            raise CliError(f"--preset {args.preset} trains a {preset.kind}, not a {args.kind}")
        args.kind, args.domain = preset.kind, args.domain or preset.domain
        if args.self_distill is None:
            args.self_distill = True
        if args.max_tokens is None and args.self_distill:
            args.max_tokens = preset.tokens
        if args.self_distill:
            args.epochs = args.epochs or preset.epochs
        if args.out is None:
            from kiln.speculative.resolve import speculators_home
            args.out = str(speculators_home() / args.preset)
    if not (args.data or args.prompts or args.domain):
        raise CliError("give --data FILES, --prompts FILE, --domain or --preset")
    if args.kind is None or args.out is None:
        raise CliError("give --kind head|draft and --out DIR (or a --preset)")
    if args.init is not None:
        if args.kind != "head":
            raise CliError("--init goes on training a head; a draft model starts from the "
                           "target's layers")
        if not (Path(args.init) / "speculator.json").is_file():
            raise CliError(f"--init {args.init}: not a trained head (no speculator.json)")
        if Path(args.init).resolve() == Path(args.out).resolve():
            raise CliError("--init and --out are the same directory; write the new head "
                           "elsewhere")
    if args.answer_tokens is None:
        args.answer_tokens = 160 if args.self_distill else 256
    if args.max_tokens is None:
        args.max_tokens = ((1048576 if args.kind == "head" else 524288) if args.self_distill
                           else 65536)
    if args.self_distill and args.prompts:
        raise CliError("--self-distill continues openings of --data/--domain texts; "
                       "--prompts are answered by the target already")
    for name in ("max_tokens", "seq_len", "answer_tokens", "prompt_tokens", "batch_size"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be at least 1")


@dataclasses.dataclass
class _Plan:
    kind: str
    model_path: Path
    out: Path
    source: str
    args: argparse.Namespace
    init: object = None  # --init's head (an EagleHead), loaded before anything long runs

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> _Plan:
        from kiln.engine.core import resolve_model_path

        source = (f"domain {args.domain}" if args.domain else
                  f"prompts {_portable(args.prompts)}" if args.prompts else f"{len(args.data)} path(s)")
        return cls(args.kind, Path(resolve_model_path(args.model)), Path(args.out), source, args)

    def train_config(self):
        from kiln.speculative.training.train import TrainConfig

        a = self.args
        head_epochs = 3 if a.self_distill else 5
        return TrainConfig(epochs=a.epochs or (head_epochs if self.kind == "head" else 2),
                           batch_size=a.batch_size,
                           lr=a.lr or (3e-3 if self.kind == "head" else 1e-3),
                           ttt_steps=a.ttt_steps, draft_vocab_size=a.draft_vocab_size,
                           feature_layers=tuple(a.feature_layers) if self.kind == "head"
                           else (-1,),
                           intermediate_size=a.head_intermediate_size,
                           draft_layers=a.draft_layers, seed=a.seed)


def _documents(plan: _Plan, tokenizer, console) -> list[list[int]]:
    from kiln.speculative.training import data

    a = plan.args
    if a.prompts:
        from kiln import LLM

        llm = LLM(str(plan.model_path), dtype=a.dtype, num_threads=a.threads)
        return data.generate_answers(llm, data.read_prompts(a.prompts), a.answer_tokens)
    texts = data.domain_corpus(a.domain) if a.domain else data.read_text_files(a.data)
    random.Random(a.seed).shuffle(texts)
    if a.self_distill:
        return _self_distilled(plan, tokenizer, texts, console)
    docs = []
    for tokens in data.tokenize_documents(tokenizer, texts):
        docs.append(tokens[:a.doc_tokens])
        if sum(map(len, docs)) >= a.max_tokens:
            break
    return docs


def _self_distilled(plan: _Plan, tokenizer, texts: list[str], console) -> list[list[int]]:
    """Openings cut from the texts, each continued by the target (greedy, exactly
    --answer-tokens): what the speculator will see at inference is the target's own text.
    Most of a preset's time: shown as a progress bar, or ~8 lines in a log."""
    from rich.progress import Progress

    from kiln import LLM
    from kiln.speculative.training import data

    a = plan.args
    seqs = 128
    llm = LLM(str(plan.model_path), dtype=a.dtype, num_threads=a.threads, max_num_seqs=seqs,
              max_num_batched_tokens=4096, repetition_guard="off")
    with Progress(console=console, transient=False) as progress:
        task = progress.add_task("the target continues the openings", total=None)

        def show(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)
            if not console.is_terminal:
                console.print(f"continued {done}/{total} openings")

        return data.continue_openings(
            llm, tokenizer, texts, max(1, a.max_tokens // (a.prompt_tokens + a.answer_tokens)),
            a.prompt_tokens, a.answer_tokens, a.seed, show, batch=seqs)


def _record(plan: _Plan, console):
    from rich.progress import Progress
    from transformers import AutoTokenizer

    from kiln.config import CacheConfig, ModelConfig, ParallelConfig
    from kiln.runner.model_runner import ModelRunner
    from kiln.speculative.training.data import TargetRecord, chunk_tokens, record_target

    a = plan.args
    runner = ModelRunner(ModelConfig(model=str(plan.model_path), dtype=a.dtype),
                         str(plan.model_path), CacheConfig(), ParallelConfig(a.threads),
                         frozenset())
    plan.target_model, plan.target_dtype = runner.model, runner.dtype
    if plan.init is not None:  # before recording, which may take most of an hour
        from kiln.cli import CliError
        from kiln.speculative.training.train import check_init

        try:
            check_init(plan.init.c, runner.model.arch, plan.train_config())
        except ValueError as e:
            raise CliError(f"--init {a.init}: {e}") from None
    cached = _record_cache(plan)
    if cached is not None and cached.is_file():
        console.print(f"target record from cache: {cached}")
        return TargetRecord.load(cached)
    tokenizer = AutoTokenizer.from_pretrained(plan.model_path)
    seq_len = a.prompt_tokens + a.answer_tokens if a.self_distill else a.seq_len
    chunks = chunk_tokens(_documents(plan, tokenizer, console), seq_len, a.max_tokens)
    total, done = chunks.numel(), [0]

    def advance(n: int) -> None:  # a bar, or 4 lines in a log
        progress.advance(task, n)
        quarter = total / 4
        if not console.is_terminal and int((done[0] + n) / quarter) > int(done[0] / quarter):
            console.print(f"recorded {done[0] + n}/{total} tokens")
        done[0] += n

    with Progress(console=console, transient=False) as progress:
        task = progress.add_task("recording the target", total=total)
        record = record_target(runner, chunks, plan.train_config().feature_layers,
                               progress=advance)
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        record.save(cached)
    return record


def _record_cache(plan: _Plan) -> Path | None:
    """Where the target's record of this data lives between runs (built-in domains and
    --data only: answers to --prompts are generated afresh)."""
    import hashlib

    from kiln.speculative.resolve import speculators_home

    a = plan.args
    if a.prompts:
        return None
    from kiln.speculative.training.data import prose_source

    data = ((a.domain if a.domain != "prose" else [a.domain, prose_source()]) if a.domain
            else sorted(str(Path(p).resolve()) for p in a.data))
    key = json.dumps([str(plan.model_path), data, a.max_tokens, a.seq_len, a.doc_tokens,
                      plan.train_config().feature_layers, a.seed, a.dtype] +
                     ([a.prompt_tokens, a.answer_tokens] if a.self_distill else []))
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return speculators_home() / ".records" / f"{digest}.safetensors"


def _train(plan: _Plan, record, console):
    from rich.progress import Progress

    from kiln.speculative.training import train

    cfg = plan.train_config()
    total = train._num_steps(len(train.split_sequences(len(record.tokens), cfg)[0]), cfg)
    with Progress(console=console, transient=False) as progress:
        task = progress.add_task(f"training the {plan.kind}", total=total)

        def report(step, history):
            acc = " ".join(f"{x:.2f}" for x in history.accuracy[-1])
            line = f"training the {plan.kind}: loss {history.loss[-1]:.3f}, agreement {acc}"
            progress.update(task, completed=step, description=line)
            if not console.is_terminal and (step % max(1, total // 10) == 0 or step == total):
                console.print(f"step {step}/{total}: {line}")  # logs get 10 lines

        if plan.kind == "head":
            trainer = train.HeadTrainer(plan.target_model, record, cfg, plan.model_path.name,
                                        plan.init)
            return trainer.head, trainer.fit(report)
        return train.distill_draft(plan.model_path, record, cfg, report)


def _init_head(path: str | None):
    """The trained head --init names (None: train one from scratch)."""
    if path is None:
        return None
    import torch

    from kiln.cli import CliError
    from kiln.speculative.head.model import load_head

    try:
        return load_head(path, torch.float32)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        raise CliError(f"--init {path}: cannot load the head ({e})") from None


def _save(plan: _Plan, trained, history, record, seconds: float,
          previous: Path | None = None) -> None:
    import torch

    from kiln.speculative.head.model import save_head
    from kiln.speculative.training import train

    dtype = torch.float32 if plan.target_dtype == torch.float32 else torch.bfloat16
    if plan.kind == "head":
        save_head(trained, plan.out, dtype)
    else:
        vocab = train.draft_model_vocab(record, plan.train_config(),
                                        trained.config.vocab_size)
        train.save_draft(trained, plan.model_path, plan.out, dtype, vocab)
    train.plot_history(history, plan.out / "loss.png",
                       f"{plan.kind} for {plan.model_path.name} ({plan.source})")
    meta = {
        "kind": plan.kind, "target": plan.model_path.name, "source": plan.source,
        "command": _command(plan.args),
        "train_config": dataclasses.asdict(plan.train_config()),
        "loss_first": history.loss[0], "loss_last": history.loss[-1],
        "agreement_last": history.accuracy[-1], "agreement_heldout": history.eval_accuracy,
        "seconds": round(seconds, 1)}
    if previous is not None:  # a preset's stage before, which --init names
        meta["previous_stage"] = json.loads((previous / "train.json").read_text())
    (plan.out / "train.json").write_text(json.dumps(meta, indent=2))
