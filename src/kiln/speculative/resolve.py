"""From what a user names (`LLM(speculator=...)`, `kiln serve --speculator`) to a config.

A speculator is named by:
  - a proposer that needs no files: "ngram";
  - a directory written by `kiln train-speculator` (its `speculator.json` says head or draft);
  - any HF checkpoint directory sharing the target's tokenizer (a draft model);
  - a preset name ("code-head", "prose-head", "code-draft"): a directory under
    `$KILN_HOME/speculators/` built by `kiln train-speculator --preset NAME`, else the one
    shipped with kiln for the default model (`kiln/speculative/presets/NAME`), where there is one.

Or by a dict (`LLM(speculative_config={...})`, `kiln serve --speculative-config JSON`) in the
shape vLLM's `--speculative-config` takes: `method` (ngram, eagle/eagle3 for a kiln head,
draft_model; kiln's own names too), `model` (any of the names above), vLLM's
`num_speculative_tokens`, `prompt_lookup_min/max` and `disable_by_batch_size`, and any of
`SpeculativeConfig`'s own fields (`tree_size`, `adaptive`, ...). A key kiln does not know, a
method it does not have, or a value of the wrong type is a ValueError naming it.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Mapping
from pathlib import Path

from kiln.config_speculative import SpeculativeConfig

SPECULATOR_FILE = "speculator.json"
FILE_FREE_METHODS = ("ngram",)
SHIPPED = Path(__file__).parent / "presets"  # heads trained for the default model, in the wheel


def speculators_home() -> Path:
    from kiln.models.default import kiln_home
    return kiln_home() / "speculators"


def resolve_speculative_config(speculator: str | None,
                               config: SpeculativeConfig | Mapping | None = None
                               ) -> SpeculativeConfig | None:
    """The config for `speculator` (a name or directory), with `config`'s other fields and
    the method's defaults where they are None (`SpeculativeConfig.resolved`). `config` may be
    a vLLM-style dict (`speculative_config_from_dict`), which then names the speculator."""
    if config is not None and not isinstance(config, SpeculativeConfig):
        if speculator is not None:
            raise ValueError("name the speculator once: as speculator, or as the "
                             "speculative_config's method and model")
        return speculative_config_from_dict(config)
    if speculator is None:
        return config
    base = config or SpeculativeConfig()
    if speculator in FILE_FREE_METHODS:
        return dataclasses.replace(base, method=speculator, model=None).resolved()
    path = speculator_path(speculator)
    return dataclasses.replace(base, method=speculator_kind(path), model=str(path)).resolved()


# vLLM's method names -> kiln's proposers (an EAGLE head in kiln's own format: `kiln
# train-speculator --kind head` writes one; vLLM's EAGLE checkpoints are not read)
METHODS = {"ngram": "ngram", "eagle": "head", "eagle3": "head", "draft_model": "draft",
           "head": "head", "draft": "draft"}
# vLLM's keys -> SpeculativeConfig's fields
VLLM_KEYS = {"prompt_lookup_min": "ngram_min", "prompt_lookup_max": "ngram_max",
             "disable_by_batch_size": "max_batch_size"}


def speculative_config_from_dict(spec: Mapping) -> SpeculativeConfig:
    """A resolved config from a vLLM-style `speculative_config` dict (module docstring):
    `model` found and its kind checked against `method`, vLLM's keys mapped onto kiln's,
    every value type-checked (the dict may come straight from a command line)."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"speculative_config must be a JSON object, got {type(spec).__name__}")
    spec = dict(spec)
    fields = {f.name for f in dataclasses.fields(SpeculativeConfig)} - {"method", "model"}
    if (tp := spec.pop("draft_tensor_parallel_size", 1)) not in (1, None):
        raise ValueError(f"speculative_config: draft_tensor_parallel_size {tp!r}: kiln runs a "
                         "draft model on its target's worker (1 only)")
    method, model = spec.pop("method", None), spec.pop("model", None)
    values = {}
    for key, value in spec.items():
        name = VLLM_KEYS.get(key, key)
        if name not in fields:
            known = sorted(fields | set(VLLM_KEYS) | {"method", "model",
                                                       "draft_tensor_parallel_size"})
            raise ValueError(f"speculative_config: unknown key {key!r} (known: "
                             f"{', '.join(known)})")
        if name in values:
            raise ValueError(f"speculative_config: {key!r} and {name!r} are the same setting")
        _check_type(key, name, value)
        values[name] = value
    if "ngram_min" in values and "ngram_max" not in values:  # never an inverted default
        values["ngram_max"] = max(values["ngram_min"], SpeculativeConfig.ngram_max)
    for key, value in (("method", method), ("model", model)):
        if value is not None and not isinstance(value, str):
            raise ValueError(f"speculative_config: {key} must be a string, got {value!r}")
    if method is not None and method not in METHODS:
        raise ValueError(f"speculative_config: method {method!r} is not one kiln has (one of "
                         f"{', '.join(METHODS)})")
    kind = METHODS.get(method)
    if kind == "ngram" or (kind is None and model in FILE_FREE_METHODS):
        if model is not None and model not in FILE_FREE_METHODS:
            raise ValueError("speculative_config: method 'ngram' (prompt lookup) takes no model")
        return SpeculativeConfig(method="ngram", **values).resolved()
    if model is None:
        raise ValueError("speculative_config: needs a 'model' (a speculator directory or "
                         "preset, or a draft checkpoint) or method 'ngram'")
    try:
        path = speculator_path(model)
        found = speculator_kind(path)
    except ValueError as exc:
        raise ValueError(f"speculative_config: model: {exc}") from None
    if kind is not None and kind != found:
        wanted = "a kiln head (kiln train-speculator --kind head)" if kind == "head" else (
            "a draft model")
        raise ValueError(f"speculative_config: method {method!r} wants {wanted}, but model "
                         f"{model!r} is a {found}")
    return SpeculativeConfig(method=found, model=str(path), **values).resolved()


def _check_type(key: str, name: str, value) -> None:
    """`value` is of the type SpeculativeConfig declares for `name` (bool is not an int)."""
    hint = typing.get_type_hints(SpeculativeConfig)[name]
    allowed = tuple(typing.get_args(hint)) or (hint,)
    if type(value) not in allowed:  # noqa: E721 (exact: True is not an int here)
        wanted = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
        raise ValueError(f"speculative_config: {key} must be {wanted}, got {value!r}")


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
