"""Keep the garbage collector off what a process loads once.

A server process holds millions of objects that live as long as it does: torch, transformers,
the tokenizer, the model's modules, the app. CPython's full collection walks every tracked
object, and any thread that allocates can trigger one while holding the interpreter lock, so
on a loaded heap each full collection stalls the event loop and every stream with it (a body
of a few hundred thousand JSON items was enough to set one off). `freeze_heap()` moves what
exists after startup into the collector's permanent generation, which collections skip; what
requests allocate later is collected as before. vLLM's engine and API server do the same.
At exit they go back to the collector (an atexit hook): the interpreter's last collections
skip frozen objects, so cycles among them (Triton's bindings hold some) would outlive their
extension modules, which then report them as leaks. Not sooner: a process that serves again
(tests start hundreds of servers) would walk the whole heap in each freeze's collection.

Loading also leaves freed memory in the C heap (a GGUF tensor's repacking slices, the tokenizer's
conversion), which glibc keeps for later allocations: resident, and counted against the memory a
served file may take. `freeze_heap()` hands it back to the system once, when startup is over, and
the GGUF loader after each tensor (`trim_c_heap`), so that the freed slices of one never pile up
under the next. Serving, a CPU step of prompt tokens leaves its layers' temporaries there in
turn (`TrimAfterPrompts`).

Start-up itself runs with the collector paused (`collector_paused`, around the command line's
`serve`): importing torch and transformers and building a tokenizer allocate hundreds of
thousands of objects that live as long as the process, and those allocations set off full
collections, each walking everything loaded so far and finding next to nothing. Once the imports
are done, before the model loads, `freeze_imports` exempts what they made without a collection:
their garbage is a few thousand small cycles made once (functions, classes, typing aliases), while
walking the few hundred thousand objects imported to find it is most of a collection's time.
`freeze_heap`'s one collection then walks only what the load made, takes what it left as garbage,
and turns the collector back on.

A trim reaches all of one arena's free pages only in glibc's main arena: a thread's arena keeps
its top chunk, where the engine's step thread leaves a prompt step's temporaries. A server
process therefore allocates from one arena (`one_malloc_arena`).
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import functools
import gc
import os
from collections.abc import Iterator

M_ARENA_MAX = -8  # glibc's mallopt parameter: the most arenas malloc makes


def freeze_heap() -> None:
    """Collect what startup left as garbage, then exempt every surviving object from later
    collections. Call it once the process has loaded what it serves with and before it serves;
    calling it again freezes what came since (cheap: frozen objects are not walked again).
    Cyclic garbage made of objects frozen here is never collected, so a part that is replaced
    while serving (new weights, an adapter) must not rely on the collector to free it. Turns
    the collector back on where `collector_paused` turned it off."""
    gc.collect()
    gc.freeze()
    gc.enable()
    trim_c_heap()
    _thaw_at_exit()


def freeze_imports() -> None:
    """Exempt every object that exists now from collections, without a collection first (the
    module docstring). Call it in a start-up with the collector paused (`collector_paused`), once
    its imports are done and before anything else: what exists by then is never collected before
    exit."""
    assert not gc.isenabled(), "only in a start-up with the collector paused"
    gc.freeze()
    _thaw_at_exit()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Automatic collections off for a server's start-up (the module docstring): enter it before
    the heavy imports. `freeze_heap` turns them back on once start-up is over, and leaving the
    block does where that never came (a start-up refused or stopped before serving), so that a
    caller's process collects as before; a process that serves no model in it (a data-parallel
    supervisor) turns them on with `gc.enable()`."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@functools.cache
def _thaw_at_exit() -> None:
    atexit.register(gc.unfreeze)


@functools.cache
def _libc_function(name: str):
    libc = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(libc), name, None) if libc is not None else None


def one_malloc_arena() -> None:
    """Every thread of this process, and of the processes it starts, allocates from glibc's
    main arena, whose free pages a trim hands back whole (the module docstring). Call it before
    the process starts a thread: a thread keeps the arena it has. Where MALLOC_ARENA_MAX is set
    already, that is the user's choice, and glibc has read it. Elsewhere than glibc, nothing."""
    mallopt = _libc_function("mallopt")
    if "MALLOC_ARENA_MAX" in os.environ or mallopt is None:
        return
    os.environ["MALLOC_ARENA_MAX"] = "1"  # read by glibc as each child starts
    mallopt(M_ARENA_MAX, 1)


def trim_c_heap() -> None:
    """glibc's malloc_trim: the heap's free pages back to the system (nothing elsewhere)."""
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim(0)


class TrimAfterPrompts:
    """Hands the C heap's free pages back once prompts give way to decoding. A CPU step of
    prompt tokens frees its layers' temporaries (a few MiB each at hundreds of tokens) into
    glibc's heap, fragmented, where decode steps, whose temporaries are a few rows, never need
    them again: resident, they would sit beside the growing KV cache and the drafts' logits for
    as long as the requests decode. Trimming at the first step without prompt tokens, once
    `min_tokens` of them have been computed since the last trim, costs a few milliseconds a
    wave of prompts (and the next wave's faults), not a trim every step."""

    def __init__(self, min_tokens: int):
        self.min_tokens = min_tokens
        self.pending = 0  # prompt tokens computed since the last trim

    def step(self, prompt_tokens: int) -> bool:
        """Count a step's prompt tokens; at a step with none, trim if `min_tokens` were counted.
        Returns whether it trimmed. Call it once a step's temporaries are freed."""
        if prompt_tokens:
            self.pending += prompt_tokens
            return False
        if self.pending < self.min_tokens:
            return False
        self.pending = 0
        trim_c_heap()
        return True
