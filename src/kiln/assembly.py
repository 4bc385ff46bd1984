"""The composition root: an EngineCore with kiln's features plugged in.

The engine defines the seams it calls (`kiln.engine.core.StructuredOutput`, `Speculation`,
the scheduler's `TokenChecker`) and imports no feature; this module, above the engine and
beside the features (rank 4), registers the plugins and builds the features for it. Every
engine a user meets comes from `build_engine_core`: the offline `LLM` and the cluster worker.
"""

from __future__ import annotations

from functools import partial

from kiln.config import EngineConfig
from kiln.engine.core import EngineCore, SpeculationFactory, StructuredOutput, resolve_model_path
from kiln.speculative import register_builtin_proposers
from kiln.speculative.speculator import build_speculator
from kiln.structured.bitmask import GrammarRows
from kiln.structured.hooks import StructuredHooks
from kiln.structured.vocab import Vocabulary, VocabularyLoad


def build_engine_core(config: EngineConfig, *, emit_kv_events: bool = False) -> EngineCore:
    """Load the model into an EngineCore with structured output and, when
    `config.speculative` is set, a speculator. `emit_kv_events`: the prefix cache records
    KV events for a router (the cluster worker publishes them)."""
    register_plugins()
    check_parallel_features(config)
    # the tokenizer loads on a thread while the engine loads the model
    vocab = Vocabulary.load_in_background(resolve_model_path(config.model.model))
    speculator: SpeculationFactory | None = None
    if config.speculative is not None:
        speculator = partial(build_speculator, config.speculative)
    engine = EngineCore(config, emit_kv_events,
                        structured=partial(_structured_output, config, vocab),
                        speculator=speculator)
    engine.runner.grammar_rows = GrammarRows  # each step's bitmask (kiln.runner.hooks)
    return engine


def check_parallel_features(config: EngineConfig) -> None:
    """ValueError for a feature pipeline parallelism does not serve: a draft model or head
    reads the target's hidden states or runs beside every layer, which no stage holds (n-gram
    lookup drafts are tokens of the step, and work; at TP every proposer runs on rank 0)."""
    p, spec = config.parallel, config.speculative
    if p.pipeline_parallel_size > 1 and spec is not None and spec.method != "ngram":
        raise ValueError(f"speculative method {spec.method!r} with pipeline_parallel_size "
                         f"{p.pipeline_parallel_size}: only ngram drafts work across stages")


def register_plugins() -> None:
    """Import the modules that register kiln's built-in plugins by name: the quantized
    weight formats with their linear methods, and the speculative proposers."""
    import kiln.quant  # noqa: F401

    register_builtin_proposers()


def _structured_output(config: EngineConfig, vocab: VocabularyLoad, vocab_size: int,
                       eos_token_ids: frozenset[int]) -> StructuredOutput:
    return StructuredHooks(config.structured, vocab.result(vocab_size), eos_token_ids)
