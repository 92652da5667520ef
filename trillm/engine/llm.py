"""LLM: the offline API. Feeds every prompt to one EngineCore and steps it until all finish."""
from __future__ import annotations

from dataclasses import dataclass, replace

from tqdm import tqdm

from trillm.config import EngineArgs
from trillm.engine.core import EngineCore
from trillm.engine.output import Completion, OutputProcessor
from trillm.sampling_params import SamplingParams
from trillm.sched_ext import FinishReason


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[Completion]  # one per sample (params.n)

    @property
    def num_cached_tokens(self) -> int:
        return self.outputs[0].num_cached_tokens


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        self.engine = EngineCore(EngineArgs(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Prompts are texts or token-id lists (only the latter for a model without a tokenizer,
        whose completions then carry token ids and no text); one SamplingParams for all or one
        per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        assert len(params_list) == len(prompts), "one SamplingParams per prompt"
        results, processors = [], {}
        for prompt, p in zip(prompts, params_list):
            text = prompt if isinstance(prompt, str) else None
            if text is not None and self.tokenizer is None:
                raise ValueError("This model has no tokenizer: give prompts as token-id lists.")
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            result = RequestOutput(str(self._counter), text, ids, [])
            self._counter += 1
            for i in range(p.n):
                sample_params = p if p.seed is None else replace(p, seed=p.seed + i)
                rid = f"{result.request_id}-{i}"
                # The processor first: if it refuses the params, the engine never holds the request.
                processors[rid] = OutputProcessor(self.tokenizer, ids, sample_params, index=i)
                self.engine.add_request(rid, ids, sample_params)
                result.outputs.append(processors[rid].completion)
            results.append(result)
        self._run(processors, use_tqdm)
        return results

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | None = None,
        chat_template_kwargs: dict | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several, rendered with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(
                conv, add_generation_prompt=True, tokenize=False, **(chat_template_kwargs or {})
            )
            for conv in conversations
        ]
        # The template already holds any BOS token: tokenize without adding special tokens.
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        outputs = self.generate(ids, params, use_tqdm)
        for out, prompt in zip(outputs, prompts):
            out.prompt = prompt
        return outputs

    def _run(self, processors: dict[str, OutputProcessor], use_tqdm: bool) -> None:
        live = set(processors)
        with tqdm(total=len(live), disable=not use_tqdm, desc="generate") as bar:
            while live:
                assert self.engine.has_unfinished(), "live requests but nothing left in the engine"
                for out in self.engine.step():
                    delta = processors[out.request_id].process(out)
                    if delta.finished:
                        if not out.finished:  # a stop string ended it
                            self.engine.abort_request(out.request_id, FinishReason.STOP)
                        live.discard(out.request_id)
                        bar.update(1)
