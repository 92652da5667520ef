"""The command line: `trillm serve [MODEL] [--host H] [--port P] [engine flags]`, also `python -m
trillm serve`. Every EngineArgs field is a flag (see trillm.http.settings); the model may come
first without its flag, as `vllm serve MODEL` takes it."""
from __future__ import annotations

import argparse

from trillm.http import settings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trillm", description="An OpenAI-compatible LLM inference server.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible and native endpoints)")
    settings.add_arguments(serve)
    serve.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model to serve, as --model")
    args = parser.parse_args(argv)
    if args.command == "serve":
        if args.model_tag is not None:
            if args.model is not None and args.model != args.model_tag:
                serve.error(f"the model is given twice: {args.model_tag} and --model {args.model}")
            args.model = args.model_tag
        del args.model_tag
        from trillm.heap import collector_paused, one_malloc_arena

        one_malloc_arena()  # before any thread starts
        with collector_paused():  # until the loaded heap is frozen (trillm.heap)
            _serve(serve, args)


def _serve(serve: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Check the flags and the model (exit 2 on either), then serve."""
    from trillm.engine.flag_check import check_flags
    from trillm.launch.serve import run  # torch is imported only when serving, not for --help

    try:
        server_settings = settings.from_args(args)
        check_flags(server_settings.engine)
        if not server_settings.supervises:  # a supervisor stays light; each replica checks its own
            from trillm.http.settings_check import check_settings

            check_settings(server_settings)
        if server_settings.supervises and server_settings.router_policy == settings.RouterPolicy.KV_AWARE:
            from trillm.launch.router_events import check_config

            check_config(server_settings.engine.kv_events_config)
    except ValueError as exc:
        serve.error(str(exc))  # exits 2, as for any flag argparse refuses
    if server_settings.data_parallel_size != 0:  # 0: a front door alone, its replicas elsewhere
        try:
            if server_settings.supervises:
                # in a fork of the server the replicas fork from: a supervisor imports no model code
                from trillm.subprocesses import SERVER, call_preloaded

                call_preloaded("trillm.model.loader:check_model", server_settings.engine, preload=SERVER)
            else:
                from trillm.model.loader import check_model

                check_model(server_settings.engine)
        except (ValueError, OSError) as exc:  # in one line: a model is no usage mistake
            serve.exit(2, f"{serve.prog}: error: {exc}\n")
    run(server_settings)
