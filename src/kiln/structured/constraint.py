"""What one request may sample next: its grammar and tokens banned for one draw.

A `TokenConstraint` lives on `Request.grammar` (the scheduler hands it to the runner in
`ScheduledRequest.grammar`). Lifecycle:
  1. made with a `Compilation` when the request arrives; `ready()` is False while it compiles
     (the scheduler computes the prompt but not its sampling position meanwhile), and `error`
     is set if the compile fails;
  2. once compiled, an xgrammar matcher follows the output: the runner fills bitmask rows from
     it (`fill_rows`, before sampling), the engine advances it (`accept`, after sampling);
  3. `banned` holds tokens forbidden for the next draw only (the repetition guard's redraw); a
     request without a grammar gets a constraint just for that. `steer` narrows the draws
     of a response that must close its JSON before max_tokens (kiln.structured.closing).
Masks also keep the output valid UTF-8 across tokens (kiln.structured.utf8), which xgrammar
alone does not. All calls come from the engine's step thread.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.structured.compiler import Compilation
from kiln.structured.grammar_spec import GrammarError
from kiln.structured.utf8 import Utf8Table


class TokenConstraint:
    def __init__(self, compilation: Compilation | None = None,
                 stop_token_ids: list[int] | None = None, replay: list[int] | None = None,
                 utf8: Callable[[], Utf8Table | None] | None = None):
        """`replay`: output tokens the request already has (it resumes after them); the
        matcher accepts them first. `utf8()`: the vocabulary's UTF-8 table, once compiled."""
        self._compilation = compilation
        self._stop_token_ids = stop_token_ids or None
        self._replay = list(replay or [])
        self._utf8_table = utf8
        self.utf8: Utf8Table | None = None
        self.utf8_state = 0
        self.matcher = None  # xgrammar.GrammarMatcher once compiled
        self.error: str | None = None  # why the grammar cannot be used
        self.banned: list[int] = []  # forbidden for the next draw only
        # token classes narrowing each draw, the first that leaves a token (the closing
        # budget, kiln.structured.closing; set after every token, () when not closing)
        self.steer: tuple[torch.Tensor, ...] = ()
        self.steered = False  # the last fill narrowed the draw with `steer` (for reporting)

    # -- compile state --------------------------------------------------------------------

    def ready(self) -> bool:
        """True when the request may sample: no grammar, or its matcher is built."""
        if self._compilation is None or self.matcher is not None:
            return True
        if self.error is not None:
            return False
        try:
            compiled = self._compilation.poll()
        except GrammarError as exc:
            self.error = str(exc)
            return False
        if compiled is None:
            return False
        import xgrammar as xgr
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=self._stop_token_ids)
        self.utf8 = self._utf8_table() if self._utf8_table else None
        if not all(self.accept(t) for t in self._replay):
            self.matcher = None
            self.error = "the request's earlier output does not match its grammar"
            return False
        return True

    @property
    def active(self) -> bool:
        """Whether the next draw is constrained at all (a grammar, or a ban)."""
        return self.matcher is not None or bool(self.banned) or bool(self.steer)

    # -- following the output ---------------------------------------------------------------

    def accept(self, token: int) -> bool:
        """Advance the grammar by one sampled token; False if the grammar (or UTF-8) rejects
        it."""
        if self.matcher is None:
            return True
        after = self.utf8.advance(self.utf8_state, token) if self.utf8 is not None else 0
        if after is None or not self.matcher.accept_token(token):
            return False
        self.utf8_state = after
        return True

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token: nothing more may follow."""
        return self.matcher is not None and self.matcher.is_terminated()

    def forces(self, text: str) -> bool:
        """Whether the grammar allows nothing but `text` next (it begins the only possible
        continuation): such a token is the grammar's choice, not the model's."""
        if self.matcher is None or not text:
            return False
        return self.matcher.find_jump_forward_string().startswith(text)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading `tokens` the grammar (and the ban) allows; the state is unchanged
        (drafts are checked this way before verification, then rolled back)."""
        if not tokens or (self.banned and tokens[0] in self.banned):
            return 0
        if self.matcher is None:
            return len(tokens)
        state, n = self.utf8_state, 0
        while n < len(tokens) and not self.matcher.is_terminated() and self.accept(tokens[n]):
            n += 1
        if n:
            self.matcher.rollback(n)
        self.utf8_state = state
        return n

    # -- masks ------------------------------------------------------------------------------

    def fill_rows(self, bitmask: torch.Tensor, first: int, drafts: list[int]) -> None:
        """Fill rows first..first+len(drafts) of the packed bitmask: row j allows what may
        follow drafts[:j] (drafts are accepted for the fill, then rolled back)."""
        rows = len(drafts) + 1
        bitmask[first:first + rows] = -1
        if self.matcher is not None:
            state, accepted = self.utf8_state, 0
            for j in range(rows):
                self.matcher.fill_next_token_bitmask(bitmask, first + j)
                self.apply_utf8(bitmask, first + j)
                if j == len(drafts) or not self.accept(drafts[j]):
                    break  # rows after a rejected draft stay all-allowed: they are not used
                accepted += 1
                if self.matcher.is_terminated():
                    break  # a stop-token draft: the sequence ends there, later rows unused
            if accepted:
                self.matcher.rollback(accepted)
            self.utf8_state = state
        self.apply_ban(bitmask, first)
        self.apply_steer(bitmask, first)  # no drafts while steering (StructuredHooks)

    def apply_utf8(self, bitmask: torch.Tensor, row: int) -> None:
        """AND in the tokens that keep the bytes UTF-8 (unless that would leave none)."""
        if self.utf8 is None:
            return
        masked = bitmask[row] & self.utf8.masks[self.utf8_state]
        if bool(masked.any()):
            bitmask[row] = masked

    def apply_steer(self, bitmask: torch.Tensor, row: int) -> None:
        """AND in the first `steer` class that leaves `row` a token (none: unchanged);
        `steered` says whether one did."""
        self.steered = False
        for allowed in self.steer:
            masked = bitmask[row] & allowed
            if bool(masked.any()):
                bitmask[row] = masked
                self.steered = True
                return

    def apply_ban(self, bitmask: torch.Tensor, row: int) -> None:
        """Clear the banned tokens' bits in `row`, unless that would forbid everything."""
        if not self.banned:
            return
        ids = torch.tensor(sorted(set(self.banned)), dtype=torch.int64, device=bitmask.device)
        ids = ids[ids < bitmask.shape[1] * 32]
        words = bitmask[row].to(torch.int64) & 0xFFFFFFFF
        clear = torch.zeros_like(words).index_put_((ids // 32,), 1 << (ids % 32),
                                                   accumulate=True)  # unique ids: sum = OR
        kept = words & ~clear
        if bool(kept.any()):  # else the grammar allows only banned tokens: keep them
            bitmask[row] = torch.where(kept >= 1 << 31, kept - (1 << 32), kept).to(torch.int32)
