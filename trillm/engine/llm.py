"""LLM: the offline API. Feeds every prompt to one EngineCore and steps it until all finish."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from trillm.config import EngineArgs
from trillm.engine.core import EngineCore
from trillm.engine.group import RequestGroup
from trillm.engine.output import Completion, output_processor
from trillm.pooling_params import PoolingParams, PoolingType
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

    def close(self) -> None:
        """Stops what the engine started (tensor-parallel ranks, grammar compilers, the KV-event
        publisher). Idempotent; the LLM generates no more after it."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Prompts are texts or token-id lists (only the latter for a model without a tokenizer,
        whose completions then carry token ids and no text); one SamplingParams for all or one
        per prompt."""
        prompts = _prompt_list(prompts)
        params = params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        assert len(params_list) == len(prompts), "one SamplingParams per prompt"
        return self._run(prompts, params_list, use_tqdm)

    def embed(
        self, prompts: str | list[str] | list[list[int]], pooling: PoolingType | None = None,
        normalize: bool = True, use_tqdm: bool = False,
    ) -> list[torch.Tensor]:
        """One vector (fp32 [hidden]) per prompt: its final hidden states pooled (`pooling`, or the
        model's, `ModelConfig.pooling_type`), L2-normalised unless `normalize` is false."""
        prompts = _prompt_list(prompts)
        pooling = pooling or self.engine.config.pooling_type
        outputs = self._run(prompts, [PoolingParams(pooling)] * len(prompts), use_tqdm)
        vectors = [out.outputs[0].pooled for out in outputs]
        return [F.normalize(v, dim=0) if normalize else v for v in vectors]

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

    def _run(self, prompts, params_list: list, use_tqdm: bool) -> list[RequestOutput]:
        """Admit every prompt (all or nothing), then step until each has finished."""
        results, groups, processors = [], [], {}
        try:
            for prompt, p in zip(prompts, params_list):
                text = prompt if isinstance(prompt, str) else None
                if text is not None and self.tokenizer is None:
                    raise ValueError("This model has no tokenizer: give prompts as token-id lists.")
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                group = RequestGroup.fan_out(str(self._counter), [ids], p)
                self._counter += 1
                # The processors first: if one refuses the params, the engine never holds the group.
                for i, member in enumerate(group.members):
                    processors[member.request_id] = (group, output_processor(self.tokenizer, ids, member.params, i))
                group.admit(self.engine)
                groups.append(group)
                results.append(RequestOutput(group.request_id, text, ids, [
                    processors[m.request_id][1].completion for m in group.members
                ]))
        except BaseException:
            for group in groups:  # all or nothing: the groups admitted before the refusal go too
                group.abort(self.engine, FinishReason.ABORT)
            raise
        live = set(processors)
        with tqdm(total=len(live), disable=not use_tqdm, desc="generate") as bar:
            while live:
                assert self.engine.has_unfinished(), "live requests but nothing left in the engine"
                for out in self.engine.step():
                    group, processor = processors[out.request_id]
                    group.on_output(self.engine, out)
                    delta = processor.process(out)
                    if delta.finished:
                        if not out.finished:  # a stop string ended it
                            group.stop(self.engine, group.index[out.request_id])
                        live.discard(out.request_id)
                        bar.update(1)
        return results


def _prompt_list(prompts: str | list[str] | list[int] | list[list[int]]) -> list:
    """One prompt (a text or a token-id list) as a list of one; a list of prompts as it is."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [prompts]
    return prompts
