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

Params = SamplingParams | PoolingParams


@dataclass(frozen=True)
class Member:
    """One engine request of a group."""

    request_id: str
    prompt_token_ids: list[int]
    params: Params
    client_id: str | None = None  # the client's name for the prompt this member samples, if any


class RequestGroup:
    """A group's members and their admission; `fan_out` makes the members of a client request."""

    def __init__(self, request_id: str, members: list[tuple[list[int], Params]],
                 client_ids: list[str | None] | None = None):
        """`client_ids`: each member's client name (None: none), as Member.client_id."""
        assert members, "a group has at least one member"
        assert client_ids is None or len(client_ids) == len(members)
        self.request_id = request_id
        self.members = [Member(f"{request_id}-{k}", list(ids), params, client_ids[k] if client_ids else None)
                        for k, (ids, params) in enumerate(members)]
        self.index = {m.request_id: k for k, m in enumerate(self.members)}
        self.checked = False  # every member passed EngineCore.check_request already
        self._in_core: set[str] = set()  # members the core holds now
        self._deferred: dict[str, list[int]] = {}  # member id -> members waiting on its first token

    @classmethod
    def fan_out(cls, request_id: str, prompts: list[list[int]], params: Params | list[Params],
                client_ids: str | None | list[str | None] = None) -> RequestGroup:
        """`n` samples of each prompt, in OpenAI's order, a seeded sample i with seed + i (a
        pooling request: one member per prompt). `params` and `client_ids` are the group's, or
        one per prompt (a batch whose prompts each have their own; every prompt's n the same)."""
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        names = client_ids if isinstance(client_ids, list) else [client_ids] * len(prompts)
        assert len(per_prompt) == len(names) == len(prompts)
        n = num_samples(per_prompt[0])
        assert all(num_samples(p) == n for p in per_prompt), "every prompt of a group has the same n"
        members = [
            (ids, p if isinstance(p, PoolingParams) or p.seed is None else replace(p, seed=p.seed + i))
            for ids, p in zip(prompts, per_prompt)
            for i in range(n)
        ]
        return cls(request_id, members, [name for name in names for _ in range(n)])

    def named(self, client_id: str) -> list[int]:
        """The members the client named so."""
        return [k for k, m in enumerate(self.members) if m.client_id == client_id]

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

    def abort(self, core: EngineCore, reason: FinishReason, indices: list[int] | None = None) -> list[StepOutput]:
        """End every unfinished member now (or those of `indices`); their final outputs. Members
        the core holds are aborted there (their blocks are free at once); deferred ones never
        reached it and end with no tokens; members deferred behind an aborted one that are not
        aborted themselves are admitted, as after its first token."""
        chosen = set(range(len(self.members)) if indices is None else indices)
        deferred = [k for waiting in self._deferred.values() for k in waiting if k in chosen]
        for waiting in self._deferred.values():
            waiting[:] = [k for k in waiting if k not in chosen]
        finals = []
        for request_id in sorted(self._in_core, key=self.index.get):
            if self.index[request_id] in chosen:
                out = core.abort_request(request_id, reason)
                assert out is not None, "the core holds every member in _in_core"
                finals.append(out)
                self.on_output(core, out)
        for k in deferred:
            member = self.members[k]
            finals.append(StepOutput(
                request_id=member.request_id, new_token_ids=[], new_logprobs=None, finished=True,
                finish_reason=reason, stop_token_id=-1,
                num_prompt_tokens=len(member.prompt_token_ids), num_cached_tokens=0,
            ))
        return finals

    def _add(self, core: EngineCore, member: Member) -> None:
        core.add_request(member.request_id, member.prompt_token_ids, member.params, checked=self.checked)
        self._in_core.add(member.request_id)


def num_samples(params: Params) -> int:
    """Members per prompt: n samples, or one pooled vector."""
    return 1 if isinstance(params, PoolingParams) else params.n
