"""The wire between the server and the engine's own process (trillm/engine/core_process.py):
its messages and how they are encoded.

Commands go one ZeroMQ message each, pickled (a request group with its prompts and parameters;
a LoRA adapter's weights with the call that loads it); an empty message (STOP) ends the engine's
loop. Back comes, first, READY and a pickled Ready (what it serves: its config, settings,
tokenizer, stats and adapters' records), or FAILED and the pickled exception that stopped it
loading; then one msgspec-encoded Round per trip: what msgpack cannot carry as it is (an error,
a pooled vector, a call's reply, which may be any record) inside it pickled, as an extension.
Pickle crosses only between these two processes of one user, over sockets in a 0700 directory.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass

import msgspec
import torch

from trillm.config import EngineArgs
from trillm.engine.rounds import Round
from trillm.engine.stats import EngineStats
from trillm.model.loader import ModelConfig
from trillm.model.lora import LoRAAdapter

READY, FAILED = b"R", b"F"  # the first message's tag
STOP = b""  # the command that ends the engine's loop
PICKLED = 1  # msgpack extension code: a value pickled


@dataclass(frozen=True)
class Ready:
    """What the server needs of a loaded engine: what it serves, and how (its LoRA adapters'
    records, without their weights)."""

    config: ModelConfig
    args: EngineArgs
    tokenizer: object
    stats: EngineStats
    adapters: list[LoRAAdapter]


def pickled(value) -> bytes:
    """`value` pickled; one that does not survive pickling crosses as a RuntimeError naming it."""
    try:
        data = pickle.dumps(value)
        pickle.loads(data)
    except Exception:  # noqa: BLE001 - any failure to rebuild it
        data = pickle.dumps(RuntimeError(repr(value)))
    return data


def opaque(value) -> msgspec.msgpack.Ext:
    """A value a Round carries pickled whatever it is (msgspec would send a dataclass as a plain map)."""
    return msgspec.msgpack.Ext(PICKLED, pickled(value))


def round_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def round_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(type=Round, ext_hook=_ext_hook, dec_hook=_dec_hook)


def _enc_hook(obj):
    if isinstance(obj, torch.Tensor):  # a pooled vector: on the host, so the server never touches the device
        return msgspec.msgpack.Ext(PICKLED, pickle.dumps(obj.cpu()))
    if isinstance(obj, BaseException):
        return opaque(obj)
    raise NotImplementedError(f"a Round cannot carry {type(obj).__name__}")


def _ext_hook(code: int, data: memoryview):
    assert code == PICKLED, code
    return pickle.loads(data)


def _dec_hook(kind: type, obj):
    if isinstance(obj, kind):  # a pickled extension, already rebuilt by _ext_hook
        return obj
    raise NotImplementedError(kind)
