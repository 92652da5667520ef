"""The incremental detokenizer against whole-sequence decodes, and its stop strings.

Three tokenizers: the default model's (SmolLM2, byte-level BPE); a pure byte
tokenizer, where every character beyond ASCII is split over several tokens; and a
SentencePiece-style one (byte fallback, a decoder that strips the first token's
leading space), where decoding the output alone would lose the first space.
"""
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from trillm.engine.detokenizer import PROMPT_WINDOW, IncrementalDetokenizer
from trillm.sampling_params import SamplingParams

CHAT_PROMPT = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
PIECES = ["🤖", "👍🏽", "🧑‍🚀", "🇯🇵", "世界", "こんにちは", "é", "Ω"]
PIECES += [" ", "  ", "\n", "\n\n", "\t", "the", " world", "<|im_end|>"]
texts = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=4)), max_size=12).map("".join)
prompts = st.sampled_from(["", CHAT_PROMPT, "日本", "x 🤖", "<|im_end|>"])
property_settings = settings(max_examples=60, deadline=None)


@pytest.fixture(scope="session")
def smollm2(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="session")
def byte_tokenizer():
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="session")
def sentencepiece_tokenizer():
    words = ["▁", "▁world", "▁hello", "hello", "▁the", "▁a", "a", "e", "h", "l", "o", "r", "w", "d"]
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + words
    vocab = [(p, -5.0 if p.startswith("<") or len(p) == 1 else -1.0) for p in pieces]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


class Wrapped:
    """A tokenizer (or a part of one) seen through a wrapper that may change some of it."""

    def __init__(self, wrapped):
        self.wrapped = wrapped

    def __getattr__(self, name):
        return getattr(self.wrapped, name)

    def __len__(self):
        return len(self.wrapped)


def stream(tokenizer, prompt_ids, output_ids, params, chunk_sizes=None):
    """Feeds output_ids a chunk at a time (sizes cycle through chunk_sizes); returns (detokenizer, chunks)."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    sizes = chunk_sizes or [1]
    chunks, i, step = [], 0, 0
    while i < len(output_ids):
        size = sizes[step % len(sizes)]
        chunks.append(detok.add(output_ids[i : i + size]))
        i, step = i + size, step + 1
    chunks.append(detok.flush())
    return detok, chunks


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def check_streamed_decode(tokenizer, prompt_ids, output_ids, skip_special_tokens, chunk_sizes):
    params = SamplingParams(skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=False)
    detok, chunks = stream(tokenizer, prompt_ids, output_ids, params, chunk_sizes)
    full = tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
    assert detok.output_text == full
    assert "".join(chunks) == detok.output_text
    if "\ufffd" not in full:  # a character missing from the vocabulary decodes to U+FFFD
        assert not any("\ufffd" in c for c in chunks)


@property_settings
@given(prompt=prompts, text=texts, skip=st.booleans(), chunk_sizes=st.lists(st.integers(1, 3), min_size=1, max_size=4))
def test_smollm2_stream_equals_full_decode(smollm2, prompt, text, skip, chunk_sizes):
    prompt_ids, output_ids = encode(smollm2, prompt), encode(smollm2, text)
    check_streamed_decode(smollm2, prompt_ids, output_ids, skip, chunk_sizes)


@property_settings
@given(prompt=prompts, text=texts, skip=st.booleans(), chunk_sizes=st.lists(st.integers(1, 3), min_size=1, max_size=4))
def test_byte_tokenizer_stream_equals_full_decode(byte_tokenizer, prompt, text, skip, chunk_sizes):
    prompt_ids, output_ids = encode(byte_tokenizer, prompt), encode(byte_tokenizer, text)
    check_streamed_decode(byte_tokenizer, prompt_ids, output_ids, skip, chunk_sizes)


@property_settings
@given(
    prompt_ids=st.lists(st.integers(0, 256), max_size=8),
    output_ids=st.lists(st.integers(0, 260), max_size=30),  # 257.. lie past the vocabulary: no text
    skip=st.booleans(),
    chunk_sizes=st.lists(st.integers(1, 3), min_size=1, max_size=4),
)
def test_arbitrary_byte_ids_stream_equals_full_decode(byte_tokenizer, prompt_ids, output_ids, skip, chunk_sizes):
    """Invalid UTF-8 included: a lone continuation byte, a lead byte never completed."""
    # The prompt's tail must end on a character boundary for its text not to merge with the output's.
    prompt_ids = encode(byte_tokenizer, byte_tokenizer.decode(prompt_ids).replace("\ufffd", "?"))
    params = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=False)
    detok, chunks = stream(byte_tokenizer, prompt_ids, output_ids, params, chunk_sizes)
    assert detok.output_text == byte_tokenizer.decode(output_ids, skip_special_tokens=skip)
    assert "".join(chunks) == detok.output_text


def test_half_characters_are_held_back_until_complete(byte_tokenizer):
    ids = encode(byte_tokenizer, "a世🤖")  # 1 + 3 + 4 byte tokens
    detok = IncrementalDetokenizer(byte_tokenizer, [], SamplingParams())
    assert [detok.add([i]) for i in ids] == ["a", "", "", "世", "", "", "", "🤖"]
    truncated = IncrementalDetokenizer(byte_tokenizer, [], SamplingParams())
    assert truncated.add(ids[:3]) == "a"
    assert truncated.flush() == "\ufffd"  # what decode() gives for a character cut short


@property_settings
@given(
    prompt=st.sampled_from(["hello", "hello ", "a", "🤖"]),
    words=st.lists(st.sampled_from(["world", "the", "a", "hello", "🤖", "ë"]), min_size=1, max_size=8),
)
def test_first_output_token_keeps_its_leading_space(sentencepiece_tokenizer, prompt, words):
    tok = sentencepiece_tokenizer
    prompt_ids, output_ids = encode(tok, prompt), encode(tok, prompt + " " + " ".join(words))
    assert output_ids[: len(prompt_ids)] == prompt_ids
    output_ids = output_ids[len(prompt_ids) :]
    detok, _ = stream(tok, prompt_ids, output_ids, SamplingParams())
    prompt_text = tok.decode(prompt_ids)
    assert detok.output_text == tok.decode(prompt_ids + output_ids)[len(prompt_text) :]
    assert detok.output_text.startswith(" ")


def test_no_prompt_text_leaks(smollm2):
    prompt_ids = encode(smollm2, CHAT_PROMPT + "Hello there")
    detok, chunks = stream(smollm2, prompt_ids, encode(smollm2, " friend"), SamplingParams())
    assert chunks[0] == " friend" and detok.output_text == " friend"


def test_special_tokens(smollm2):
    ids = encode(smollm2, "Hi<|im_end|>there<|im_start|>")
    cases = {
        (True, True): "Hithere",
        (False, False): "Hi<|im_end|>there<|im_start|>",
        (False, True): "Hi <|im_end|> there <|im_start|>",
    }
    for (skip, spaces), expected in cases.items():
        params = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
        assert stream(smollm2, [], ids, params)[0].output_text == expected


def test_each_decode_sees_a_bounded_window(smollm2):
    """O(new tokens) per call: the decoder never sees more than the window, however long the output."""

    class Recording(Wrapped):
        """The tokenizer, its backend's decoder counting the tokens of each decode (what the
        detokenizer calls, as HF's convert_tokens_to_string would)."""

        def __init__(self, wrapped, lengths):
            super().__init__(wrapped)
            self.lengths = lengths

        @property
        def backend_tokenizer(self):
            return Recording(self.wrapped.backend_tokenizer, self.lengths)

        @property
        def decoder(self):
            return Recording(self.wrapped.decoder, self.lengths)

        def decode(self, tokens):
            self.lengths.append(len(tokens))
            return self.wrapped.decode(tokens)

        def __getstate__(self):  # a decoder of no kind ByteRuns knows: the window makes the text
            return b'{"type": "Recording"}'

    recording = Recording(smollm2, [])
    output_ids = encode(smollm2, "Long text with 世界 and 🤖 emoji, over and over. " * 40)
    detok, _ = stream(recording, encode(smollm2, CHAT_PROMPT), output_ids, SamplingParams())
    assert detok.output_text == smollm2.decode(output_ids)
    assert len(output_ids) > 400 and max(recording.lengths) <= PROMPT_WINDOW + 4


@property_settings
@given(text=texts, data=st.data(), include=st.booleans())
def test_stop_string_ends_the_text(smollm2, text, data, include):
    output_ids = encode(smollm2, text)
    full = smollm2.decode(output_ids, skip_special_tokens=True)
    assume(full)
    start = data.draw(st.integers(0, len(full) - 1))
    stop = full[start : data.draw(st.integers(start + 1, len(full)))]
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    chunk_sizes = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
    detok, chunks = stream(smollm2, encode(smollm2, CHAT_PROMPT), output_ids, params, chunk_sizes)
    at = full.find(stop)
    assert detok.stopped and detok.stop_reason == stop
    assert detok.output_text == full[: at + len(stop) if include else at]
    assert "".join(chunks) == detok.output_text
    assert detok.add(output_ids[:2]) == "" and detok.flush() == ""


def test_stop_string_across_tokens(smollm2):
    output_ids = encode(smollm2, "The answer is 42. The end of it. More text")
    params = SamplingParams(stop=["The end", "nothing"])
    detok = IncrementalDetokenizer(smollm2, [], params)
    assert all("The end" not in smollm2.decode([i]) for i in output_ids)
    chunks = [detok.add([i]) for i in output_ids]
    assert detok.output_text == "".join(chunks) == "The answer is 42. " and detok.stop_reason == "The end"
    assert detok.add(encode(smollm2, " more")) == ""


def test_possible_stop_string_beginning_is_held_back(smollm2):
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams(stop=["STOP"]))
    assert detok.add(encode(smollm2, "go ST")) == "go "
    assert detok.add(encode(smollm2, "O")) == ""
    assert detok.add(encode(smollm2, "X")) == "STOX"
    assert detok.add(encode(smollm2, " STO")) == " "
    assert not detok.stopped
    assert detok.flush() == "STO"  # finished without a stop: the held text is the model's
    assert detok.output_text == "go STOX STO"


def test_earliest_stop_string_wins(smollm2):
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams(stop=["cde", "bcdef", "zz"]))
    detok.add(encode(smollm2, "a b c abcdefg"))
    assert detok.stop_reason == "cde" and detok.output_text == "a b c ab"
    both = IncrementalDetokenizer(smollm2, [], SamplingParams(stop=["bcdef", "cd"], include_stop_str_in_output=True))
    both.add(encode(smollm2, "abcdefg"))
    assert both.stop_reason == "cd" and both.output_text == "abcd"


def test_stop_strings_wait_for_min_tokens(smollm2):
    output_ids = encode(smollm2, "one two one two one")
    params = SamplingParams(stop=["one"], min_tokens=2)
    detok = IncrementalDetokenizer(smollm2, [], params)
    for i in output_ids:
        detok.add([i])
    assert detok.stopped and detok.output_text == "one two "
    # "ab" ended within the first min_tokens tokens (held back only as the start of "abc"): it never counts.
    late = IncrementalDetokenizer(smollm2, [], SamplingParams(stop=["abc", "ab"], min_tokens=1))
    assert late.add(encode(smollm2, "ab")) == ""
    assert late.add(encode(smollm2, "x")) == "abx" and not late.stopped


class WindowOnly(Wrapped):
    """A tokenizer whose decoder the byte path does not know: the window makes every text."""

    @property
    def backend_tokenizer(self):
        return None


@property_settings
@given(which=st.sampled_from(["smollm2", "byte_tokenizer"]), prompt=prompts, text=texts,
       skip=st.booleans(), spaces=st.booleans(), chunk_sizes=st.lists(st.integers(1, 3), min_size=1, max_size=4),
       data=st.data())
def test_bytes_make_the_windows_text(request, which, prompt, text, skip, spaces, chunk_sizes, data):
    """The byte path (ByteRuns) against the window, chunk by chunk: added tokens between runs,
    their separators, characters cut between tokens (any order of the tokens: invalid UTF-8
    too), a flush. SentencePiece's tokenizers keep the window."""
    tok = request.getfixturevalue(which)
    prompt_ids, output_ids = encode(tok, prompt), encode(tok, text)
    output_ids += data.draw(st.lists(st.sampled_from(sorted(tok.added_tokens_decoder) or [0]), max_size=3))
    output_ids = data.draw(st.permutations(output_ids))
    params = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    by_bytes, chunks = stream(tok, prompt_ids, output_ids, params, chunk_sizes)
    by_window, window_chunks = stream(WindowOnly(tok), prompt_ids, output_ids, params, chunk_sizes)
    assert by_bytes._runs is not None and by_window._runs is None
    assert by_bytes.output_text == by_window.output_text
    assert "".join(chunks) == "".join(window_chunks)


def test_sentencepiece_keeps_the_window(sentencepiece_tokenizer):
    assert IncrementalDetokenizer(sentencepiece_tokenizer, [], SamplingParams())._runs is None
