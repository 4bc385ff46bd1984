"""The OpenAI-compatible HTTP gateway (`kiln serve`); see docs/serving.md."""
