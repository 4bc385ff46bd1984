"""The built-in prose domain: the Python documentation's reST sources reduced to prose."""

from __future__ import annotations

import pytest

from kiln.speculative.training import data

PAGE = """\
.. _tut-if:

:Author: Someone

:keyword:`!if` Statements
=========================

Perhaps the most well-known statement is the :keyword:`if` statement. It reads
:func:`~os.path.join` and :class:`a list <typing.List>`, see `the docs <http://x>`_ and
``x = 1``. For example::

   >>> x = int(input("Please enter an integer: "))

* A bullet item with more than enough words to be kept as prose here.

1) A numbered item that also has more than enough words to be kept.

.. note::

   An indented directive body, dropped with its directive.

Too short to keep.
"""


def test_rst_prose_keeps_paragraphs_and_the_text_of_inline_markup():
    prose = data.rst_prose(PAGE)
    assert prose.split("\n\n") == [
        "Perhaps the most well-known statement is the if statement. It reads os.path.join "
        "and a list, see the docs and x = 1. For example:",
        "A bullet item with more than enough words to be kept as prose here.",
        "A numbered item that also has more than enough words to be kept.",
    ]


def _docs(tmp_path, names):
    for name in names:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(PAGE.replace("well-known", f"well-known ({name})"))
    return tmp_path


def test_prose_corpus_reads_the_docs_split_by_page_and_skips_the_changelog(tmp_path,
                                                                           monkeypatch):
    names = [f"library/mod{i}.rst.txt" for i in range(40)] + ["whatsnew/changelog.rst.txt",
                                                              "c-api/list.rst.txt"]
    monkeypatch.setenv("KILN_PROSE_DOCS", str(_docs(tmp_path, names)))
    train, heldout = data.prose_corpus("train"), data.prose_corpus("heldout")
    assert train and heldout and len(train) + len(heldout) == 40  # split, nothing dropped
    assert not set(train) & set(heldout)
    assert not any("changelog" in t or "c-api" in t for t in train + heldout)
    assert data.prose_source() == f"python docs {tmp_path}"


def test_prose_corpus_falls_back_to_the_pydoc_topics(monkeypatch):
    monkeypatch.delenv("KILN_PROSE_DOCS", raising=False)
    monkeypatch.setattr(data, "python_docs_sources", lambda: None)  # no python3-doc here
    assert data.prose_source() == "pydoc topics"
    texts = data.prose_corpus("train")
    assert len(texts) > 50 and all("\n" not in t for t in texts)  # reflowed topics


def test_the_record_cache_tells_the_prose_sources_apart(tmp_path, monkeypatch):
    """A target record self-distilled from the pydoc topics is not reused for the docs."""
    import argparse

    from kiln.speculative.training.cli import _Plan, _record_cache

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    args = argparse.Namespace(
        prompts=None, data=None, domain="prose", max_tokens=4096, seq_len=256, doc_tokens=2048,
        feature_layers=[-1], seed=0, dtype="auto", self_distill=True, prompt_tokens=96,
        answer_tokens=160, epochs=None, batch_size=8, lr=None, ttt_steps=3,
        draft_vocab_size=4096, head_intermediate_size=None, draft_layers=2)
    plan = _Plan("head", tmp_path / "model", tmp_path / "out", "domain prose", args)
    monkeypatch.delenv("KILN_PROSE_DOCS", raising=False)
    monkeypatch.setattr(data, "python_docs_sources", lambda: None)
    keys = [_record_cache(plan)]  # the pydoc topics
    monkeypatch.undo()
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KILN_PROSE_DOCS", str(_docs(tmp_path / "docs", ["library/a.rst.txt"])))
    keys.append(_record_cache(plan))
    assert keys[0] != keys[1] and keys[0].parent == keys[1].parent


def test_a_wrong_kiln_prose_docs_is_an_error_not_a_silent_fallback(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_PROSE_DOCS", str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="KILN_PROSE_DOCS"):
        data.prose_corpus("train")


def test_presets_carry_their_own_token_counts(tmp_path):
    """--preset prose-head and code-head self-distill 1,048,576 tokens and train 12 and 10
    epochs (then later stages), code-draft 524,288 and its kind's default,
    unless --max-tokens / --epochs say otherwise."""
    import argparse

    from kiln.speculative.training.cli import PRESETS, _apply_preset, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())

    def tokens(*argv):
        args = parser.parse_args(["train-speculator", *argv, "--out", str(tmp_path)])
        _apply_preset(args)
        return args.max_tokens, args.kind, args.domain, args.epochs

    assert tokens("--preset", "prose-head") == (1048576, "head", "prose", 12)
    assert tokens("--preset", "code-head") == (1048576, "head", "code", 10)
    assert tokens("--preset", "code-draft") == (524288, "draft", "code", None)
    # both head presets go on to the same second stage, the prose head to two more, on
    # other windows each; a draft model has none
    code, prose = PRESETS["code-head"].refine, PRESETS["prose-head"].refine
    assert len(code) == 1 and len(prose) == 3 and code[0] == prose[0]
    assert len({stage.seed for stage in prose}) == 3 and 0 not in {s.seed for s in prose}
    assert PRESETS["code-draft"].refine == ()
    assert tokens("--preset", "prose-head", "--max-tokens", "4096")[0] == 4096
    assert tokens("--preset", "prose-head", "--epochs", "2")[3] == 2
