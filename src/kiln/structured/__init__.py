"""Structured output, tool calls and the repetition guard (docs/structured.md).

  grammar_spec.py StructuredOutputsParams -> a normalized GrammarSpec; size and depth limits
  compiler.py    GrammarCompiler: background compiles, bounded LRU cache, time limit
  constraint.py  TokenConstraint: one request's grammar matcher and one-draw bans
  bitmask.py     GrammarRows: the step's packed bitmask for the whole batch
  hooks.py       StructuredHooks: the engine's hooks (attach, token check, draft filter)
  guard.py       the repetition guard's rules
  vocab.py       token texts, filler classes, xgrammar's TokenizerInfo
  tools.py       tool-call formats, prompts for templates without tools, call grammars
  parsers.py     tool calls out of text, whole or streamed
  gateway.py     the gateway's grammar check and tool plans
"""
