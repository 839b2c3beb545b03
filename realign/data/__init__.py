"""Datasets for ``realign run``: the dataset config, JSONL loaders that check every
line, the actor's tokenizer, a resumable sampler and collation into padded tensors.

Torch is needed only by :mod:`realign.data.collate`; ``transformers`` only by
:func:`realign.data.tokenizer.load_tokenizer`. Import from the submodules:

* :mod:`realign.data.config` — ``DatasetConfig``
* :mod:`realign.data.datasets` — ``load_dataset``, the example types, ``Dataset``
* :mod:`realign.data.tokenizer` — ``load_tokenizer``, ``pad_id``
* :mod:`realign.data.sampler` — ``PromptSampler``
* :mod:`realign.data.collate` — ``collate_prompts``, ``collate_preferences``,
  ``collate_sft``, ``response_mask``
* :mod:`realign.data.errors` — ``DataError`` (a ``UserError`` with file, line, key)
"""
