"""`python -m trillm.http.router_main ARGS`: sglang-router's launcher, with the replicas' API key
taken from the environment rather than the command line.

The router sends the key on its own calls to the replicas (/health, /get_load); given on its
command line, it would be readable by every local user in /proc/*/cmdline. The supervisor
(trillm/http/data_parallel.py) sets ROUTER_KEY_VARIABLE in the router's environment alone,
which only the same user can read, and this launcher moves it into the router's arguments.
"""
from __future__ import annotations

import os
import sys

ROUTER_KEY_VARIABLE = "TRILLM_ROUTER_WORKER_API_KEY"


def main(argv: list[str] | None = None) -> None:
    from sglang_router.launch_router import launch_router, parse_router_args

    args = parse_router_args(sys.argv[1:] if argv is None else argv)
    args.api_key = os.environ.pop(ROUTER_KEY_VARIABLE, None) or None
    launch_router(args)


if __name__ == "__main__":
    main()
