"""Speculative decoding's drafts: `--speculative-config` (vLLM's JSON keys) and the n-gram
drafter, which proposes tokens by prompt lookup, with no second model ("suffix" drafts, from
the request's tokens and earlier requests' outputs: trillm/engine/suffix_drafter.py).

A decode step on CPU (and at small batches on a GPU) is bound by reading the weights, so a
request verifying k drafted tokens in the same step costs little more than its one token;
every draft the model agrees with is a token for free. The verification
(trillm/engine/verification.py) keeps the output exactly what decoding without drafts gives;
drafts only change how many steps it takes.

Prompt lookup: the request's own tokens (prompt and output) are indexed by their n-grams as
they grow; the last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) are
looked up, and the tokens that followed their latest earlier occurrence are the draft.
Workloads that repeat themselves (code edits that copy their input, JSON that quotes it, an
agent's tool calls) draft long runs that the model accepts; free text drafts rarely, and then
short. A request's draft length follows what it accepted last (one more than its accepted
run), so a request whose drafts keep failing drafts one token, and the step's policy
(trillm/engine/draft_policy.py) drafts at a batch size only while drafting measures faster
there: once a batch is large enough that the step is compute-bound, rejected drafts would cost
the other requests time.
"""
from __future__ import annotations

from dataclasses import dataclass

from trillm.config import from_json_object

METHODS = ("ngram", "suffix")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config`'s settings, vLLM's names."""

    method: str = "ngram"
    num_speculative_tokens: int = 4  # the most drafts a request verifies in one step
    prompt_lookup_max: int = 4  # the longest n-gram looked up
    prompt_lookup_min: int = 2  # the shortest
    # Running requests above which no request drafts in a step (0: always draft); None: drafting
    # where it measures faster (trillm/engine/draft_policy.py)
    disable_by_batch_size: int | None = None
    # "suffix" (trillm/engine/suffix_drafter.py): the longest match looked for, the draft tokens
    # per matched token, the least share of matches a drafted token needs, and how many finished
    # requests' outputs later requests draft from (per adapter and cache salt), and how many
    # tokens of them at most (trillm's: outputs may be long, and the memory is the tokens')
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_cached_tokens: int = 200_000

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--speculative-config: unknown method {self.method!r}; this server drafts by "
                             f"{', '.join(METHODS)}.")
        if self.num_speculative_tokens < 1:
            raise ValueError("--speculative-config: num_speculative_tokens must be at least 1.")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max.")
        if min(self.disable_by_batch_size or 0, self.suffix_decoding_max_cached_requests,
               self.suffix_decoding_max_cached_tokens) < 0:
            raise ValueError("--speculative-config: disable_by_batch_size, suffix_decoding_max_cached_requests "
                             "and suffix_decoding_max_cached_tokens must be non-negative.")
        if self.suffix_decoding_max_tree_depth < 2 or self.suffix_decoding_max_spec_factor <= 0 \
                or not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("--speculative-config: need suffix_decoding_max_tree_depth >= 2, "
                             "suffix_decoding_max_spec_factor > 0 and 0 <= suffix_decoding_min_token_prob <= 1.")

    @classmethod
    def parse(cls, text: str | None) -> SpeculativeConfig | None:
        """The config a `--speculative-config` JSON object gives; None for None or "" (off).
        ValueError, naming the key, for anything else it cannot take."""
        if not text:
            return None
        return from_json_object(cls, "--speculative-config", text)


class Drafter:
    """What every method's drafter shares: one request's current draft length, which follows
    what verification kept, and what it does when the request ends. Owned by the request's
    record; the engine core calls it between steps."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.num_to_draft = config.num_speculative_tokens  # this request's current draft length

    def propose(self, token_ids: list[int]) -> list[int]:
        """Drafts to follow `token_ids`: at most num_to_draft, [] when it has none."""
        raise NotImplementedError

    def accepted(self, num_drafts: int, num_accepted: int) -> None:
        """Verification's outcome: the next draft is one longer than this accepted run."""
        if num_drafts:
            self.num_to_draft = min(num_accepted + 1, self.config.num_speculative_tokens)

    def finished(self, output: list[int]) -> None:
        """The request ended with `output`; a drafter that keeps nothing of it does nothing."""


class NgramDrafter(Drafter):
    """One request's prompt-lookup index: each n-gram (n in [min, max]) of its tokens, mapped to
    where its latest occurrence ends. Indexed incrementally: each token is indexed once, so a
    step's draft costs O(max) lookups whatever the context's length. Owned by the request's
    record; not shared (drafts never cross requests, so never adapters or cache salts)."""

    def __init__(self, config: SpeculativeConfig):
        super().__init__(config)
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending at positions < this are in _ends

    def propose(self, token_ids: list[int]) -> list[int]:
        """Drafts to follow `token_ids` (at most num_to_draft of them; [] when no n-gram of its
        end occurred before)."""
        lo, hi = self.config.prompt_lookup_min, self.config.prompt_lookup_max
        n_tokens = len(token_ids)
        # Index every n-gram that ends before the last token: the suffix itself must not match.
        for end in range(max(self._indexed, lo), n_tokens):
            for n in range(lo, min(hi, end) + 1):
                self._ends[tuple(token_ids[end - n:end])] = end
        self._indexed = max(self._indexed, n_tokens)
        for n in range(min(hi, n_tokens), lo - 1, -1):
            end = self._ends.get(tuple(token_ids[n_tokens - n:]))
            if end is not None:
                return token_ids[end:end + self.num_to_draft]
        return []
