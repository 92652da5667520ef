"""The bytes a token stands for, where a tokenizer's decoder joins its tokens' bytes.

Byte-level BPE (GPT-2's table maps each byte to one printable character: SmolLM2, Llama 3, Qwen)
and SentencePiece with byte fallback (a space written U+2581, a byte the vocabulary lacks as
`<0xNN>`: Llama 2, Mistral, Gemma) both do. A token's `bytes` are reported from here
(trillm/http/logprobs.py); a byte-level tokenizer's text is made a token at a time from them
(trillm/engine/detokenizer.py). Which kind a tokenizer is, its decoder's JSON says
(`tokenizer_part`, which reads its normalizer for the prompt's bounds too).
"""
from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from functools import cache

from transformers.convert_slow_tokenizer import bytes_to_unicode

SPACE_MARK = "\u2581"  # SentencePiece's space
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


class DecoderKind(enum.Enum):
    BYTE_LEVEL = "byte_level"
    SENTENCEPIECE = "sentencepiece"


@dataclass(frozen=True)
class ByteDecoder:
    """A decoder that joins its tokens' bytes, of one of the two kinds."""

    kind: DecoderKind

    def piece_bytes(self, piece: str) -> bytes:
        """The bytes of a token (not an added one) by its piece, the vocabulary's string for it."""
        if self.kind is DecoderKind.BYTE_LEVEL:  # a character outside GPT-2's table is its own UTF-8, as HF's
            table = _byte_of_char()
            return b"".join(bytes((table[c],)) if c in table else c.encode("utf-8") for c in piece)
        byte = BYTE_PIECE.fullmatch(piece)
        return bytes([int(byte[1], 16)]) if byte else piece.replace(SPACE_MARK, " ").encode("utf-8")


def tokenizer_part(tokenizer, name: str) -> dict | None:
    """A fast tokenizer's normalizer or decoder as its JSON (that part alone: the whole
    tokenizer's is megabytes for a large vocabulary); None where it has none, {"type": "unknown"}
    for a tokenizer that is not a fast one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return {"type": "unknown"}
    part = getattr(backend, name)
    return None if part is None else json.loads(part.__getstate__())


def is_byte_level(tokenizer) -> bool:
    """Whether the tokenizer's decoder is byte-level BPE's alone (a fast tokenizer's)."""
    return (tokenizer_part(tokenizer, "decoder") or {}).get("type") == "ByteLevel"


@cache
def _byte_of_char() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}
