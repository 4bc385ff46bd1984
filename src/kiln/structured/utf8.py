"""Valid UTF-8 across tokens: which tokens may follow, given where the bytes so far left off.

Byte-level tokenizers can spell one character over several tokens, and xgrammar (0.2.9)
accepts some byte sequences that are not UTF-8 (overlong forms such as E0 9E B0, which it
reads as U+07B0): the decoded text then holds U+FFFD, a string can come out longer than its
maxLength, and a parser sees characters the grammar never allowed. A constrained request
therefore also follows a small UTF-8 automaton: its state says what the next byte must be,
and each state's packed token mask (xgrammar's layout) is ANDed into the grammar's row.

States (what the next byte must be):
  0 a lead byte      1 one continuation   2 two continuations   3 three continuations
  4 A0-BF then 1     5 80-9F then 1       6 90-BF then 2        7 80-8F then 2
(4 follows E0, 5 ED, 6 F0, 7 F4: the ranges that exclude overlong forms, surrogates and code
points past U+10FFFF.)
"""

from __future__ import annotations

import torch

NUM_STATES = 8
_FIRST = {4: (0xA0, 0xBF, 1), 5: (0x80, 0x9F, 1), 6: (0x90, 0xBF, 2), 7: (0x80, 0x8F, 2)}


def _lead(byte: int) -> int | None:
    """The state after a lead byte, or None if it cannot start a character."""
    if byte < 0x80:
        return 0
    if 0xC2 <= byte <= 0xDF:
        return 1
    if byte == 0xE0:
        return 4
    if byte == 0xED:
        return 5
    if 0xE1 <= byte <= 0xEF:
        return 2
    if byte == 0xF0:
        return 6
    if 0xF1 <= byte <= 0xF3:
        return 3
    if byte == 0xF4:
        return 7
    return None


def step(state: int, byte: int) -> int | None:
    """The state after `byte`, or None if the bytes are no longer UTF-8."""
    if state == 0:
        return _lead(byte)
    low, high, rest = _FIRST.get(state, (0x80, 0xBF, state - 1))
    return rest if low <= byte <= high else None


def run(state: int, data: bytes) -> int | None:
    for byte in data:
        state = step(state, byte)
        if state is None:
            return None
    return state


class Utf8Table:
    """Per state, the tokens that keep the output UTF-8 (a packed bitmask row) and the state
    each leads to. Built once per vocabulary from its tokens' bytes."""

    def __init__(self, token_bytes: list[bytes], vocab_size: int):
        words = (vocab_size + 31) // 32  # host tables: read per token, ANDed into host masks
        shape = (NUM_STATES, vocab_size)
        self.next_state = torch.full(shape, -1, dtype=torch.int8, device="cpu")
        allowed = torch.zeros(NUM_STATES, words * 32, dtype=torch.bool, device="cpu")
        for token, data in enumerate(token_bytes[:vocab_size]):
            if data.isascii():  # the common case: only where a character may start
                allowed[0, token] = True
                self.next_state[0, token] = 0
                continue
            for state in range(NUM_STATES):
                after = run(state, data)
                if after is not None:
                    allowed[state, token] = True
                    self.next_state[state, token] = after
        for token in range(len(token_bytes), vocab_size):  # padded ids: no bytes
            allowed[:, token] = True
            self.next_state[:, token] = torch.arange(NUM_STATES, dtype=torch.int8, device="cpu")
        self.masks = _pack(allowed)  # [NUM_STATES, words] int32
        # the same table as bytes (255: no state), read once per sampled token: a bytes
        # lookup, where indexing the tensor costs a few microseconds per token
        self._next = [bytes(row) for row in self.next_state.to(torch.uint8).tolist()]

    def advance(self, state: int, token: int) -> int | None:
        after = self._next[state][token]
        return None if after == 255 else after


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """[S, 32 W] bools -> [S, W] int32 words, bit j of word w = token 32w + j."""
    bits = allowed.view(allowed.shape[0], -1, 32).to(torch.int64)
    words = (bits << torch.arange(32, device=bits.device)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
