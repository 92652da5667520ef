"""RequestGroup: the engine requests one client request becomes, and how they enter the core.

A request of p prompts with n samples each is p * n engine requests, its *members*: member k
is sample k % n of prompt k // n (OpenAI's order of choices), engine id `{group id}-{k}`, and
a seeded sample i draws with seed + i, so the samples differ but repeat. The `-{k}` suffix is
always there, so engine ids of different groups never collide.

A member whose prompt repeats an earlier member's (the n > 1 case) is admitted only once that
member has produced its first token: by then the prompt's full blocks are in the prefix cache,
and the samples share them instead of each computing the prompt again.

The server (AsyncEngine, on its engine task) and the offline LLM both fan out and admit
through this class. It is not thread-safe: one owner drives it between two steps, as it
drives the core.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from trillm.engine.core import EngineCore, StepOutput
from trillm.pooling_params import PoolingParams
from trillm.sampling_params import SamplingParams
from trillm.sched_ext import FinishReason


@dataclass(frozen=True)
class Member:
    """One engine request of a group."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams


class RequestGroup:
    """A group's members and their admission; `fan_out` makes the members of a client request."""

    def __init__(self, request_id: str, members: list[tuple[list[int], SamplingParams]]):
        assert members, "a group has at least one member"
        self.request_id = request_id
        self.members = [Member(f"{request_id}-{k}", list(ids), params) for k, (ids, params) in enumerate(members)]
        self.index = {m.request_id: k for k, m in enumerate(self.members)}
        self._in_core: set[str] = set()  # members the core holds now
        self._deferred: dict[str, list[int]] = {}  # member id -> members waiting on its first token

    @classmethod
    def fan_out(cls, request_id: str, prompts: list[list[int]], params: SamplingParams | PoolingParams) -> RequestGroup:
        """`params.n` samples of each prompt, in OpenAI's order, a seeded sample i with seed + i
        (a pooling request: one member per prompt)."""
        return cls(request_id, [
            (ids, params if isinstance(params, PoolingParams) or params.seed is None
             else replace(params, seed=params.seed + i))
            for ids in prompts
            for i in range(params.n)
        ])

    def admit(self, core: EngineCore) -> None:
        """Add the members to the core, each repeated prompt's samples deferred (module docstring).

        All or nothing: if the core refuses a member (ValueError, SamplingParamError), the ones
        already added are aborted and the error is raised; the core is as before."""
        first_with_prompt: dict[tuple[int, ...], str] = {}
        try:
            for k, member in enumerate(self.members):
                key = tuple(member.prompt_token_ids)
                if key in first_with_prompt:
                    self._deferred.setdefault(first_with_prompt[key], []).append(k)
                    continue
                first_with_prompt[key] = member.request_id
                self._add(core, member)
        except BaseException:
            for request_id in self._in_core:
                core.abort_request(request_id)
            self._in_core.clear()
            self._deferred.clear()
            raise

    def on_output(self, core: EngineCore, out: StepOutput) -> None:
        """Account for one of the core's outputs for a member: its first admits the members
        waiting on it; a final one means the core no longer holds it."""
        for k in self._deferred.pop(out.request_id, ()):
            self._add(core, self.members[k])
        if out.finished:
            self._in_core.discard(out.request_id)

    def stop(self, core: EngineCore, index: int, reason: FinishReason = FinishReason.STOP) -> StepOutput | None:
        """End member `index` early (a stop string matched): its final output, or None when the
        core holds it no longer. Members deferred behind it are admitted all the same."""
        request_id = self.members[index].request_id
        if request_id not in self._in_core:
            return None
        out = core.abort_request(request_id, reason)
        self.on_output(core, out)
        return out

    def abort(self, core: EngineCore, reason: FinishReason) -> list[StepOutput]:
        """End every unfinished member now; their final outputs. Members the core holds are
        aborted there (their blocks are free at once); deferred ones never reached it and end
        with no tokens."""
        deferred = [k for waiting in self._deferred.values() for k in waiting]
        self._deferred.clear()
        finals = [core.abort_request(request_id, reason) for request_id in sorted(self._in_core, key=self.index.get)]
        assert None not in finals, "the core holds every member in _in_core"
        self._in_core.clear()
        for k in deferred:
            member = self.members[k]
            finals.append(StepOutput(
                request_id=member.request_id, new_token_ids=[], new_logprobs=None, finished=True,
                finish_reason=reason, stop_token_id=-1,
                num_prompt_tokens=len(member.prompt_token_ids), num_cached_tokens=0,
            ))
        return finals

    def _add(self, core: EngineCore, member: Member) -> None:
        core.add_request(member.request_id, member.prompt_token_ids, member.params)
        self._in_core.add(member.request_id)
