"""A GGUF file's tokenizer built from trillm's reader (trillm/model/gguf_tokenizer.py) is the one
transformers builds from the file itself, on each kind of vocabulary: byte-level BPE with its
merges (the default model), SentencePiece without merges ranked by place (Gemma 3's real file)
and by score (a Llama 2 style file written here)."""
import os

import pytest
from gguf import GGUFWriter, TokenType
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast
from transformers.integrations.gguf.gguf_tokenizer_mapping import sentencepiece_tokenizer
from transformers.tokenization_utils_base import generate_merges

from trillm.model import gguf_tokenizer
from trillm.model.gguf_file import GGUFFile
from trillm.model.loader import default_model_path

TEXTS = ["Hello, world!", "  two  spaces and\ttabs\n\nnew lines", "déjà vu 日本語 🙂", "ab▁ba aab", "",
         "a<think>b"]


def sentencepiece_gguf(path: str, spaced: bool = False) -> str:
    """A SentencePiece vocabulary without merges, as llama.cpp writes Llama 2's: control tokens,
    byte fallbacks, a user-defined token, and pieces whose scores tie, so that the recovered
    merges' order rests on every rule of their sort; `spaced`: with pieces holding a space, parts
    of merges too."""
    pieces = ["▁", "a", "b", "▁a", "▁b", "ab", "ba", "aa", "▁ab", "▁ba", "aab", "abb", "▁aab", "bab", "▁abb"]
    pieces += [" b", "a b", "a ba"] if spaced else []
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256)), "<think>", *pieces]
    scores = [0.0] * (3 + 256 + 1) + [-float(len(p) % 3) for p in pieces]  # few values: many ties
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, *[TokenType.BYTE] * 256,
             TokenType.USER_DEFINED, *[TokenType.NORMAL] * len(pieces)]
    writer = GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(params=["default", "gemma3", "sentencepiece", "sentencepiece-spaced"])
def gguf_path(request, tmp_path):
    if request.param == "default":
        return default_model_path()
    if request.param == "gemma3":
        return request.getfixturevalue("gemma3_gguf")
    return sentencepiece_gguf(str(tmp_path / "sentencepiece.gguf"), spaced=request.param.endswith("spaced"))


def test_the_tokenizer_is_the_one_transformers_builds_from_the_file(gguf_path):
    """The backend's JSON (vocabulary, merges, added tokens, normalizer, pre-tokenizer, decoder,
    post-processor), the special tokens and whether a BOS is added, and so every encoding."""
    folder, name = os.path.split(gguf_path)
    want = PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name, local_files_only=True)
    with GGUFFile(gguf_path) as file:
        got = gguf_tokenizer.build(file)
    assert got.backend_tokenizer.to_str() == want.backend_tokenizer.to_str()
    assert got.special_tokens_map == want.special_tokens_map
    assert (got.bos_token_id, got.eos_token_id, got.unk_token_id, got.pad_token_id) == \
        (want.bos_token_id, want.eos_token_id, want.unk_token_id, want.pad_token_id)
    assert got.chat_template == want.chat_template
    for text in TEXTS:
        assert got(text).input_ids == want(text).input_ids
        assert got.encode(text, add_special_tokens=False) == want.encode(text, add_special_tokens=False)


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.text(alphabet="ab▁é🙂", min_size=1, max_size=5), min_size=1, max_size=40),
       scores=st.lists(st.sampled_from([0.0, -1.0, -2.5, 3.0]), min_size=40, max_size=40))
def test_derived_merges_are_transformers_generate_merges(tokens, scores):
    """Any vocabulary (duplicates included: the last index and score win, the first place
    orders; strings of every width CPython stores), any scores with ties, or none (by place): the
    same merges in the same order."""
    vocab = {token: index for index, token in enumerate(tokens)}
    by_score = dict(zip(tokens, scores))
    assert gguf_tokenizer.derived_merges(vocab, by_score) == generate_merges(vocab, by_score)
    by_place = {token: -index for index, token in enumerate(tokens)}
    want = generate_merges(vocab, by_place)
    assert gguf_tokenizer.derived_merges(vocab, by_place) == want
    assert gguf_tokenizer.derived_merges(vocab) == want


@pytest.mark.parametrize("score", [float("nan"), 2**60 + 1])
def test_a_score_that_does_not_sort_as_a_float_is_refused(score):
    """The merges are ranked by the scores as floats: one that is not a number a float holds
    exactly (NaN, a large integer) would be ranked where Python's own sort would not put it."""
    with pytest.raises(ValueError, match="score"):
        gguf_tokenizer.derived_merges({"a": 0, "b": 1, "ab": 2}, {"ab": score})


def test_merges_with_a_space_in_a_part_are_seen_as_such():
    """A part holding a space cannot travel as "left right", the form a builder that does more
    than make its class (Phi-3's) takes merges in: there the builder recovers them itself."""
    fields = {"tokens": ["a", "b c", "ab c"], "scores": [0.0, 0.0, -1.0]}
    assert gguf_tokenizer._recovered(sentencepiece_tokenizer, fields).spaced()
    fields = {"tokens": ["a", "b", "c", "ab", "abc"], "scores": [0.0, 0.0, 0.0, -1.0, -2.0]}
    recovered = gguf_tokenizer._recovered(sentencepiece_tokenizer, fields)
    assert recovered.merges == [("a", "b"), ("ab", "c")] and not recovered.spaced()
    fields["tokens"].append("a c")  # a space in a token no merge has as a part
    fields["scores"].append(-3.0)
    assert not gguf_tokenizer._recovered(sentencepiece_tokenizer, fields).spaced()
