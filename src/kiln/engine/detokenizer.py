"""Incremental detokenization and stop strings, per output sequence.

Runs where the tokenizer lives (the gateway, or the offline LLM), never in the step loop.
Text grows token by token through `tokenizers`' DecodeStream, which holds back bytes of a
character split across tokens. With stop strings, the last `max(len(stop)) - 1` characters are
held back from streaming until they cannot be the start of a stop string.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from kiln.sampling_params import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer, params: SamplingParams):
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self.stops = params.stop
        self.include_stop = params.include_stop_str_in_output
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.stop_string: str | None = None
        self._emitted = 0

    def add_tokens(self, token_ids: list[int]) -> bool:
        """Append tokens' text; True if a stop string appeared (text is then cut at it)."""
        for token in token_ids:
            piece = self._stream.step(self._backend, token)
            if piece:
                start = max(0, len(self.text) - self._hold)
                self.text += piece
                if self.stops and self._find_stop(start):
                    return True
        return False

    def _find_stop(self, search_from: int) -> bool:
        hits = [(self.text.find(s, search_from), s) for s in self.stops]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if not hits:
            return False
        pos, stop = min(hits)
        self.text = self.text[:pos + (len(stop) if self.include_stop else 0)]
        self.stop_string = stop
        return True

    def take_delta(self, finished: bool) -> str:
        """New text since the last call, holding back a possible stop-string prefix."""
        end = len(self.text) if finished or not self.stops else max(
            self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta
