"""From what a user names (`LLM(speculator=...)`, `kiln serve --speculator`) to a config.

A speculator is named by:
  - a proposer that needs no files: "ngram";
  - a directory written by `kiln train-speculator` (its `speculator.json` says head or draft);
  - any HF checkpoint directory sharing the target's tokenizer (a draft model);
  - a preset name ("code-head", "prose-head", "code-draft"): a directory under
    `$KILN_HOME/speculators/` built by `kiln train-speculator --preset NAME`, else the one
    shipped with kiln for the default model (`kiln/spec/presets/NAME`), where there is one.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from kiln.config import SpeculativeConfig

SPECULATOR_FILE = "speculator.json"
FILE_FREE_METHODS = ("ngram",)
SHIPPED = Path(__file__).parent / "presets"  # heads trained for the default model, in the wheel


def speculators_home() -> Path:
    from kiln.models.default import kiln_home
    return kiln_home() / "speculators"


def resolve_speculative_config(speculator: str | None,
                               config: SpeculativeConfig | None = None
                               ) -> SpeculativeConfig | None:
    """The config for `speculator` (a name or directory), with `config`'s other fields and
    the method's defaults where they are None (`SpeculativeConfig.resolved`)."""
    if speculator is None:
        return config
    base = config or SpeculativeConfig()
    if speculator in FILE_FREE_METHODS:
        return dataclasses.replace(base, method=speculator, model=None).resolved()
    path = speculator_path(speculator)
    return dataclasses.replace(base, method=speculator_kind(path), model=str(path)).resolved()


def speculator_kind(path: Path) -> str:
    """head or draft, from the directory's speculator.json (an HF checkpoint is a draft)."""
    meta = path / SPECULATOR_FILE
    if meta.is_file():
        return json.loads(meta.read_text())["kind"]
    if (path / "config.json").is_file():
        return "draft"
    raise ValueError(f"{path} is neither a kiln speculator (no {SPECULATOR_FILE}) nor an HF "
                     f"checkpoint (no config.json)")


def speculator_path(name: str) -> Path:
    """The directory `name` stands for: itself, a preset trained here, or a shipped one."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    for home in (speculators_home(), SHIPPED):  # one trained here wins over the shipped one
        preset = home / name
        if preset.is_dir():
            return preset
    raise ValueError(f"speculator {name!r} is not a directory, a preset under "
                     f"{speculators_home()} or shipped with kiln (build one with `kiln "
                     f"train-speculator --preset {name}`), or one of "
                     f"{', '.join(FILE_FREE_METHODS)}")
