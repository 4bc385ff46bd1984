"""The repetition guard: notice a sequence stuck repeating itself, token by token.

Two rules, checked on each appended output token (prompt tokens never count), each about a
loop that ends at that token:

  token run   the same token `token_run` times in a row (default 4), or `filler_run` times
              (default 128) when it is a filler token (whitespace, digits, punctuation, one
              repeated character: see kiln.structured.vocab);
  n-gram loop a pattern of 2..`ngram_period` tokens (default 32) repeated `ngram_copies` times
              back to back (default 16), unless the pattern is all filler (table rules like
              `|---`, arrays of zeros).

The thresholds, and why legitimate text does not reach them, are in docs/structured.md.
Checking is O(1) per token when nothing repeats (each n-gram period is rejected by comparing
one token) and a slice comparison when something does.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.sampling_params import RepetitionGuardParams
from kiln.structured.closing import ClosingPlan
from kiln.structured.json_limits import JsonShape

DEFAULTS = RepetitionGuardParams()
MAX_INTERVENTIONS = 64  # masked redraws per constrained request; past them a loop stops it


@dataclass(frozen=True)
class GuardSettings:
    mode: str  # off | stop | retry
    token_run: int = DEFAULTS.token_run
    filler_run: int = DEFAULTS.filler_run
    ngram_period: int = DEFAULTS.ngram_period
    ngram_copies: int = DEFAULTS.ngram_copies


def guard_settings(params: RepetitionGuardParams | None, default_mode: str) -> GuardSettings:
    """A request's settings: its own, with the engine's mode where it names none."""
    p = params or DEFAULTS
    return GuardSettings(p.mode or default_mode, p.token_run, p.filler_run, p.ngram_period,
                         p.ngram_copies)


def find_loop(history: list[int], token: int, s: GuardSettings, filler: bytes) -> str | None:
    """The rule that `history + [token]` trips ("token_run" or "ngram"), or None."""
    limit = s.filler_run if filler[token] else s.token_run
    run = 1
    for prev in reversed(history):
        if prev != token or run >= limit:
            break
        run += 1
    if run >= limit:
        return "token_run"
    n = len(history) + 1
    for p in range(2, s.ngram_period + 1):
        span = p * s.ngram_copies
        if span > n:
            break
        if history[-p] != token:
            continue  # not p-periodic at the last token: the common, O(1) case
        tail = history[n - span:] + [token]
        pattern = tail[:p]
        if (tail[p:] == tail[:-p] and len(set(pattern)) > 1
                and not all(filler[t] for t in pattern)):
            return "ngram"
    return None


class GuardState:
    """One sequence's guard: its settings, whether it already used its redraw, and in a
    grammar-constrained request the masked redraws it made (`interventions`) and, for JSON,
    the shape of the output so far (kiln.structured.json_limits) and the closing budget's plan
    and last estimate (kiln.structured.closing)."""

    def __init__(self, settings: GuardSettings, json: JsonShape | None = None,
                 closing: ClosingPlan | None = None):
        self.settings = settings
        self.num_redraws = 0
        self.json = json
        self.interventions = 0
        self.closing = closing
        # (JsonShape.version, tokens to close, the schema's jump): kiln.structured.hooks
        self.estimate: tuple[int, int, int] | None = None
        self.closing_steps = 0  # draws steered to close the JSON

    def take_intervention(self) -> bool:
        """One more masked redraw in a constrained request (False past MAX_INTERVENTIONS)."""
        if self.interventions >= MAX_INTERVENTIONS:
            return False
        self.interventions += 1
        return True

    def check(self, history: list[int], token: int, filler: bytes) -> str | None:
        return find_loop(history, token, self.settings, filler)

    def take_redraw(self) -> bool:
        """In retry mode, the one redraw a sequence gets (True the first time only)."""
        if self.settings.mode != "retry" or self.num_redraws:
            return False
        self.num_redraws += 1
        return True
