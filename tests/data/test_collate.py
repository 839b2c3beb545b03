"""Collation into right-padded int64 tensors in the engines' batch format."""
from __future__ import annotations

import pytest
import torch

from realign.data.collate import collate_preferences, collate_prompts, collate_sft, pad_right, response_mask
from realign.data.datasets import PreferenceExample, PromptExample, SFTExample

pytestmark = pytest.mark.torch

PAD = 0


def test_prompts():
    b = collate_prompts([PromptExample(1, "a", "1", [1, 5, 6]),
                         PromptExample(2, "b", None, [1, 7])], PAD)
    assert b["tokens"].dtype == torch.long and b["lengths"].dtype == torch.long
    assert b["tokens"].tolist() == [[1, 5, 6], [1, 7, PAD]]
    assert b["lengths"].tolist() == [3, 2]


def test_preferences_interleave_chosen_and_rejected():
    ex = [PreferenceExample(1, "p", [1, 5], [8, 2], [9, 9, 9, 2]),
          PreferenceExample(2, "q", [1, 5, 6], [7, 2], [4, 2])]
    b = collate_preferences(ex, PAD)
    assert set(b) == {"tokens", "lengths", "prompt_lengths"}
    assert b["tokens"].shape == (4, 6)
    assert b["tokens"].tolist() == [[1, 5, 8, 2, PAD, PAD],     # pair 0 chosen
                                    [1, 5, 9, 9, 9, 2],         # pair 0 rejected
                                    [1, 5, 6, 7, 2, PAD],       # pair 1 chosen
                                    [1, 5, 6, 4, 2, PAD]]       # pair 1 rejected
    assert b["lengths"].tolist() == [4, 6, 5, 5]
    assert b["prompt_lengths"].tolist() == [2, 2, 3, 3]
    mask = response_mask(b)
    assert mask[0].tolist() == [False, False, True, True, False, False]
    assert mask.sum(1).tolist() == [2, 4, 2, 2]


def test_sft():
    b = collate_sft([SFTExample(1, [1, 5], [6, 2]), SFTExample(2, [1], [3, 4, 2])], PAD)
    assert b["tokens"].tolist() == [[1, 5, 6, 2], [1, 3, 4, 2]]
    assert b["prompt_lengths"].tolist() == [2, 1] and b["lengths"].tolist() == [4, 4]
    assert all(v.shape[0] == 2 and v.dtype == torch.long for v in b.values())


def test_pad_value_and_real_dataset(tiny_assets, tokenizer):
    from realign.data.config import DatasetConfig
    from realign.data.datasets import load_dataset
    from realign.data.sampler import PromptSampler
    from realign.data.tokenizer import pad_id

    tokens, lengths = pad_right([[3], [4, 4, 4]], pad_id=-1)
    assert tokens.tolist() == [[3, -1, -1], [4, 4, 4]]
    ds = load_dataset(DatasetConfig(path=str(tiny_assets["prefs"]), kind="preferences"),
                      tokenizer)
    s = PromptSampler(len(ds), 8, seed=0)
    b = collate_preferences(ds.take(s.next_batch()), pad_id(tokenizer))
    assert b["tokens"].shape[0] == 16
    rows = b["tokens"][torch.arange(16), b["lengths"] - 1]
    assert (rows == tokenizer.eos_token_id).all()             # every row ends with </s>
    assert int(b["tokens"].max()) < len(tokenizer)
