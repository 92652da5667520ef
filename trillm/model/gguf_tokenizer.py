"""A GGUF file's tokenizer: transformers' own GGUF conversion (its builder for each kind of
vocabulary), fed from the metadata trillm's reader already parsed.

Why not `PreTrainedTokenizerFast.from_pretrained(gguf_file=...)`, which converts the same way: it
reads the file's header again, each of the vocabulary's strings through a numpy slice, and where
a SentencePiece file keeps no merges (Llama 2, Mistral, Gemma) it recovers them in a loop that
sorts each token's candidates apart and then sorts them all with a key function: for Gemma 3's
262k tokens, most of its start-up. Here the strings come from one pass over the header
(`GGUFFile.strings`) and the merges from `derived_merges` (compiled: trillm/model/merges.pyx),
the same list from one sort. tests/test_gguf_tokenizer.py holds the result equal to
transformers' own, JSON for JSON.
"""
from __future__ import annotations

from transformers import PreTrainedTokenizerFast
from transformers.integrations.gguf import convert_gguf_tokenizer
from transformers.integrations.gguf.gguf_tokenizer_mapping import (
    GGUF_SENTENCEPIECE_BUILDERS,
    GGUF_TOKENIZER_MAPPING,
    gemma_tokenizer,
)

from trillm.model.gguf_file import GGUFFile, StringCount
from trillm.model.merges import derived_merges

# the tokenizer's special tokens -> llama.cpp's keys for their ids (transformers' names for them)
SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                  "pad_token": "padding_token_id"}
SPACE_MARK = "\u2581"  # SentencePiece's space
# the arrays of strings read whole, as transformers' reader reads them; any other stays counted
STRING_ARRAYS = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.merges"})


def build(file: GGUFFile) -> PreTrainedTokenizerFast:
    """The tokenizer transformers makes of the file (`tokenizer.ggml.*` must be present). Raises
    what transformers' builders raise for a vocabulary they cannot build (KeyError, ValueError,
    TypeError)."""
    architecture, fields, config = _fields(file)
    if "merges" not in fields and fields.get("tokenizer_type") == "llama":
        merges = _merge_strings(architecture, fields)
        if merges is not None:
            fields["merges"] = merges
    backend, extra = convert_gguf_tokenizer(architecture, fields)
    return PreTrainedTokenizerFast(tokenizer_object=_HandedOver(backend), **config, **extra)


class _HandedOver:
    """A tokenizer for `tokenizer_object` that no one else holds: the deep copy transformers makes
    of it is the tokenizer itself (a real one goes through its JSON: a second for 262k tokens)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __deepcopy__(self, memo):
        return self.tokenizer


def _fields(file: GGUFFile) -> tuple[str, dict, dict]:
    """(architecture, the builder's fields, the tokenizer's config), as transformers'
    `get_gguf_tokenizer` reads them from a file."""
    metadata = file.metadata

    def value(key: str):
        found = metadata[key]
        return file.strings(key) if isinstance(found, StringCount) and key in STRING_ARRAYS else found

    grouped = {group: {name: value(f"tokenizer.{key}") for key, name in renames.items()
                       if f"tokenizer.{key}" in metadata}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    fields, config = grouped["tokenizer"], grouped["tokenizer_config"]
    kind = fields.get("tokenizer_type")
    if kind == "llama":  # llama.cpp adds a BOS to a SentencePiece vocabulary that does not say otherwise
        config.setdefault("add_bos_token", True)
    elif kind == "gemma4":  # its chat template writes the BOS itself
        config["add_bos_token"] = False
    for name, key in SPECIAL_TOKENS.items():
        token = metadata.get(f"tokenizer.ggml.{key}")
        config[name] = fields["tokens"][token] if token is not None else None
    return metadata["general.architecture"], fields, config


def _merge_strings(architecture: str, fields: dict) -> list[str] | None:
    """The merges transformers' SentencePiece builders recover from a vocabulary without them,
    as "left right" strings, the form a file keeps them in; None where a part holds a space,
    which that form cannot (the builder then recovers them itself). Gemma's builder spells a
    token of blanks as SentencePiece spaces and ranks merges by the token's place in the file;
    the others rank them by the token's score."""
    tokens = fields["tokens"]
    if GGUF_SENTENCEPIECE_BUILDERS.get(architecture) is gemma_tokenizer:
        tokens = [SPACE_MARK * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores = {token: -index for index, token in enumerate(tokens)}
    else:
        scores = dict(zip(tokens, fields["scores"]))
    merges = derived_merges({t: i for i, t in enumerate(tokens)}, scores)
    spaced = {token for token in tokens if " " in token}  # most vocabularies have none: no pass over the merges
    if spaced and any(left in spaced or right in spaced for left, right in merges):
        return None
    return [f"{left} {right}" for left, right in merges]
