"""The EAGLE-style draft head: its model (`model.py`), its paged KV cache and draft rows
(`kv.py`), and the proposer that drafts with it during decoding (`proposer.py`)."""
