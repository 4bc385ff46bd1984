"""Usage and cost: token counts of a request and its price in USD.

A price table maps served model names to prices in USD per million tokens:
  input         prompt tokens computed by the engine
  cached_input  prompt tokens served from the prefix cache (default: the input price)
  output        completion tokens
`--pricing FILE` reads one from JSON or TOML (by suffix; JSON otherwise). The key "*" prices
any model not listed. Without a file, `DEFAULT_PRICING` applies to every model.

cost = ((prompt - cached) x input + cached x cached_input + completion x output) / 1e6
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec

from kiln.serve.protocol import PromptTokensDetails, Usage

Price = Annotated[float, msgspec.Meta(ge=0)]


class Pricing(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """USD per million tokens of each kind."""

    input: Price
    output: Price
    cached_input: Price | None = None  # None = the input price

    def cost(self, counts: TokenCounts) -> float:
        cached_price = self.input if self.cached_input is None else self.cached_input
        usd = ((counts.prompt - counts.cached) * self.input + counts.cached * cached_price
               + counts.completion * self.output) / 1e6
        return round(usd, 12)


# A nominal price for a small self-hosted model; set real ones with --pricing.
DEFAULT_PRICING = Pricing(input=0.05, cached_input=0.025, output=0.20)


@dataclass(frozen=True)
class TokenCounts:
    prompt: int = 0
    cached: int = 0  # of the prompt tokens
    completion: int = 0

    def __add__(self, other: TokenCounts) -> TokenCounts:
        return TokenCounts(self.prompt + other.prompt, self.cached + other.cached,
                           self.completion + other.completion)


def load_price_table(path: str | Path) -> dict[str, Pricing]:
    """Read a price table; raise ValueError naming the file on any problem."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        if path.suffix.lower() == ".toml":
            return msgspec.toml.decode(raw, type=dict[str, Pricing])
        return msgspec.json.decode(raw, type=dict[str, Pricing])
    except (OSError, msgspec.MsgspecError) as exc:
        raise ValueError(f"pricing file {path}: {exc}") from exc


def pricing_for(table: dict[str, Pricing] | None, model: str) -> Pricing:
    """The model's prices: its own entry, else "*", else (no table) the default."""
    if table is None:
        return DEFAULT_PRICING
    found = table.get(model) or table.get("*")
    if found is None:
        raise ValueError(f"the price table has no entry for {model!r} (and no '*')")
    return found


def make_usage(counts: TokenCounts, pricing: Pricing) -> Usage:
    return Usage(prompt_tokens=counts.prompt, completion_tokens=counts.completion,
                 total_tokens=counts.prompt + counts.completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=counts.cached),
                 cost=pricing.cost(counts))
