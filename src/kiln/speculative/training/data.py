"""Training data for speculators: text corpora, token chunks, and the target's view of them.

Two built-in domains come from files every Python installation has, so anyone can rebuild
the shipped speculators byte for byte on their own machine:
  code   the standard library's own source (`sysconfig` stdlib dir; no site-packages, no tests)
  prose  the Python documentation's reStructuredText sources as Debian's `python3-doc`
         installs them, reduced to running prose; without the package, the reference text
         in `pydoc_data/topics.py` (what `help()` shows), reflowed
A deterministic split by file or topic name keeps 1 in 10 aside (`split="heldout"`) for
benchmark prompts, so a speculator is never measured on its own training text.

The target's view of a chunk of tokens is `TargetRecord`: per position its features (what
the head reads: the final hidden state and/or chosen layers' outputs) and its greedy choice
(the label the speculator learns: what the target itself would say next).
"""

from __future__ import annotations

import hashlib
import json
import re
import sysconfig
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

DOMAINS = ("code", "prose")
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")


def _heldout(name: str) -> bool:
    return hashlib.sha256(name.encode()).digest()[0] % 10 == 0


def _keep(name: str, split: str) -> bool:
    return _heldout(name) == (split == "heldout")


def code_corpus(split: str = "train") -> list[str]:
    """Standard-library source files (sorted by path), minus tests and site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3")
    texts = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(part in skip for part in path.relative_to(root).parts) or not _keep(rel, split):
            continue
        texts.append(path.read_text(encoding="utf-8", errors="replace"))
    return texts


PYTHON_DOCS_SKIP = ("whatsnew/changelog", "includes/", "license", "copyright", "contents",
                    "about", "bugs", "c-api/", "distutils/")
_ROLE = re.compile(r":[\w:.+-]+:`[~!]?([^`<]*?)\s*(?:<[^`>]*>)?`")  # :func:`~a.b <x>` -> a.b
_LINK = re.compile(r"`([^`<]*?)\s*(?:<[^`>]*>)?`__?")  # `text <url>`_ -> text
_FIELD = re.compile(r"^:[\w -]+:(\s|$)")  # a field list (":Author: ..."), not a role
_UNDERLINE = re.compile(r"^([=\-*~^#\"'+`:.])\1{2,}\s*$")


def python_docs_sources() -> Path | None:
    """The reStructuredText sources of the Python documentation, as Debian's `python3-doc`
    installs them (`/usr/share/doc/python3.X/html/_sources`; `$KILN_PROSE_DOCS` names
    another such directory), or None when absent."""
    import os

    if os.environ.get("KILN_PROSE_DOCS"):
        root = Path(os.environ["KILN_PROSE_DOCS"])
        if not root.is_dir():
            raise ValueError(f"KILN_PROSE_DOCS={root} is not a directory of .txt (reST) pages")
        return root
    roots = sorted(Path("/usr/share/doc").glob("python3*/html/_sources"),
                   key=lambda p: [int(x) for x in re.findall(r"\d+", p.parts[-3])])
    return roots[-1] if roots else None


def rst_prose(text: str) -> str:
    """The running prose of a reStructuredText page: its unindented paragraphs with inline
    markup reduced to its text, one paragraph per line pair; headings, directives, code
    blocks, tables and comments dropped."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.split("\n")
        if not lines[0].strip() or lines[0][0].isspace() or lines[0].startswith(
                ("..", ">>>", "|", "+-", "+=")) or _FIELD.match(lines[0]):
            continue
        if any(_UNDERLINE.match(line) for line in lines):  # a heading (perhaps with text)
            continue
        para = " ".join(line.strip() for line in lines)
        para = re.sub(r"^(?:[*\-+]|#\.|\d+[.)])\s+", "", para)  # a list item's bullet
        para = _ROLE.sub(r"\1", para)
        para = _LINK.sub(r"\1", para)
        para = para.replace("``", "").replace("**", "")
        para = re.sub(r"\s*::$", ":", para)
        para = " ".join(para.split())
        if len(para.split()) >= 8:
            paragraphs.append(para)
    return "\n\n".join(paragraphs)


def prose_corpus(split: str = "train") -> list[str]:
    """English prose: the Python documentation's pages (`python_docs_sources`, by path) as
    running text (`rst_prose`) when installed; else the pydoc topics (what `help()` shows,
    about 97 k tokens), sorted by topic name, reflowed (whitespace collapsed)."""
    root = python_docs_sources()
    if root is not None and root.is_dir():
        texts = []
        for path in sorted(root.rglob("*.txt")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith(PYTHON_DOCS_SKIP) or not _keep(rel, split):
                continue
            prose = rst_prose(path.read_text(encoding="utf-8", errors="replace"))
            if prose:
                texts.append(prose)
        return texts
    from pydoc_data.topics import topics

    return [" ".join(topics[name].split()) for name in sorted(topics) if _keep(name, split)]


def prose_source() -> str:
    """Which text `prose_corpus` reads on this machine (recorded with results)."""
    root = python_docs_sources()
    return f"python docs {root}" if root is not None and root.is_dir() else "pydoc topics"


def domain_corpus(domain: str, split: str = "train") -> list[str]:
    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}; built-in domains: {', '.join(DOMAINS)}")
    return code_corpus(split) if domain == "code" else prose_corpus(split)


def code_prompts(tok, n: int, tokens: int) -> list[list[int]]:
    """The first `tokens` tokens of held-out stdlib files that open with real code."""
    out = []
    for text in code_corpus("heldout"):
        body = text[text.find("\nimport"):] if "\nimport" in text else text
        ids = tok.encode(body.strip(), add_special_tokens=False)
        if len(ids) >= tokens:
            out.append(ids[:tokens])
        if len(out) == n:
            break
    return out


def prose_prompts(tok, n: int, tokens: int) -> list[list[int]]:
    """Consecutive `tokens`-token windows of the held-out prose texts, round robin (the
    first window of every text, then the second ones, ...: with the pydoc topics there
    are only 5 held-out texts, and batch 8 needs 8 prompts)."""
    docs = [tok.encode(text, add_special_tokens=False) for text in prose_corpus("heldout")]
    out = []
    for start in range(0, max(map(len, docs)), tokens):
        out += [ids[start:start + tokens] for ids in docs if len(ids) >= start + tokens]
    return out[:n]


def read_text_files(paths: Iterable[str]) -> list[str]:
    """Files, and text files under directories (.py .txt .md .rst), sorted."""
    texts = []
    for name in paths:
        path = Path(name)
        if not path.exists():
            raise FileNotFoundError(f"no such file or directory: {name}")
        files = [path] if path.is_file() else sorted(
            p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
        texts.extend(f.read_text(encoding="utf-8", errors="replace") for f in files)
    return texts


def read_prompts(path: str) -> list[str | list[dict]]:
    """One prompt per line, or JSONL with "prompt" (text) or "messages" (a chat) per line."""
    prompts: list[str | list[dict]] = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            row = json.loads(line)
            prompts.append(row["messages"] if "messages" in row else row["prompt"])
        else:
            prompts.append(line)
    return prompts


def chunk_tokens(token_lists: Iterable[list[int]], seq_len: int,
                 max_tokens: int | None = None) -> torch.Tensor:
    """Concatenate documents and cut [N, seq_len] chunks (a ragged tail is dropped)."""
    flat: list[int] = []
    for tokens in token_lists:
        flat.extend(tokens)
        if max_tokens is not None and len(flat) >= max_tokens:
            break
    flat = flat[:max_tokens] if max_tokens is not None else flat
    n = len(flat) // seq_len
    if n == 0:
        raise ValueError(f"not enough text: {len(flat)} tokens, need at least {seq_len}")
    return torch.tensor(flat[:n * seq_len]).view(n, seq_len)


def tokenize_documents(tokenizer, texts: Iterable[str]) -> Iterable[list[int]]:
    for text in texts:
        yield tokenizer.encode(text, add_special_tokens=False)


def continuation_prompts(token_lists: Iterable[list[int]], n: int, prompt_tokens: int,
                         seed: int = 0) -> list[list[int]]:
    """Up to `n` windows of `prompt_tokens` tokens, at seeded random offsets, taken round
    robin over the documents (one window per document per round, so short corpora still
    give many distinct openings): the prompts for self-distillation from a corpus."""
    import random

    docs = [t for t in token_lists if len(t) >= prompt_tokens]
    if not docs:
        raise ValueError(f"no document has the {prompt_tokens} tokens a prompt needs")
    rng, out = random.Random(seed), []
    max_rounds = max(len(t) // prompt_tokens for t in docs)
    for _ in range(max_rounds):
        for tokens in docs:
            start = rng.randrange(len(tokens) - prompt_tokens + 1)
            out.append(tokens[start:start + prompt_tokens])
            if len(out) == n:
                return out
    return out


def generate_answers(llm, prompts: list, max_tokens: int, ignore_eos: bool = False,
                     show_progress: bool = True) -> list[list[int]]:
    """Prompt + the target's own greedy answer, as token ids (self-distillation data).
    Prompts are text, token-id lists, or chats (lists of messages). With `ignore_eos`
    every answer has exactly `max_tokens` tokens (continuations of raw text)."""
    from kiln.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    chats = [p for p in prompts if isinstance(p, list) and p and isinstance(p[0], dict)]
    plain = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts
             if not (isinstance(p, list) and p and isinstance(p[0], dict))]
    outs = (llm.generate(plain, params, use_tqdm=show_progress) if plain else []) + (
        llm.chat(chats, params, use_tqdm=show_progress) if chats else [])
    return [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]


def continue_openings(llm, tokenizer, texts: list[str], n: int, prompt_tokens: int,
                      answer_tokens: int, seed: int,
                      progress: Callable[[int, int], None] | None = None,
                      batch: int = 128) -> list[list[int]]:
    """Self-distillation from a corpus: `n` openings of `prompt_tokens` tokens cut from the
    texts at seeded offsets (`continuation_prompts`), each continued greedily by the target
    `llm` for exactly `answer_tokens`, so the speculator learns the target's own text. It
    generates in at most ~8 slices of whole batches of `batch` sequences (every continuation
    is as long) and calls `progress(done, total)` before the first and after each."""
    prompts = continuation_prompts(tokenize_documents(tokenizer, texts), n, prompt_tokens, seed)
    slice_len = batch * max(1, -(-len(prompts) // (8 * batch)))
    answers: list[list[int]] = []
    if progress is not None:
        progress(0, len(prompts))
    for start in range(0, len(prompts), slice_len):
        answers += generate_answers(llm, prompts[start:start + slice_len], answer_tokens,
                                    ignore_eos=True, show_progress=False)
        if progress is not None:
            progress(len(answers), len(prompts))
    return answers


@dataclass
class TargetRecord:
    """The target's view of N chunks of S tokens."""

    tokens: torch.Tensor  # [N, S] int64
    features: torch.Tensor  # [N, S, n_feat * H] in the target's dtype
    labels: torch.Tensor  # [N, S] int64: the target's greedy choice after each position

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file
        save_file({"tokens": self.tokens, "features": self.features.contiguous(),
                   "labels": self.labels}, str(path))

    @classmethod
    def load(cls, path: Path) -> TargetRecord:
        from safetensors.torch import load_file
        t = load_file(str(path))
        return cls(t["tokens"], t["features"], t["labels"])


@torch.inference_mode()
def record_target(runner, chunks: torch.Tensor, feature_layers: tuple[int, ...],
                  batch_size: int = 4, progress: Callable[[int], None] | None = None
                  ) -> TargetRecord:
    """Run the target (a ModelRunner) over each chunk as a fresh prompt; keep its features
    and greedy choices. Uses a scratch KV cache of batch_size x S slots."""
    from kiln.models.layers.attention import SeqLayout
    from kiln.speculative.head.model import FeatureTap

    n, seq_len = chunks.shape
    bs = runner.kv_spec.block_size
    blocks_per_seq = -(-seq_len // bs)
    runner.allocate_kv_cache(batch_size * blocks_per_seq)
    tap = FeatureTap(runner.model, feature_layers)
    features, labels = [], []
    for lo in range(0, n, batch_size):
        batch = chunks[lo:lo + batch_size]
        b = len(batch)
        layout = SeqLayout(torch.arange(b) * seq_len, torch.full((b,), seq_len),
                           torch.zeros(b, dtype=torch.int64),
                           torch.arange(b * blocks_per_seq).view(b, blocks_per_seq))
        positions = torch.arange(seq_len).repeat(b)
        meta = runner.backend.build_metadata(layout, positions, bs)
        hidden = runner.model(batch.reshape(-1), positions, runner.kv_caches, meta)
        every = torch.arange(b * seq_len)
        features.append(tap.features(hidden, every).view(b, seq_len, -1).clone())
        labels.append(_greedy(runner.model, hidden).view(b, seq_len))
        if progress is not None:
            progress(b * seq_len)
    return TargetRecord(chunks, torch.cat(features), torch.cat(labels))


def _greedy(model, hidden: torch.Tensor, rows: int = 512) -> torch.Tensor:
    """argmax of the LM head, computed in slices (full-vocabulary logits are large)."""
    return torch.cat([model.compute_logits(hidden[i:i + rows]).argmax(dim=-1)
                      for i in range(0, len(hidden), rows)])
