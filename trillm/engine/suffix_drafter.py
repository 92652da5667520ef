"""Suffix drafts: the continuation that most often followed the longest match of a request's
last tokens, in its own tokens and in the outputs of earlier requests (SuffixDecoding's idea,
as vLLM's "suffix" method offers it; here over a hash index of token pairs instead of a tree).

Every sequence is indexed by the pair of tokens ending at each of its positions. To draft, the
request's last two tokens give the candidate places; each place's match is extended backwards
(up to `suffix_decoding_max_tree_depth` tokens), and only the longest matches are kept. The
draft then walks forward from them: at each step the token that most of the remaining places
continue with, if at least `suffix_decoding_min_token_prob` of them do, and only the places that
agree go on. A longer match earns a longer draft (`suffix_decoding_max_spec_factor` tokens per
matched token, up to the request's draft length).

The global cache keeps the outputs of the last `suffix_decoding_max_cached_requests` finished
requests, at most `suffix_decoding_max_cached_tokens` tokens of them, one cache per LoRA adapter
and cache salt: drafts never cross tenants or adapters.
"""
from __future__ import annotations

from collections import OrderedDict

from trillm.engine.drafting import Drafter, SpeculativeConfig

KEY = 2  # tokens that index a place
MAX_PLACES = 64  # the most recent places of one pair that a draft looks at


class PairIndex:
    """Sequences, each indexed by the pair of tokens ending at each position that has a
    continuation. A sequence may grow (it is read in place: the request's own token list)."""

    def __init__(self):
        self.sequences: dict[int, list[int]] = {}
        self._places: dict[tuple[int, int], list[tuple[int, int]]] = {}  # pair -> (sequence, end)
        self._indexed: dict[int, int] = {}

    def extend(self, key: int, tokens: list[int]) -> None:
        """Index `tokens` (a new sequence, or a longer one under the same key) up to its end."""
        self.sequences[key] = tokens
        for end in range(max(self._indexed.get(key, KEY), KEY), len(tokens)):
            places = self._places.setdefault((tokens[end - 2], tokens[end - 1]), [])
            places.append((key, end))
            if len(places) > 2 * MAX_PLACES:  # older places of a frequent pair are never read again
                del places[:-MAX_PLACES]
        self._indexed[key] = max(self._indexed.get(key, KEY), len(tokens))

    def remove(self, key: int) -> None:
        tokens = self.sequences.pop(key)
        for end in range(KEY, self._indexed.pop(key)):
            pair = (tokens[end - 2], tokens[end - 1])
            places = self._places.get(pair, [])
            if (key, end) in places:  # it may have been trimmed already
                places.remove((key, end))
            if not places:
                self._places.pop(pair, None)

    def places(self, pair: tuple[int, int]) -> list[tuple[list[int], int]]:
        """The most recent places the pair ends at: (sequence, the position after it)."""
        return [(self.sequences[key], end) for key, end in self._places.get(pair, ())[-MAX_PLACES:]]


class SuffixCache:
    """The outputs of recently finished requests, per (LoRA adapter, cache salt), the oldest
    forgotten first: at most `max_requests` outputs and `max_tokens` tokens in all, whatever
    their lengths and however many tenants there are (an output longer than the whole budget
    keeps its last tokens; a tenant with no output left takes no room). Owned by the engine
    core; touched only between steps."""

    def __init__(self, max_requests: int, max_tokens: int):
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.num_tokens = 0
        self._indexes: dict[tuple[int, str], PairIndex] = {}
        self._order: OrderedDict[int, tuple[tuple[int, str], int]] = OrderedDict()  # id -> (tenant, tokens)
        self._next = 0

    @property
    def num_tenants(self) -> int:
        return len(self._indexes)

    def places(self, tenant: tuple[int, str], pair: tuple[int, int]) -> list[tuple[list[int], int]]:
        """PairIndex.places over the tenant's outputs."""
        index = self._indexes.get(tenant)
        return index.places(pair) if index is not None else []

    def add(self, tenant: tuple[int, str], output: list[int]) -> None:
        if self.max_requests == 0 or len(output) <= KEY or self.max_tokens <= KEY:
            return
        output = list(output[-self.max_tokens:])
        self._indexes.setdefault(tenant, PairIndex()).extend(self._next, output)
        self._order[self._next] = (tenant, len(output))
        self._next += 1
        self.num_tokens += len(output)
        while len(self._order) > self.max_requests or self.num_tokens > self.max_tokens:
            key, (old, length) = self._order.popitem(last=False)
            index = self._indexes[old]
            index.remove(key)
            self.num_tokens -= length
            if not index.sequences:
                del self._indexes[old]
        assert self.num_tokens <= self.max_tokens and len(self._order) <= self.max_requests


class SuffixDrafter(Drafter):
    """One request's suffix drafts: its own tokens, and its tenant's global cache."""

    def __init__(self, config: SpeculativeConfig, cache: SuffixCache, tenant: tuple[int, str]):
        super().__init__(config)
        self._own = PairIndex()
        self._cache, self._tenant = cache, tenant

    def propose(self, token_ids: list[int]) -> list[int]:
        if len(token_ids) < KEY:
            return []
        self._own.extend(0, token_ids)
        pair = (token_ids[-2], token_ids[-1])
        places = [(tokens, end) for tokens, end in self._own.places(pair) + self._cache.places(self._tenant, pair)
                  if end < len(tokens)]
        depth = self.config.suffix_decoding_max_tree_depth
        matched = [(self._match(tokens, end, token_ids, depth), tokens, end) for tokens, end in places]
        if not matched:
            return []
        longest = max(length for length, _, _ in matched)
        places = [(tokens, end) for length, tokens, end in matched if length == longest]
        limit = min(self.num_to_draft, max(1, int(self.config.suffix_decoding_max_spec_factor * longest)))
        draft: list[int] = []
        while len(draft) < limit and places:
            counts: dict[int, int] = {}
            for tokens, end in places:
                counts[tokens[end]] = counts.get(tokens[end], 0) + 1
            token, count = max(counts.items(), key=lambda item: item[1])
            if count / len(places) < self.config.suffix_decoding_min_token_prob:
                break
            draft.append(token)
            places = [(tokens, end + 1) for tokens, end in places if tokens[end] == token and end + 1 < len(tokens)]
        return draft

    @staticmethod
    def _match(tokens: list[int], end: int, token_ids: list[int], depth: int) -> int:
        """How many tokens before `end` in `tokens` equal the end of `token_ids` (at most depth)."""
        length = KEY
        while length < depth and length < end and length < len(token_ids) \
                and tokens[end - length - 1] == token_ids[-length - 1]:
            length += 1
        return length

    def finished(self, output: list[int]) -> None:
        """The request ended with `output`: later requests of its tenant may draft from it."""
        self._cache.add(self._tenant, output)
