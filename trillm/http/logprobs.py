"""Logprobs in the two OpenAI shapes: chat's `content[{token, logprob, bytes, top_logprobs}]`
and completions' parallel lists `tokens / token_logprobs / top_logprobs / text_offset` (where an
echoed prompt's first token has null for both, as OpenAI and vLLM send it), and the prompt's in
vLLM's `prompt_logprobs` shape: per prompt token null (the first) or `{token id: {logprob, rank,
decoded_token}}`, the prompt token and its top ones.

A token is shown as its own decoded text, special tokens included, as vLLM does;
`bytes` are the bytes the token stands for, which is what OpenAI documents them for: a token
that holds part of a character (byte-level BPE cuts emoji and CJK between tokens; SentencePiece
falls back to single bytes) decodes to U+FFFD, but its bytes are its own, so that a client
joining a choice's `bytes` gets its text back. A model without a tokenizer shows
`token_id:<id>`, vLLM's spelling when it returns tokens as ids. A log-probability of -inf is sent as -9999.0,
OpenAI's spelling of "very unlikely" (JSON has no infinity).
"""
from __future__ import annotations

from functools import lru_cache

from trillm.engine.api import ByteDecoder, DecoderKind, TokenLogprobs, tokenizer_part

FLOOR = -9999.0


class TokenTexts:
    """Token id -> text, and -> the bytes it stands for; cached: the vocabulary is finite and
    the same tokens recur."""

    def __init__(self, tokenizer):
        if tokenizer is None:
            self.text = lambda token_id: f"token_id:{token_id}"
            self.bytes = lambda token_id: list(self.text(token_id).encode("utf-8"))
            return
        self.text = lru_cache(maxsize=None)(lambda token_id: tokenizer.decode([token_id]))
        self.bytes = lru_cache(maxsize=None)(_token_bytes(tokenizer, self.text))


def _token_bytes(tokenizer, text):
    """A function from a token id to its bytes, by the tokenizer's decoder (trillm.engine.token_bytes:
    byte-level BPE, or SentencePiece's byte fallback, anywhere in it); a special token, or a decoder
    of another kind, is its decoded text's UTF-8."""
    decoder = tokenizer_part(tokenizer, "decoder")
    kinds = {d.get("type") for d in (decoder or {}).get("decoders", [decoder or {}])}
    special = set(getattr(tokenizer, "added_tokens_decoder", {}))
    if "ByteLevel" in kinds:
        pieces = ByteDecoder(DecoderKind.BYTE_LEVEL)
    elif "ByteFallback" in kinds:
        pieces = ByteDecoder(DecoderKind.SENTENCEPIECE)
    else:
        return lambda token_id: list(text(token_id).encode("utf-8"))

    def token_bytes(token_id: int) -> list[int]:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if token_id in special or piece is None:
            return list(text(token_id).encode("utf-8"))
        return list(pieces.piece_bytes(piece))

    return token_bytes


def _logprob(value: float) -> float:
    return max(value, FLOOR)


def chat_logprobs(texts: TokenTexts, token_ids: list[int], logprobs: list[TokenLogprobs]) -> dict:
    assert len(token_ids) == len(logprobs)

    def entry(token_id: int, logprob: float) -> dict:
        return {"token": texts.text(token_id), "logprob": _logprob(logprob), "bytes": texts.bytes(token_id)}

    return {
        "content": [
            {**entry(token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for token_id, lp in zip(token_ids, logprobs)
        ]
    }


def completion_logprobs(
    texts: TokenTexts, token_ids: list[int], logprobs: list[TokenLogprobs | None], text_offset: int
) -> dict:
    """`top_logprobs[i]` holds the token and the top ones, as vLLM's do; `text_offset` is where
    the first token's text starts in the choice's whole text. A None entry (an echoed prompt's
    first token) is null in both lists."""
    assert len(token_ids) == len(logprobs)
    tokens = [texts.text(t) for t in token_ids]
    offsets = []
    for text in tokens:
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [None if lp is None else _logprob(lp.logprob) for lp in logprobs],
        "top_logprobs": [
            None if lp is None else {tokens[i]: _logprob(lp.logprob), **{texts.text(t): _logprob(v) for t, v in lp.top}}
            for i, lp in enumerate(logprobs)
        ],
        "text_offset": offsets,
    }


def join_completion_logprobs(first: dict, second: dict) -> dict:
    """Two parts of one choice's completion logprobs (an echoed prompt's, then the output's)."""
    return {key: first[key] + second[key] for key in first}


def reported_prompt_tokens(prompt_token_ids: list[int], logprobs: list[TokenLogprobs | None]) -> list[int]:
    """The prompt tokens that prompt logprobs cover: the last len(logprobs), from the request's
    prompt_logprobs_start on."""
    return prompt_token_ids[len(prompt_token_ids) - len(logprobs):]


def vllm_prompt_logprobs(
    texts: TokenTexts, prompt_token_ids: list[int], logprobs: list[TokenLogprobs | None]
) -> list[dict | None]:
    """The prompt's logprobs in vLLM's shape."""
    token_ids = reported_prompt_tokens(prompt_token_ids, logprobs)

    def entry(token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": _logprob(logprob), "rank": rank, "decoded_token": texts.text(token_id)}

    out = []
    for token_id, lp in zip(token_ids, logprobs):
        if lp is None:
            out.append(None)
            continue
        ranked = {str(t): entry(t, v, rank) for rank, (t, v) in enumerate(lp.top, start=1)}
        out.append({str(token_id): entry(token_id, lp.logprob, lp.rank), **ranked})
    return out
