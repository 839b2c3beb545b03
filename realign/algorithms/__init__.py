"""RLHF algorithms as pure torch functions: one small module per algorithm.

Each algorithm's hyper-parameters are typed in :mod:`realign.algorithms.params` (torch-free,
so a prepared run carries them to every process); its module holds the
``prepare(batch, cfg)`` step that turns scored rollouts into training targets
(advantages, returns, masks; the rows to train when it selects some:
:mod:`realign.algorithms.selection`) inside the train call, and the loss functions the training
engine calls per micro-batch: ``loss_fn(outputs, micro_batch) -> (loss, metrics)``.
:mod:`realign.algorithms.registry` names them. Nothing here starts processes or
touches process groups.

Batch keys (rows = sequences): ``tokens`` [b, s], ``lengths`` [b], ``prompt_lengths``
[b], ``logprobs`` / ``ref_logprobs`` [b, s-1], ``rewards`` [b], ``values`` [b, s],
``advantages`` / ``returns`` [b, s-1]. Log-prob position ``t`` scores token ``t+1``;
response tokens are ``prompt_len .. length-1``, so position ``t`` is a response
position iff ``prompt_len - 1 <= t < length - 1`` (:func:`common.response_mask`).
Preference pairs (DPO, reward modelling) are interleaved rows: 2i chosen, 2i+1
rejected.
"""
