"""The text quantization is measured on: calibration (drives layer selection) and held-out
(judges the result), as fixed-length token windows.

With no text file given, kiln uses a built-in mix that every Python install carries, so the
numbers are reproducible without downloads:
  - code: Python standard library sources (`sysconfig.get_paths()["stdlib"]`); calibration
    and held-out read different modules (CALIB_MODULES, HELDOUT_MODULES);
  - prose: the Python documentation's reference prose (`pydoc_data.topics.topics`, the text
    `help("if")` shows); calibration takes the topics at even positions in sorted order,
    held-out those at odd positions.
Half the windows are code and half prose, alternating (so the first k windows, which
sensitivity measurements use, are a mix too). Windows are spread evenly over each split's token
stream (not its first tokens, which are licence headers), so the two splits share no text and
the choice depends only on the Python version's stdlib (3.11 for the recorded results).
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch

CALIB_MODULES = ("textwrap.py", "heapq.py", "fractions.py", "calendar.py", "queue.py")
HELDOUT_MODULES = ("shlex.py", "statistics.py", "graphlib.py", "difflib.py", "glob.py")


class Split(str, Enum):
    CALIBRATION = "calibration"
    HELDOUT = "held-out"


@dataclass(frozen=True)
class TextSpec:
    """How many windows of how many tokens, from a file or the built-in mix."""

    windows: int = 8
    window_tokens: int = 512
    file: Path | None = None  # plain UTF-8 text; None = the built-in code + prose mix

    def __post_init__(self):
        if self.windows < 1 or self.window_tokens < 2:
            raise ValueError(f"need >= 1 window of >= 2 tokens, got {self.windows} x "
                             f"{self.window_tokens}")


def builtin_texts(split: Split) -> tuple[str, str]:
    """(code, prose) of one split of the built-in mix."""
    from pydoc_data.topics import topics

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    modules = CALIB_MODULES if split is Split.CALIBRATION else HELDOUT_MODULES
    code = "\n\n".join((stdlib / name).read_text(encoding="utf-8") for name in modules)
    start = 0 if split is Split.CALIBRATION else 1
    prose = "\n\n".join(topics[key] for key in sorted(topics)[start::2])
    return code, prose


def token_windows(tokenizer, spec: TextSpec, split: Split, part: int = 0,
                  parts: int = 1) -> torch.Tensor:
    """Token ids [windows, window_tokens] of `split` (a file serves both splits: calibration
    takes windows from its first half, held-out from its second).

    part, parts: the split's windows are cut `parts` times as many and dealt round-robin;
    this call returns deal `part`. Parts share no text (GPTQ rounds on one part of the
    calibration text while layer selection measures on another).
    """
    if spec.file is not None:
        ids = _encode(tokenizer, Path(spec.file).read_text(encoding="utf-8"))
        half = len(ids) // 2
        ids = ids[:half] if split is Split.CALIBRATION else ids[half:]
        return spread_windows(ids, spec.windows * parts, spec.window_tokens)[part::parts]
    code, prose = (_encode(tokenizer, text) for text in builtin_texts(split))
    n_code = (spec.windows + 1) // 2
    code_w = spread_windows(code, n_code * parts, spec.window_tokens)[part::parts]
    prose_w = spread_windows(prose, (spec.windows - n_code) * parts,
                             spec.window_tokens)[part::parts]
    order = [w for pair in zip(code_w[:len(prose_w)], prose_w, strict=True) for w in pair]
    return torch.stack(order + list(code_w[len(prose_w):]))  # code, prose, code, ...


def spread_windows(ids: list[int], count: int, length: int) -> torch.Tensor:
    """`count` windows of `length` tokens at evenly spaced, non-overlapping offsets of `ids`."""
    if count == 0:
        return torch.empty(0, length, dtype=torch.int64)
    if len(ids) < count * length:
        raise ValueError(f"text has {len(ids)} tokens; {count} windows of {length} need "
                         f"{count * length}")
    stride = (len(ids) - length) // max(1, count - 1) if count > 1 else 0
    return torch.tensor([ids[i * stride:i * stride + length] for i in range(count)])


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]
