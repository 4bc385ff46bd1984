"""The vocabulary as kiln.structured sees it: each token's text, which tokens are "filler",
and xgrammar's TokenizerInfo (built on first use).

Filler tokens are the ones legitimate text repeats in long runs, so the repetition guard gives
them a much higher threshold (docs/structured.md): whitespace (spaces, tabs, newlines,
indentation), tokens without letters (digits as in `1000000`, punctuation as in `|---|`,
`====`, `....`), and tokens of one repeated ASCII character or of two or more copies of one
character (`FFFF` in hex, `AAAAAAAA` in base64, ` a`). A single non-ASCII letter (`我`) is a
word: four in a row trip the guard.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)


def is_filler(text: str) -> bool:
    core = text.strip()
    if not core or not any(ch.isalpha() for ch in core):
        return True
    return len(set(core)) == 1 and (core.isascii() or len(core) > 1)


class Vocabulary:
    """Token texts and filler flags for ids [0, vocab_size) (ids past the tokenizer's own
    vocabulary, e.g. padded embedding rows, have empty text)."""

    def __init__(self, tokenizer, vocab_size: int, texts: list[str] | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        texts = token_texts(tokenizer, vocab_size) if texts is None else texts
        self.texts = texts + [""] * (vocab_size - len(texts))
        self.filler = bytes(is_filler(t) for t in self.texts)  # filler[id] is 1 or 0
        self._info = None
        self._starting: dict[str, list[int]] = {}
        self._open: list[int] | None = None
        self.utf8 = None  # kiln.structured.utf8.Utf8Table, with the TokenizerInfo
        self._lock = threading.Lock()

    @classmethod
    def load(cls, model_path: str, vocab_size: int) -> Vocabulary:
        from transformers import AutoTokenizer
        return cls(AutoTokenizer.from_pretrained(model_path), vocab_size)

    @classmethod
    def load_in_background(cls, model_path: str) -> VocabularyLoad:
        return VocabularyLoad(model_path)

    def text(self, token_id: int) -> str:
        return self.texts[token_id] if 0 <= token_id < len(self.texts) else ""

    def starting_with(self, chars: str) -> list[int]:
        """Ids of the tokens whose text, past leading whitespace, begins with one of `chars`
        (the JSON limits ban such a class at once; cached per `chars`)."""
        ids = self._starting.get(chars)
        if ids is None:
            ids = [i for i, t in enumerate(self.texts) if t.lstrip()[:1] in chars and t.strip()]
            self._starting[chars] = ids
        return ids

    def not_closing_string(self) -> list[int]:
        """Ids of the tokens that do not begin with `"` (cached)."""
        if self._open is None:
            self._open = [i for i, t in enumerate(self.texts) if not t.startswith('"')]
        return self._open

    def closing_then(self, chars: str) -> list[int]:
        """Ids of the tokens that close a string and go on (past whitespace) with one of
        `chars` (`",`, `" ,`; cached)."""
        key = '"' + chars
        ids = self._starting.get(key)
        if ids is None:
            ids = [i for i, t in enumerate(self.texts)
                   if t.startswith('"') and t[1:].lstrip()[:1] in chars and t[1:].strip()]
            self._starting[key] = ids
        return ids

    def tokenizer_info(self):
        """xgrammar's TokenizerInfo for this vocabulary, and the UTF-8 table from its token
        bytes (built once, on the first grammar's compile thread; thread-safe)."""
        with self._lock:
            if self._info is None:
                from kiln.structured.utf8 import Utf8Table
                info = tokenizer_info(self.tokenizer, self.vocab_size)
                self.utf8 = Utf8Table(info.decoded_vocab, self.vocab_size)
                self._info = info
            return self._info


class VocabularyLoad:
    """The tokenizer and its token texts, loading on a thread (while the engine loads the
    model); `result(vocab_size)` joins it: the Vocabulary, or None without a tokenizer."""

    def __init__(self, model_path: str):
        self._model_path = model_path
        self._loaded: tuple | None = None
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._load, daemon=True, name="kiln-vocab")
        self._thread.start()

    def _load(self) -> None:
        try:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(self._model_path)
            self._loaded = (tokenizer, token_texts(tokenizer, len(tokenizer)))
        except Exception as exc:  # no usable tokenizer
            self._error = exc

    def result(self, vocab_size: int) -> Vocabulary | None:
        self._thread.join()
        if self._loaded is None:
            log.warning("no tokenizer for structured output and the repetition guard: %s",
                        self._error)
            return None
        tokenizer, texts = self._loaded
        return Vocabulary(tokenizer, vocab_size, texts[:vocab_size])


def tokenizer_info(tokenizer, vocab_size: int):
    """xgrammar's view of a Hugging Face tokenizer over the model's `vocab_size` ids."""
    import xgrammar as xgr
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)


def token_texts(tokenizer, vocab_size: int) -> list[str]:
    """Each id's text, special tokens included (the fast tokenizer decodes them in one call)."""
    n = min(len(tokenizer), vocab_size)
    ids = [[i] for i in range(n)]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        texts = backend.decode_batch(ids, skip_special_tokens=False)
    else:
        texts = [tokenizer.decode(i, skip_special_tokens=False) for i in ids]
    return list(texts) + [""] * (vocab_size - n)
