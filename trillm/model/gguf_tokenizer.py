"""A GGUF file's tokenizer: transformers' own GGUF conversion (its builder for each kind of
vocabulary), fed from the metadata trillm's reader already parsed.

Why not `PreTrainedTokenizerFast.from_pretrained(gguf_file=...)`, which converts the same way: it
reads the file's header again, each of the vocabulary's strings through a numpy slice, and where
a SentencePiece file keeps no merges (Llama 2, Mistral, Gemma) it recovers them in a loop that
sorts each token's candidates apart and then sorts them all with a key function: for Gemma 3's
262k tokens, most of its start-up. Here the strings come from one pass over the header
(`GGUFFile.strings`) and the merges from `derived_merges` (compiled: trillm/model/merges.pyx),
the same list from one sort. Where the builder only hands the vocabulary and those merges to a
tokenizer class (Gemma's and plain SentencePiece's), the class gets them as they are: through
the builder, the merges would go as "left right" strings, joined here and split there again, for
Gemma 3's 515k merges a fifth of a second. tests/test_gguf_tokenizer.py holds the result equal
to transformers' own, JSON for JSON.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from transformers import PreTrainedTokenizerFast
from transformers.integrations.gguf.gguf_tokenizer_mapping import (
    GGUF_TOKENIZER_MAPPING,
    GemmaTokenizer,
    LlamaTokenizer,
    add_gguf_special_tokens,
    gemma_tokenizer,
    select_tokenizer_builder,
    sentencepiece_tokenizer,
    set_split_regex,
)

from trillm.model.gguf_file import GGUFFile, StringCount
from trillm.model.merges import derived_merges

# the tokenizer's special tokens -> llama.cpp's keys for their ids (transformers' names for them)
SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                  "pad_token": "padding_token_id"}
SPACE_MARK = "\u2581"  # SentencePiece's space
# the arrays of strings read whole, as transformers' reader reads them; any other stays counted
STRING_ARRAYS = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.merges"})
# SentencePiece builders that make their tokenizer class of the vocabulary and its merges alone
BUILT_AS = {gemma_tokenizer: GemmaTokenizer, sentencepiece_tokenizer: LlamaTokenizer}


class Recovered(NamedTuple):
    """A SentencePiece vocabulary as its builder spells it (Gemma's respells a token of blanks as
    SentencePiece spaces), by place, and the merges it implies, best first."""

    vocab: dict[str, int]
    merges: list[tuple[str, str]]

    def spaced(self) -> bool:
        """Whether a merge has a part with a space in it, which the form a file keeps merges in,
        "left right", cannot carry."""
        spaced = {token for token in self.vocab if " " in token}  # most vocabularies have none
        return bool(spaced) and any(left in spaced or right in spaced for left, right in self.merges)


def build(file: GGUFFile) -> PreTrainedTokenizerFast:
    """The tokenizer transformers makes of the file (`tokenizer.ggml.*` must be present). Raises
    what transformers' builders raise for a vocabulary they cannot build (KeyError, ValueError,
    TypeError)."""
    architecture, fields, config = _fields(file)
    builder = select_tokenizer_builder(architecture, fields.get("tokenizer_type"))
    recovered = None
    if "merges" not in fields and fields.get("tokenizer_type") == "llama":
        recovered = _recovered(builder, fields)
    if recovered is not None and builder in BUILT_AS:
        tokenizer = BUILT_AS[builder](vocab=recovered.vocab, merges=recovered.merges)
        add_gguf_special_tokens(_BuiltOf(tokenizer, recovered.vocab), fields)
    else:
        if recovered is not None and not recovered.spaced():  # a builder that does more: the merges as a file keeps them
            tokenizer = builder(dict(fields, merges=[f"{left} {right}" for left, right in recovered.merges]))
        else:  # the file's own merges; or the builder recovers them itself
            tokenizer = builder(fields)
        tokenizer = add_gguf_special_tokens(tokenizer, fields)
    tokenizer = set_split_regex(tokenizer, fields)
    return PreTrainedTokenizerFast(tokenizer_object=_HandedOver(tokenizer.backend_tokenizer), **config)


class _BuiltOf:
    """A tokenizer for `add_gguf_special_tokens`, which asks for its whole vocabulary only to ask
    whether a few tokens are in it: a dict of every token, for Gemma 3's 262k a quarter of a
    second. Here the tokens it was built of answer, and its added tokens, asked of it once; the
    rest is the tokenizer's own."""

    def __init__(self, tokenizer, vocab: dict[str, int]):
        self.tokenizer, self.vocab, self.added = tokenizer, vocab, None

    def get_vocab(self) -> _BuiltOf:
        return self

    def __contains__(self, token: str) -> bool:
        if self.added is None:  # asked after the special tokens went in: they are among them
            self.added = {added.content for added in self.tokenizer.added_tokens_decoder.values()}
        return token in self.vocab or token in self.added

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)


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


def _recovered(builder: Callable, fields: dict) -> Recovered:
    """The vocabulary and the merges transformers' SentencePiece builders recover from a
    vocabulary without them. Gemma's builder spells a token of blanks as SentencePiece spaces and
    ranks merges by the token's place in the file; the others rank them by the token's score."""
    tokens = fields["tokens"]
    if builder is gemma_tokenizer:
        tokens = [SPACE_MARK * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(tokens)}
    if builder is gemma_tokenizer:  # by place
        return Recovered(vocab, derived_merges(vocab))
    return Recovered(vocab, derived_merges(vocab, dict(zip(tokens, fields["scores"]))))
