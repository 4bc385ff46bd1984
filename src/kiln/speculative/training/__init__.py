"""Training speculators on a deployment's own kind of traffic: corpora and the target's view of
them (`data.py`), the trainers (`train.py`) and `kiln train-speculator` (`cli.py`)."""
