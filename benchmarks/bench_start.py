"""Where `trillm serve`'s start goes on a model file: its calls, timed in one fresh process.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_start.py FILE [--rounds N]

Each round is a process of its own (imports are most of a start, and a second import costs
nothing), which times the imports of the serve path (trillm.launch.serve, trillm.engine.api,
trillm.http.app), the header check (`loader.check_model`), the engine (`EngineCore`, with the
GGUF tokenizer's build and the weight loads inside it timed apart) and the app (`create_app`,
which walks the vocabulary once for the prompt bound). The collector is paused, as `trillm
serve` pauses it while it loads (trillm.heap). Seconds, one line a round. The whole start, to
the first answer over HTTP, is what a client sees: measure it from outside (the command to
the first 200 from /v1/models).
"""
import argparse
import subprocess
import sys

ROUND = r"""
import gc, sys, time
gc.disable()
start = time.perf_counter()
import trillm.launch.serve, trillm.engine.api, trillm.http.app
imported = time.perf_counter()
import argparse
from trillm.engine.api import EngineCore
from trillm.http import settings as server_settings
from trillm.http.app import create_app
from trillm.model import gguf_model, loader
spent = {}

def timed(name, fn):
    def call(*args, **kwargs):
        began = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - began
    return call

gguf_model.tokenizer = timed("tokenizer", gguf_model.tokenizer)
loader.load_quantized_weights = timed("quantized", loader.load_quantized_weights)
loader.load_weights = timed("dense", loader.load_weights)
parser = argparse.ArgumentParser()
server_settings.add_arguments(parser)
settings = server_settings.from_args(parser.parse_args(["--model", sys.argv[1]]))
timed("check", loader.check_model)(settings.engine)
core = timed("engine", EngineCore)(settings.engine)
timed("app", create_app)(settings, core)
print(f"imports {imported - start:.2f} check {spent['check']:.2f} engine {spent['engine']:.2f} (tokenizer "
      f"{spent.get('tokenizer', 0.0):.2f} quantized {spent.get('quantized', 0.0):.2f} dense "
      f"{spent.get('dense', 0.0):.2f}) app {spent['app']:.2f}", flush=True)
core.close()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", help="a GGUF file or a model directory")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for _ in range(args.rounds):
        out = subprocess.run([sys.executable, "-c", ROUND, args.file], check=True, capture_output=True, text=True)
        print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
