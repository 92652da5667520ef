"""FrontLinks (trillm/engine/front_links.py), the engine's process's sockets to several fronts,
over real ZeroMQ sockets: whatever the fronts send and in whatever order the engine settles it,
each front gets the admissions and outputs of the groups it admitted and the replies to its own
calls, under its own call ids, each exactly once, and nothing of another front's."""
import pickle
import threading

import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from trillm.engine.core import StepOutput
from trillm.engine.front_links import FrontLinks
from trillm.engine.group import RequestGroup
from trillm.engine.rounds import Admit, Call, Round
from trillm.engine.wire import round_decoder
from trillm.sampling_params import SamplingParams


class Runner:
    """What FrontLinks asks of a RoundRunner: which groups it still holds."""

    def __init__(self):
        self.groups: set[str] = set()

    def __contains__(self, group_id: str) -> bool:
        return group_id in self.groups


# A trip: each front's commands (admissions, calls), then the engine's part: which admissions it
# refuses, and which held groups make an output (finished or not).
trip = st.tuples(
    st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["admit", "call"])), max_size=6),
    st.lists(st.booleans(), max_size=6),  # refusals, in the order of the admissions
    st.lists(st.tuples(st.integers(0, 50), st.booleans()), max_size=8),  # (a held group, by position; finished?)
)


@settings(max_examples=30, deadline=None)
@given(fronts=st.integers(1, 3), trips=st.lists(trip, min_size=1, max_size=8))
def test_each_front_gets_its_own_and_only_its_own(fronts, trips):
    context = zmq.Context()
    try:
        addresses = [(f"inproc://commands-{i}", f"inproc://rounds-{i}") for i in range(fronts)]
        sides = []
        for commands_address, rounds_address in addresses:  # each front binds its pair, as EngineLink does
            push, pull = context.socket(zmq.PUSH), context.socket(zmq.PULL)
            push.bind(commands_address)
            pull.bind(rounds_address)
            sides.append((push, pull))
        links = FrontLinks(context, addresses)
        runner, decoder = Runner(), round_decoder()
        owner: dict[str, int] = {}  # what each front admitted, as the test sent it
        expected = [[] for _ in range(fronts)]  # each front's (kind, id, value), in the order sent
        received = [[] for _ in range(fronts)]
        counts = [0] * fronts
        for sent, refusals, outputs in trips:
            for front, kind in sent:
                front %= fronts
                counts[front] += 1
                if kind == "admit":
                    group_id = f"g{front}-{counts[front]}"
                    owner[group_id] = front
                    group = RequestGroup(group_id, [([1, 2], SamplingParams())])
                    sides[front][0].send(pickle.dumps(Admit(group)))
                else:  # a call's id is the front's own count: the fronts' ids collide
                    sides[front][0].send(pickle.dumps(Call(counts[front], "asleep", (front, counts[front]))))
            commands = _received(links, len(sent))
            done = Round(admissions=[], outputs=[], replies=[])
            refusals = iter(refusals)
            for command in commands:
                if isinstance(command, Admit):
                    group_id = command.requests.request_id
                    error = ValueError("refused") if next(refusals, False) else None
                    done.admissions.append((group_id, error))
                    expected[owner[group_id]].append(("admission", group_id, error is not None))
                    if error is None:
                        runner.groups.add(group_id)
                else:
                    front, front_call_id = command.args  # what the front asked, to check where it goes
                    done.replies.append((command.call_id, (front, front_call_id)))
                    expected[front].append(("reply", front_call_id, (front, front_call_id)))
            held = sorted(runner.groups)
            for position, finished in outputs if held else []:
                group_id = held[position % len(held)]
                if group_id not in runner.groups:
                    continue  # it finished earlier in this round
                done.outputs.append((group_id, StepOutput(group_id, [7], None, finished, None, -1, 2, 0)))
                expected[owner[group_id]].append(("output", group_id, finished))
                if finished:
                    runner.groups.discard(group_id)
            links.send(done, runner, idle=not runner.groups)
            for front, (_, pull) in enumerate(sides):
                while pull.poll(0):
                    part = decoder.decode(pull.recv())
                    received[front] += [("admission", g, e is not None) for g, e in part.admissions]
                    received[front] += [("reply", i, tuple(v)) for i, v in part.replies]
                    received[front] += [("output", g, out.finished) for g, out in part.outputs]
        for front in range(fronts):
            assert sorted(map(repr, received[front])) == sorted(map(repr, expected[front])), front
            # in order, kind by kind: a front's outputs come as the engine made them
            for kind in ("admission", "reply", "output"):
                assert [r for r in received[front] if r[0] == kind] == [e for e in expected[front] if e[0] == kind]
        assert not links._owners.keys() - runner.groups, "no owner kept for a group the engine let go"
        links.close()
    finally:
        context.destroy(linger=0)


def _received(links: FrontLinks, count: int) -> list:
    """The `count` commands the fronts sent, as FrontLinks takes them (inproc delivers at once)."""
    commands = []
    while len(commands) < count:
        commands += links.receive(wait=True)
    return commands


def test_a_dead_front_never_stops_the_engines_rounds(tmp_path):
    """Rounds for a front that has died queue without end rather than wait: a step that waited on
    them would stall every other front's streams while the server stops. (Over IPC, as served:
    a connecting socket keeps its queue while its peer is gone.)"""
    context, blocked = zmq.Context(), False
    try:
        addresses = [(f"ipc://{tmp_path}/commands-{i}", f"ipc://{tmp_path}/rounds-{i}") for i in range(2)]
        sides = []
        for commands_address, rounds_address in addresses:
            push, pull = context.socket(zmq.PUSH), context.socket(zmq.PULL)
            push.bind(commands_address)
            pull.bind(rounds_address)
            sides.append((push, pull))
        links = FrontLinks(context, addresses)
        runner = Runner()
        sides[1][0].send(pickle.dumps(Admit(RequestGroup("g", [([1, 2], SamplingParams())]))))
        _received(links, 1)
        runner.groups.add("g")
        links.send(Round(admissions=[("g", None)], outputs=[], replies=[]), runner, idle=False)
        sides[1][1].close(linger=0)  # front 1 dies, its group still running
        out = StepOutput("g", [7], None, False, None, -1, 2, 0)

        def steps():
            for _ in range(5000):
                links.send(Round(admissions=[], outputs=[("g", out)], replies=[]), runner, idle=False)

        stepping = threading.Thread(target=steps, daemon=True)
        stepping.start()
        stepping.join(timeout=30)
        blocked = stepping.is_alive()
        assert not blocked, "a step waited on a dead front's queue"
        links.close()
    finally:
        if not blocked:  # else its socket is the blocked thread's: the context is left to the process's end
            context.destroy(linger=0)
