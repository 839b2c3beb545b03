"""Tiny offline assets (tokenizer, random models, arithmetic datasets) for CPU runs
and tests; see :mod:`realign.assets.tiny`. Importing this package imports nothing heavy."""
