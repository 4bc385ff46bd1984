"""kiln: an LLM inference server. Offline API: `from kiln import LLM, SamplingParams`."""

from kiln.sampling_params import SamplingParams
from kiln.version import __version__

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from kiln.llm import LLM
        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        import kiln.outputs
        return getattr(kiln.outputs, name)
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")
