"""The server's flags and environment variables, made from the settings' dataclasses: an enum
setting takes its names and nothing else, and survives the trip to a child's argv."""
import argparse

import pytest

from trillm.config import AttentionBackend, Device, DType, EngineArgs, KVCacheDType, LoadFormat
from trillm.http import settings
from trillm.pooling_params import PoolingType
from trillm.sched_ext import SchedulingPolicy


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    settings.add_arguments(p)
    return p


def test_the_scheduling_policy_is_an_enum_by_flag_by_variable_and_in_argv():
    parsed = settings.from_args(parser().parse_args(["--scheduling-policy", "priority", "--max-num-seqs", "3"]))
    assert parsed.engine.scheduling_policy is SchedulingPolicy.PRIORITY
    again = settings.from_args(parser().parse_args(settings.to_argv(parsed)))
    assert again == parsed
    from_env = settings.from_env({"TRILLM_SCHEDULING_POLICY": "priority"})
    assert from_env.engine.scheduling_policy is SchedulingPolicy.PRIORITY
    assert EngineArgs(scheduling_policy="fcfs").scheduling_policy is SchedulingPolicy.FCFS


@pytest.mark.parametrize(("field", "value", "member"), [
    ("dtype", "bfloat16", DType.BFLOAT16), ("kv_cache_dtype", "int8", KVCacheDType.INT8),
    ("attention_backend", "torch", AttentionBackend.TORCH), ("load_format", "dummy", LoadFormat.DUMMY),
    ("device", "cpu", Device.CPU), ("pooling_type", "mean", PoolingType.MEAN),
])
def test_every_fixed_choice_is_an_enum_checked_once_when_the_args_are_made(field, value, member):
    """A name becomes its member, by flag, by variable and in code; anything else is refused there,
    naming the field and the choices, not later by the loader or the kernels."""
    assert getattr(EngineArgs(**{field: value}), field) is member
    flag = "--" + field.replace("_", "-")
    assert getattr(settings.from_args(parser().parse_args([flag, value])).engine, field) is member
    assert getattr(settings.from_env({"TRILLM_" + field.upper(): value}).engine, field) is member
    with pytest.raises(ValueError, match=f"{field} is one of .*; got 'nonsense'"):
        EngineArgs(**{field: "nonsense"})


def test_an_unknown_policy_is_refused_everywhere(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["--scheduling-policy", "lifo"])
    err = capsys.readouterr().err
    assert "--scheduling-policy" in err and "'lifo'" in err
    with pytest.raises(ValueError):
        EngineArgs(scheduling_policy="lifo")
    with pytest.raises(ValueError):
        settings.from_env({"TRILLM_SCHEDULING_POLICY": "lifo"})


@pytest.mark.parametrize(("flags", "words"), [
    (["--kv-events-config", '{"endpoint": 5557}'], "--kv-events-config: endpoint must be a string"),
    (["--speculative-config", '{"method": "eagle"}'], "--speculative-config: unknown method 'eagle'"),
    (["--prefix-caching-hash-algo", "md5"], "invalid choice: 'md5' (choose from 'builtin', 'sha256_cbor')"),
    (["--data-parallel-size", "0"], "or 0 with --data-parallel-address"),
    (["--router-policy", "least_loaded"], "invalid choice: 'least_loaded'"),
    (["--dtype", "float8"], "invalid choice: 'float8' (choose from 'auto', 'float32', 'bfloat16', 'float16')"),
    (["--kv-cache-dtype", "fp8"], "invalid choice: 'fp8'"),
    (["--attention-backend", "flash_attn"], "invalid choice: 'flash_attn' (choose from 'auto', 'torch', 'cpu', 'triton')"),
    (["--load-format", "pt"], "invalid choice: 'pt' (choose from 'auto', 'dummy')"),
    (["--device", "tpu"], "invalid choice: 'tpu' (choose from 'auto', 'cpu', 'cuda')"),
    (["--pooling-type", "max"], "invalid choice: 'max' (choose from 'last', 'mean', 'cls')"),
    (["--api-server-count", "0"], "--api-server-count is the HTTP front processes: at least 1"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens is the most tokens a step computes: at least 1"),
    (["--enable-lora", "--tensor-parallel-size", "2"], "not supported under tensor parallelism yet"),
    (["--block-size", "0"], "--block-size is the tokens a KV-cache block holds: at least 1"),
    (["--max-num-seqs", "0"], "--max-num-seqs is the most requests a step runs: at least 1"),
    (["--num-threads", "0"], "--num-threads is torch's intra-op threads: at least 1"),
    (["--kernel-threads", "0"], "--kernel-threads is the compiled kernels' threads: at least 1"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size is the ranks that shard the model: at least 1"),
    (["--max-model-len", "0"], "--max-model-len is the longest context a request may reach: at least 1"),
    (["--max-prefill-pairs", "-1"], "0 for no limit: at least 0"),
    (["--tp-timeout", "0"], "--tp-timeout is the seconds a step's collectives wait for a late rank: more than 0"),
    (["--grammar-compile-timeout", "-1"], "--grammar-compile-timeout is the seconds a grammar may compile"),
    (["--gpu-memory-utilization", "1.5"], "more than 0, at most 1"),
    (["--port", "70000"], "--port is a TCP port"),
    (["--max-waiting", "-1"], "--max-waiting is the requests that may wait for the engine: at least 0"),
    (["--max-body-bytes", "0"], "--max-body-bytes is the largest request body taken: at least 1"),
    (["--drain-timeout", "-1"], "--drain-timeout is the seconds a stop may take: at least 0"),
    (["--responses-store-size", "-1"], "--responses-store-size is the responses kept: at least 0"),
    (["--enable-weight-updates"], "need --allowed-weights-dir"),
    (["--max-lora-adapters", "0"], "--max-lora-adapters must be at least 1"),
    (["--tool-call-parser", "nonesuch"], "Unknown tool_call_parser 'nonesuch'"),
    (["--lora-modules", "a=/p"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "just-a-path"], "--lora-modules takes name=path items"),
    (["--enable-lora", "--max-loras", "0"], "--max-loras and --max-lora-rank must be at least 1"),
    (["--api-server-count", "2", "--no-engine-process"], "cannot serve with --no-engine-process"),
    (["--api-server-count", "2", "--enable-sleep-mode"], "cannot serve with --enable-sleep-mode"),
    (["--api-server-count", "2", "--enable-weight-updates"], "cannot serve with --enable-weight-updates"),
    (["--api-server-count", "2", "--data-parallel-size", "2"], "cannot serve with data parallelism"),
    (["--data-parallel-size", "2", "--router-policy", "kv_aware", "--kv-events-config",
      '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://10.0.0.5:5557"}'],
     "give --kv-events-config an endpoint they bind"),
])
def test_serve_refuses_a_bad_engine_flag_before_loading_anything(flags, words, capsys, monkeypatch):
    """argparse's way (usage, the reason, exit 2) at once, not a traceback after the model loaded."""
    from trillm.launch.cli import main
    from trillm.launch import serve

    monkeypatch.setattr(serve, "run", lambda _: pytest.fail("the server started"))
    with pytest.raises(SystemExit) as exited:
        main(["serve", *flags])
    assert exited.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("asked, device, runs_apart, fronts", [
    (None, "cpu", False, 1),  # measured: no gain on a CPU, a second interpreter's memory
    (None, "cuda", True, 1),  # the loop's sends would hold a GPU's short steps
    (True, "cpu", True, 1),
    (False, "cuda", False, 1),
    (None, "cpu", True, 2),  # several fronts share the engine's own process
])
def test_where_the_engine_runs(asked, device, runs_apart, fronts):
    from trillm.launch.cli import main
    from trillm.launch import serve

    argv = ["serve", "--device", device, "--api-server-count", str(fronts)]
    argv += [] if asked is None else ["--engine-process" if asked else "--no-engine-process"]
    chosen = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(serve, "run", lambda s: chosen.append((s, serve.engine_process(s))))
        main(argv)
    (server_settings, apart), = chosen
    assert apart is runs_apart
    assert settings.from_args(_parsed(settings.to_argv(server_settings))).engine_process is asked, "argv keeps it"


def _parsed(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser)
    return parser.parse_args(argv)
