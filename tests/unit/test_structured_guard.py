"""The repetition guard's rules, exactly, and both sides of its thresholds: real text that
repeats legitimately (indentation, long numbers, zero hashes, table rules, separator lines,
arrays of zeros) never trips it, in the default model's tokenizer and the tiny one; loops do."""

from __future__ import annotations

import pytest

from kiln.sampling_params import RepetitionGuardParams
from kiln.structured.guard import GuardState, find_loop, guard_settings
from kiln.structured.vocab import Vocabulary, is_filler

STOP = guard_settings(None, "stop")

LEGITIMATE = {
    "code": "class Tree:\n    def walk(self):\n        for node in self.nodes:\n"
            "            if node:\n                if node.left:\n                    "
            "yield node.left\n\n\n\n        return None\n" * 3,
    "numbers": "1000000000000000000 wei = 1 ether; 0.000000000001; 3.14159265358979323846; "
               "1e100 = 1" + "0" * 100,
    "zero hash": "0x" + "0" * 64 + " and the zero address 0x" + "0" * 40,
    "table": "| " + " | ".join(f"c{i}" for i in range(12)) + " |\n|" + "---|" * 12 + "\n"
             + ("| " + " | ".join("0" for _ in range(12)) + " |\n") * 12,
    "rules": "=" * 80 + "\nTitle\n" + "-" * 120 + "\n" + "#" * 60 + "\n" + "*" * 40 + "\n"
             + "~" * 100 + "\n" + "_" * 90,
    "zeros": "[" + ", ".join("0" for _ in range(200)) + "]\n"
             + "[\n" + ",\n".join("  [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]" for _ in range(10)) + "\n]",
    "hex and base64": "mask = 0xFFFFFFFFFFFFFFFF; key = AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA==; "
                      "xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx",
    "nones": "row = [" + ", ".join(["None"] * 12) + "]",
    "spaces": "name" + " " * 60 + "value\n" + "\t" * 12 + "deep\n" + " " * 200 + "end",
    "leaders": "Chapter 1 " + "." * 60 + " 5\nChapter 2 " + "." * 60 + " 17",
    "csv": "a,b,c" + "," * 40 + "\n" + "1,2,3" + "," * 40,
    "prose": "The guard must not trip on ordinary prose. Very, very few sentences repeat a word "
             "three times, as in ha ha ha, and those that do stop at three.",
    "lyrics": "Let it be, let it be, let it be, let it be. Whisper words of wisdom, let it be.",
}

DEGENERATE = {
    "word run": ("Hello and the the the the the the the the", "token_run"),
    "sentence loop": ("Answer: " + "I am sorry, I cannot do that. " * 20, "ngram"),
    "two-token loop": ("x = " + "foo bar " * 40, "ngram"),
}


def first_trip(ids: list[int], filler: bytes, settings=STOP) -> tuple[int, str] | None:
    for i in range(len(ids)):
        rule = find_loop(ids[:i], ids[i], settings, filler)
        if rule is not None:
            return i, rule
    return None


def _tokenizer(name: str):
    if name == "tiny":
        from kiln.testing.tiny import make_tokenizer
        return make_tokenizer()
    from transformers import AutoTokenizer

    from kiln.models.default import default_model_path
    return AutoTokenizer.from_pretrained(default_model_path())  # pulls it on first use


@pytest.fixture(scope="module", params=["tiny", "default-model"])
def vocab(request) -> Vocabulary:
    tok = _tokenizer(request.param)
    return Vocabulary(tok, len(tok))


@pytest.mark.parametrize("name", sorted(LEGITIMATE))
def test_legitimate_repetition_never_trips(vocab, name):
    ids = vocab.tokenizer.encode(LEGITIMATE[name], add_special_tokens=False)
    assert first_trip(ids, vocab.filler) is None


@pytest.mark.parametrize("name", sorted(DEGENERATE))
def test_loops_trip(vocab, name):
    text, rule = DEGENERATE[name]
    ids = vocab.tokenizer.encode(text, add_special_tokens=False)
    found = first_trip(ids, vocab.filler)
    assert found is not None and found[1] == rule
    assert found[0] < len(ids) - 1  # well before the end of the loop


def test_filler_classes():
    assert all(is_filler(t) for t in ["   ", "\n\n", "\t", "0", "000", "|", "---", "=" * 64,
                                      "....", " 0", ",", "FFFF", "AAAAAAAA", " a", "x", "哈哈"])
    assert not any(is_filler(t) for t in [" the", "ha", "None", "我", "ab", "<|im_end|>",
                                          " very"])


# -- exact values on synthetic ids (0 = a word token, 1 = filler, 2.. = words) -----------------

FILLER = bytes([0, 1] + [0] * 30)


def test_token_run_thresholds_are_exact():
    assert find_loop([0, 0], 0, STOP, FILLER) is None
    assert find_loop([5, 0, 0, 0], 0, STOP, FILLER) == "token_run"  # the 4th in a row
    assert find_loop([1] * 126, 1, STOP, FILLER) is None  # filler: 127 in a row is fine
    assert find_loop([1] * 127, 1, STOP, FILLER) == "token_run"


def test_ngram_loops_need_a_word_and_enough_copies():
    pattern = [2, 3, 4]
    assert find_loop(pattern * 15 + [2, 3], 4, STOP, FILLER) == "ngram"  # 16th copy
    assert find_loop(pattern * 14 + [2, 3], 4, STOP, FILLER) is None
    assert find_loop([1, 5] * 40, 1, STOP, FILLER) == "ngram"
    fillers = bytes([0] + [1] * 31)  # now every id but 0 is filler
    assert find_loop([1, 5] * 40, 1, STOP, fillers) is None  # all filler: `|---` rules
    short = guard_settings(RepetitionGuardParams(ngram_copies=3), "stop")
    assert find_loop([7, 8, 7, 8, 7], 8, short, FILLER) == "ngram"
    off = guard_settings(RepetitionGuardParams(ngram_period=0), "stop")
    assert find_loop([2, 3] * 40, 2, off, FILLER) is None


def test_settings_take_the_engine_mode_unless_the_request_names_one():
    assert guard_settings(None, "retry").mode == "retry"
    assert guard_settings(RepetitionGuardParams(mode="off"), "retry").mode == "off"
    assert guard_settings(RepetitionGuardParams(token_run=9), "stop").token_run == 9


def test_a_sequence_gets_one_redraw_in_retry_mode():
    retry = GuardState(guard_settings(None, "retry"))
    assert retry.take_redraw() and not retry.take_redraw()
    assert not GuardState(STOP).take_redraw()


def test_invalid_guard_params_name_the_field():
    from kiln.sampling_params import SamplingParamsError
    for bad in ({"mode": "sometimes"}, {"token_run": 1}, {"ngram_period": 1}):
        with pytest.raises(SamplingParamsError) as err:
            RepetitionGuardParams(**bad)
        assert err.value.param == "repetition_guard"
