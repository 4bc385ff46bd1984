"""Prompt text of an exact token count in the server's tokenizer.

Random token ids decoded to text do not always re-tokenize to the same count (byte fragments,
merges across token boundaries), so `TextMaker` decodes, re-tokenizes and trims or tops up until
the count is exact, and checks that the text joins cleanly after a given prefix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

_FIT_ROUNDS = 16  # trim/top-up passes before resampling
_SAMPLE_TRIES = 32  # fresh samples before giving up


class Tokenizer(Protocol):
    """The slice of a transformers tokenizer the bench uses."""

    all_special_ids: list[int]

    def __len__(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...,
               clean_up_tokenization_spaces: bool = ...) -> str: ...


def resolve_tokenizer_path(tokenizer: str | None, model: str) -> str:
    """`--tokenizer` if given, else the model name when it is a local directory, else kiln's
    default model directory (fetched and converted on first use)."""
    if tokenizer:
        return tokenizer
    if Path(model).is_dir():
        return model
    from kiln.models.default import default_model_path

    return str(default_model_path())


def load_tokenizer(path: str) -> Tokenizer:
    from transformers import AutoTokenizer

    if not Path(path).exists():
        raise FileNotFoundError(f"tokenizer directory {path} does not exist; pass --tokenizer")
    try:
        return AutoTokenizer.from_pretrained(path)
    except OSError as exc:
        raise ValueError(f"cannot load a tokenizer from {path}: {exc}") from None


def count_tokens(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


class TextMaker:
    """Seeded source of random text with an exact token count."""

    def __init__(self, tokenizer: Tokenizer, rng: np.random.Generator):
        self.tokenizer = tokenizer
        self.rng = rng
        special = set(tokenizer.all_special_ids)
        self._vocab = np.array([i for i in range(len(tokenizer)) if i not in special])

    def text(self, n: int, after: str = "") -> str:
        """Text of exactly `n` tokens that also tokenizes as `n` tokens appended to `after`
        (the prefix's tokens unchanged), so shared prefixes stay token-identical."""
        if n == 0:
            return ""
        for _ in range(_SAMPLE_TRIES):
            text = self._fit(self._sample(n), n)
            if text is not None and self._joins_cleanly(after, text, n):
                return text
        raise ValueError(f"could not build text of exactly {n} tokens with this tokenizer")

    def _sample(self, n: int) -> list[int]:
        return self.rng.choice(self._vocab, size=n).tolist()

    def _fit(self, ids: list[int], n: int) -> str | None:
        for _ in range(_FIT_ROUNDS):
            text = self._decode(ids)
            got = self._encode(text)
            if len(got) == n:
                return text
            ids = got[:n] if len(got) > n else got + self._sample(n - len(got))
        return None

    def _joins_cleanly(self, after: str, text: str, n: int) -> bool:
        if not after:
            return True
        head = self._encode(after)
        joined = self._encode(after + text)
        return len(joined) == len(head) + n and joined[: len(head)] == head

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)
