"""POST /v1/completions' body."""
from __future__ import annotations

from pydantic import Field, StrictInt

from trillm.http.protocol.common import MAX_N, Prompt
from trillm.http.protocol.sampling import SamplingFields
from trillm.sampling_params import SamplingParamError, SamplingParams


class CompletionRequest(SamplingFields):
    prompt: Prompt
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: StrictInt | None = 16
    best_of: int | None = Field(None, ge=1, le=MAX_N)  # only = n: more samples than returned is not done here
    suffix: None = None  # no fill-in-the-middle: a suffix is refused rather than ignored

    def to_sampling_params(self, vocab_size: int, tokenizer) -> SamplingParams:
        """echo with logprobs k reports the prompt's tokens too, with k top logprobs each (the
        engine's prompt_logprobs, unless the request sets its own). max_tokens 0 is the prompt
        alone, which only echo or prompt_logprobs makes worth asking."""
        if self.best_of is not None and self.best_of != self.n:
            raise SamplingParamError("best_of", f"best_of must equal n ({self.n}) here: trillm returns every sample it draws.")
        if self.output_limit == 0 and not self.echo and self.prompt_logprobs is None:
            raise SamplingParamError(
                self.output_limit_field, "max_tokens 0 returns nothing without echo or prompt_logprobs; ask for at least 1."
            )
        prompt_logprobs = self.logprobs if self.echo and self.prompt_logprobs is None else None
        return self._sampling_params(vocab_size, tokenizer, self.output_limit, self.logprobs, prompt_logprobs)

    @property
    def echo_logprobs(self) -> bool:
        """The echoed prompt carries logprobs (OpenAI's echo with logprobs)."""
        return bool(self.echo) and self.logprobs is not None
