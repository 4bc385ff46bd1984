"""The engine's flags, which `kiln serve`, `kiln worker` and `kiln generate` share, and `kiln
generate`: one generation with the offline engine (a demo and a smoke test).

The engine flags are EngineConfig's sections' fields (kiln.config_cli), plus `--speculator` and
`--speculative-config`, which name a speculator (kiln.speculative.resolve).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from kiln.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    StructuredConfig,
)
from kiln.config_cli import add_flags, config_from_flags, flags_given
from kiln.config_speculative import SpeculativeConfig
from kiln.distributed.launch import torchrun_nodes
from kiln.speculative.resolve import resolve_speculative_config


def add_engine_flags(parser: argparse.ArgumentParser, threads_default: str | None = None
                     ) -> None:
    """The engine's flags, a group per config; `threads_default` describes the command's own
    default for --threads, where it has one."""
    add_flags(parser.add_argument_group("engine: model"), ModelConfig)
    add_flags(parser.add_argument_group("engine: KV cache"), CacheConfig)
    add_flags(parser.add_argument_group("engine: scheduler"), SchedulerConfig)
    add_flags(parser.add_argument_group("engine: threads"), ParallelConfig,
              computed={"num_threads": threads_default} if threads_default else None)
    speculative = parser.add_argument_group(
        "engine: speculative decoding (off unless --speculator or --speculative-config names a "
        "speculator)")
    _add_speculator_flags(speculative)
    add_flags(speculative, SpeculativeConfig)
    add_flags(parser.add_argument_group("engine: structured output"), StructuredConfig)


def _add_speculator_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--speculator", default=None,
                   help="ngram, a speculator dir or preset (see kiln train-speculator), or a "
                        "draft checkpoint")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding as vLLM's flag takes it, e.g. '{\"method\": "
                        "\"eagle\", \"model\": \"code-head\", \"num_speculative_tokens\": 3}' "
                        "(method ngram | eagle | eagle3 | draft_model, model, "
                        "prompt_lookup_min/max, disable_by_batch_size, and kiln's own "
                        "SpeculativeConfig fields); instead of --speculator, and the flags "
                        "below override it")


def engine_config(args: argparse.Namespace, threads: int | None = None) -> EngineConfig:
    """The engine flags as an EngineConfig; `threads` is num_threads where --threads is not
    given."""
    return EngineConfig(
        model=config_from_flags(args, ModelConfig),
        cache=config_from_flags(args, CacheConfig),
        scheduler=config_from_flags(args, SchedulerConfig),
        parallel=ParallelConfig(**{"num_threads": threads, **torchrun_nodes(os.environ),
                                   **flags_given(args, ParallelConfig)}),
        speculative=speculative_config(args),
        structured=config_from_flags(args, StructuredConfig))


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """Off unless --speculator or --speculative-config names a speculator; the speculative
    flags given on the command line override the JSON's keys."""
    given = flags_given(args, SpeculativeConfig)
    if args.speculative_config is None:
        return (resolve_speculative_config(args.speculator, SpeculativeConfig(**given))
                if args.speculator else None)
    if args.speculator:
        raise ValueError("--speculator and --speculative-config both name a speculator: give "
                         "one (the JSON's \"model\" and \"method\" do what --speculator does)")
    try:
        spec = json.loads(args.speculative_config)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise ValueError("--speculative-config must be a JSON object, e.g. "
                         "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3}'")
    try:
        return resolve_speculative_config(None, {**spec, **given})
    except ValueError as exc:
        message = str(exc).removeprefix("speculative_config: ")
        raise ValueError(f"--speculative-config: {message}") from None


# -- kiln generate ----------------------------------------------------------------------------

def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text offline (no server)")
    p.add_argument("--prompt", default="What is the capital of France?")
    p.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    add_engine_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kiln import SamplingParams
    from kiln.llm import LLM

    llm = LLM.from_config(engine_config(args))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    start = time.perf_counter()
    if args.raw:
        out = llm.generate([args.prompt], params, use_tqdm=False)[0]
    else:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    elapsed = time.perf_counter() - start
    completion = out.outputs[0]
    print(completion.text)
    print(f"-- {len(completion.token_ids)} tokens in {elapsed:.2f} s "
          f"({len(completion.token_ids) / elapsed:.1f} tok/s), finish: {completion.finish_reason}")
    return 0
