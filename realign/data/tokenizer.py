"""The tokenizer of a Hugging Face checkpoint folder (the actor's), loaded offline."""
from __future__ import annotations

from pathlib import Path

from realign.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(folder: str | Path, field: str = "models.actor", cls: str | None = None):
    """``transformers.AutoTokenizer`` from ``folder`` without touching the network; with
    ``cls`` (:func:`tokenizer_class` of the tokenizer AutoTokenizer chose for the same
    folder), that class of ``transformers`` built directly, which is the same tokenizer.

    AutoTokenizer imports the folder's model configuration class to choose the tokenizer
    class; for LLaMA's, that import pulls transformers' activations and kernels and with
    them TorchDynamo and TorchInductor (about 2 CPU-s a process). ``realign run`` chooses
    once, in ``prepare`` (``RunSpec.tokenizer_class``), and its workers build that class.

    Raises :class:`UserError` (at ``field``) when the folder is missing, holds no
    tokenizer files, or the tokenizer cannot be built from them."""
    p = Path(folder)
    if not p.is_dir():
        raise UserError(f"no such folder {str(p)!r} (expected a checkpoint folder holding a "
                        f"tokenizer)", field=field)
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise UserError(f"{str(p)!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                        f"save one there with tokenizer.save_pretrained(folder)", field=field)
    import transformers

    try:
        loader = transformers.AutoTokenizer if cls is None else getattr(transformers, cls)
        return loader.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # noqa: BLE001 (transformers raises OSError, ValueError,
        # KeyError ... for files it cannot read: each is the folder's problem)
        raise UserError(f"cannot load the tokenizer of {str(p)!r}: {type(e).__name__}: {e}",
                        field=field) from None


def tokenizer_class(tokenizer) -> str | None:
    """The name under which ``transformers`` exports ``tokenizer``'s class (for
    :func:`load_tokenizer`'s ``cls``); None when it exports no such class (a
    tokenizer of remote code), which leaves the choice to AutoTokenizer."""
    import transformers

    name = type(tokenizer).__name__
    return name if getattr(transformers, name, None) is type(tokenizer) else None


def model_tokenizer(ref: str, field: str):
    """:func:`load_tokenizer` of an experiment's model reference ``ref`` (a checkpoint
    folder or a file in one)."""
    p = Path(ref)
    return load_tokenizer(p if p.is_dir() else p.parent, field=field)


def pad_id(tokenizer) -> int:
    """The id that fills padded positions: the tokenizer's pad token, else its end token
    (LLaMA tokenizers have no pad token). Padded positions are always masked by
    ``lengths``, so the value never reaches a loss."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    raise UserError("the tokenizer has neither a pad nor an end-of-sequence token",
                    field="tokenizer")
