"""The model side: the base and its LoRA adapters, the built-in base, evaluation and generation, and how
launched processes share the model (``parallel.py``)."""
