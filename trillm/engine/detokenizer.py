"""Incremental detokenization and stop strings, for one request.

Text is made a few tokens at a time while tokens stream in, so each step must
cost O(new tokens), not a decode of the whole output. As in vLLM, the decoder
sees a small window of tokens: `_tokens[:_read_offset]` was already turned into
text (it is context only), `_tokens[_read_offset:]` is not yet; the new text is
decode(window) minus decode(context). The context matters because decoders are
not additive: a SentencePiece decoder strips the first token's leading space, and
a byte-level token may be the second half of a character. That is also why the
window starts in the prompt's last tokens: the first output token's leading space
comes out right, and no prompt text is ever emitted.

Two kinds of text are held back:
  * while the window decodes to a trailing U+FFFD, the last character is still
    incomplete (its remaining bytes are in later tokens);
  * the longest tail of the text that could begin a stop string, until later
    text settles whether it does; so emitted text never runs past a stop string.
`flush()` releases both when the request finishes without a stop string.

Where the tokenizer is byte-level BPE (trillm/engine/token_bytes.py: its decoder joins its
tokens' bytes and reads them as UTF-8, lossily), the window is not needed: `ByteRuns` makes the
same text from each token's bytes, an incremental UTF-8 decoder holding a character's first
bytes, for less work a token (the front makes every token's text: at high concurrency its event
loop is the ceiling, benchmarks/README.md). SentencePiece's byte fallback turns a group of bytes
that is not UTF-8 into one U+FFFD a byte, which only the window's decode does as it does.
"""
from __future__ import annotations

import codecs
import enum
from functools import lru_cache

from trillm.engine.token_bytes import ByteDecoder, DecoderKind, is_byte_level
from trillm.sampling_params import SamplingParams

# Prompt tokens that start the window: enough for a UTF-8 character split over
# up to four byte tokens plus the token before it.
PROMPT_WINDOW = 5
_REPLACEMENT_CHAR = "\ufffd"
BYTE_LEVEL = ByteDecoder(DecoderKind.BYTE_LEVEL)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self.stopped = False
        self.stop_reason: str | None = None
        self._vocab_size = len(tokenizer)
        self._added_tokens = {token.content for token in tokenizer.added_tokens_decoder.values()}
        self._skipped_ids = _special_ids(tokenizer) if params.skip_special_tokens else set()
        self._separator = " " if params.spaces_between_special_tokens else ""
        # What HF's own convert_ids_to_tokens / convert_tokens_to_string call for a fast tokenizer,
        # bound once: each token goes through both twice, and the wrappers' lookups (a new Python
        # object for the backend's decoder at every access) cost more than the decoding itself.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            self._id_to_token = tokenizer.convert_ids_to_tokens
            self._tokens_to_text = tokenizer.convert_tokens_to_string
        else:
            decoder = backend.decoder
            self._id_to_token = backend.id_to_token
            self._tokens_to_text = " ".join if decoder is None else decoder.decode
        # Prompt tokens are scanned from the end until the window is full, so a
        # few skipped special tokens at the end do not shrink it.
        self._tokens: list[str] = []
        for token_id in reversed(prompt_token_ids):
            if len(self._tokens) == PROMPT_WINDOW:
                break
            token = self._token(token_id)
            if token is not None:
                self._tokens.insert(0, token)
        self._read_offset = len(self._tokens)
        self._runs = None
        if is_byte_level(tokenizer):
            runs = ByteRuns(BYTE_LEVEL, self._separator, self._added_tokens)
            for token in self._tokens:  # the prompt's text so far: what comes next joins it
                runs.add(token)
            if not runs.holding:  # else the prompt ends mid-character: the window keeps it out of the text
                self._runs, self._decode_next = runs, self._decode_next_bytes
        self._num_output_tokens = 0
        self._pending = ""  # decoded, not yet emitted: a possible stop string's beginning
        self._emitted: list[str] = []

    @property
    def num_tokens_read(self) -> int:
        """Output tokens `add` has taken: after a stop, none past the one that completed it."""
        return self._num_output_tokens

    @property
    def output_text(self) -> str:
        return "".join(self._emitted)

    def add(self, new_token_ids: list[int]) -> str:
        """Returns the text that these tokens make safe to emit; "" once stopped."""
        if self.stopped:
            return ""
        for token_id in new_token_ids:
            self._num_output_tokens += 1
            self._append(self._decode_next(token_id))
            if self.stopped:
                break
        return self._emit(hold_stop_prefix=not self.stopped)

    def flush(self) -> str:
        """At the end of a request not stopped by a stop string: everything still held back."""
        if self.stopped:
            return ""
        if self._runs is not None:
            self._append(self._runs.flush())
            return self._emit(hold_stop_prefix=False)
        context, text = self._window_texts()
        self._tokens, self._read_offset = [], 0
        self._append(text[len(context):])
        return self._emit(hold_stop_prefix=False)

    def _token(self, token_id: int) -> str | None:
        """The token's string, or None when it makes no text (a skipped special token, an id past the vocabulary)."""
        if token_id in self._skipped_ids or not 0 <= token_id < self._vocab_size:
            return None
        return self._id_to_token(token_id)

    def _decode_next(self, token_id: int) -> str:
        """The new text this token completes, "" while the window ends in half a character."""
        token = self._token(token_id)
        if token is None:
            return ""
        self._tokens.append(token)
        context, text = self._window_texts()
        if len(text) <= len(context) or text.endswith(_REPLACEMENT_CHAR):
            return ""
        # The tokens just decoded become the next context; older ones are never needed again.
        self._tokens = self._tokens[self._read_offset:]
        self._read_offset = len(self._tokens)
        return text[len(context):]

    def _decode_next_bytes(self, token_id: int) -> str:
        """_decode_next, for a decoder that joins bytes (ByteRuns)."""
        token = self._token(token_id)
        return "" if token is None else self._runs.add(token)

    def _window_texts(self) -> tuple[str, str]:
        """(decoded context, decoded window); the first is a prefix of the second."""
        return self._to_string(self._tokens[: self._read_offset]), self._to_string(self._tokens)

    def _to_string(self, tokens: list[str]) -> str:
        """Like the slow HF decode: added tokens verbatim, runs of other tokens through the decoder,
        the parts joined by a space when spaces_between_special_tokens."""
        parts: list[str] = []
        run: list[str] = []
        for token in tokens:
            if token in self._added_tokens:
                if run:
                    parts.append(self._tokens_to_text(run))
                    run = []
                parts.append(token)
            else:
                run.append(token)
        if run:
            parts.append(self._tokens_to_text(run))
        return self._separator.join(parts)

    def _append(self, text: str) -> None:
        """Adds decoded text to the pending text and stops at the first stop string that ends in it.

        As in vLLM, stop strings count only once more than min_tokens tokens are out.
        """
        if not text:
            return
        start = len(self._pending)
        self._pending += text
        if self._num_output_tokens <= self.params.min_tokens:
            return
        # A match ending before `start` was found (or ruled out by min_tokens) earlier. The first
        # match to end wins, as if the text had come one character at a time; then the longest.
        matches = [(self._pending.find(s, max(0, start - len(s) + 1)), s) for s in self.params.stop]
        matches = [(at + len(s), at, s) for at, s in matches if at != -1]
        if not matches:
            return
        _, at, stop = min(matches)
        self.stopped, self.stop_reason = True, stop
        self._pending = self._pending[: at + len(stop) if self.params.include_stop_str_in_output else at]

    def _emit(self, hold_stop_prefix: bool) -> str:
        held = held_prefix_len(self._pending, self.params.stop) if hold_stop_prefix else 0
        text = self._pending[: len(self._pending) - held]
        self._pending = self._pending[len(text):]
        if text:
            self._emitted.append(text)
        return text

class _Part(enum.Enum):
    NONE = "none"  # no text yet
    RUN = "run"  # tokens the decoder joins
    ADDED = "added"  # an added token, written as it is


class ByteRuns:
    """The text of a byte-level decoder, a token at a time, as the window makes it (`_to_string`):
    added tokens verbatim, the runs of other tokens between them decoded each on its own (a
    character cut short at a run's end is U+FFFD), the parts joined by `separator`. A run's text
    (and the separator before it) waits while the last bytes are a character's beginning."""

    def __init__(self, decoder: ByteDecoder, separator: str, added_tokens: set[str]):
        self._decoder = decoder
        self._separator = separator
        self._added_tokens = added_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._last = _Part.NONE
        self._owed = ""  # the separator before the current run, until the run has text

    @property
    def holding(self) -> bool:
        """Whether the last bytes are the beginning of a character."""
        return bool(self._utf8.getstate()[0])

    def add(self, token: str) -> str:
        """The text this token (its piece, or an added token) makes safe to emit."""
        if token in self._added_tokens:
            text = self._end_run() + (self._separator if self._last is not _Part.NONE else "") + token
            self._last = _Part.ADDED
            return text
        if self._last is not _Part.RUN:
            self._owed = self._separator if self._last is _Part.ADDED else ""
            self._last = _Part.RUN
        text = self._utf8.decode(_piece_bytes(self._decoder, token))
        if not text and self.holding:
            return ""
        text, self._owed = self._owed + text, ""
        return text

    def flush(self) -> str:
        """What is still held: the last run's unfinished character, as U+FFFD."""
        return self._end_run()

    def _end_run(self) -> str:
        if self._last is not _Part.RUN:
            return ""
        tail = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        text, self._owed = (self._owed + tail if tail else ""), ""
        return text


@lru_cache(maxsize=1 << 18)
def _piece_bytes(decoder: ByteDecoder, piece: str) -> bytes:
    """A piece's bytes, kept: the vocabulary is finite and the same tokens recur."""
    return decoder.piece_bytes(piece)


def held_prefix_len(text: str, markers: list[str]) -> int:
    """The length of the longest tail of `text` that is a proper prefix of one of `markers`:
    text that may yet become a marker and must be held back until later text settles it."""
    for length in range(min(max(map(len, markers), default=0) - 1, len(text)), 0, -1):
        tail = text[-length:]
        if any(len(m) > length and m.startswith(tail) for m in markers):
            return length
    return 0


def _special_ids(tokenizer) -> set[int]:
    """What skip_special_tokens skips: the tokenizer's special tokens and every added token marked
    special (the backend's decode skips those too, though some are missing from all_special_ids)."""
    added = tokenizer.added_tokens_decoder
    return {i for i, token in added.items() if token.special} | set(tokenizer.all_special_ids)
