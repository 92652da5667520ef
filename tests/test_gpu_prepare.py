"""The CUDA check's preparation (docs/gpu.md), exercised here: the wheels the GPU image lacks
resolve, download for CPython 3.12, and fit with the working tree and the model's parts into
transfers of 64 MiB; the parts join into the model's wheel; the `cuda` selection collects and,
without a device, skips what needs one with a reason naming the marker."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest
from packaging.utils import parse_wheel_filename

REPO = Path(__file__).resolve().parent.parent


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would: its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_preparation_resolves_and_every_trip_fits(tmp_path):
    prepare = load_script("gpu_prepare")
    bundle = prepare.prepare(tmp_path)
    brought = set(bundle["packages"])
    # what the image lacks, and nothing it has
    assert {"trio", "hypercorn", "quart-trio", "quart-cors", "xgrammar", "gguf", "openai", "pytest-trio",
            "pydantic", "pydantic-core", "httpx2", "jsonschema", "schemathesis"} <= brought
    assert not brought & {"torch", "triton", "transformers", "safetensors", "pytest", "hypothesis", "numpy", "cython",
                          "httpx"}
    wheels = json.loads((tmp_path / "wheels" / "bundle.json").read_text())["wheels"]
    assert sorted(p.name for p in (tmp_path / "wheels").glob("*.whl")) == wheels and len(wheels) == len(brought)
    def runs_there(tag) -> bool:  # pure Python, or built for CPython 3.12 (or the stable ABI up to it), x86_64 Linux
        python = tag.interpreter in ("py3", "cp312") or (
            tag.abi == "abi3" and tag.interpreter.startswith("cp3") and int(tag.interpreter[3:]) <= 12)
        return python and (tag.platform == "any" or ("linux" in tag.platform and tag.platform.endswith("x86_64")))

    for wheel in wheels:
        assert any(runs_there(t) for t in parse_wheel_filename(wheel)[3]), wheel
    for trip in bundle["trips"]:
        assert trip["bytes"] <= prepare.TRIP_BYTES - prepare.MARGIN_BYTES, trip
    model = bundle["model"]
    joined = b"".join((tmp_path / "model" / part).read_bytes() for part in model["parts"])
    assert hashlib.sha256(joined).hexdigest() == model["sha256"] and len(model["parts"]) == len(bundle["trips"])


def test_this_machine_has_every_requirement_the_check_imports():
    load_script("gpu_check").check_imports()


class Plan:
    """A pytest plugin recording, per test file, what a run set up and what it skipped (and why)."""

    def __init__(self):
        self.set_up: set[str] = set()
        self.skipped: dict[str, str] = {}

    def pytest_runtest_logreport(self, report):
        if report.when == "setup":
            if report.skipped:
                self.skipped[report.nodeid] = report.longrepr[2]
            elif report.passed:
                self.set_up.add(report.nodeid.split("::")[0])


def test_the_cuda_selection_collects_and_skips_without_a_device(monkeypatch):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a device is here: the selection runs for real (scripts/gpu_check.py test)")
    files = ["tests/test_kernels.py", "tests/test_cuda_path.py", "tests/test_cuda_serving.py", "tests/test_model.py",
             "tests/test_lora.py"]
    # One planning run (--setup-plan: collected and set up on paper, nothing executed), in this
    # process, where the modules are imported already: every file contributes to the selection,
    # and what needs a device is skipped with the reason.
    monkeypatch.chdir(REPO)
    plan = Plan()
    status = pytest.main(["-m", "cuda", "--setup-plan", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", *files],
                         plugins=[plan])
    assert status == pytest.ExitCode.OK
    assert len(plan.skipped) == 5 and all("marker cuda: needs a CUDA device" in why for why in plan.skipped.values())
    assert plan.set_up | {node.split("::")[0] for node in plan.skipped} == set(files)


def test_the_wheel_picked_is_the_one_cpython_3_12_on_linux_prefers_and_its_hash_is_checked(tmp_path):
    prepare = load_script("gpu_prepare")
    def entry(name: str) -> dict:
        return {"url": f"https://files.example/{name}", "hashes": {"sha256": "0" * 64}}

    names = ["charset_normalizer-3.5.3-py3-none-any.whl",
             "charset_normalizer-3.5.3-cp37-abi3-manylinux1_x86_64.manylinux_2_28_x86_64.manylinux_2_5_x86_64.whl",
             "charset_normalizer-3.5.3-cp312-cp312-manylinux1_x86_64.manylinux_2_28_x86_64.whl",
             "charset_normalizer-3.5.3-cp313-cp313-manylinux_2_28_x86_64.whl",
             "charset_normalizer-3.5.3-cp312-cp312-manylinux_2_34_x86_64.whl",
             "charset_normalizer-3.5.3-cp312-cp312-win_amd64.whl"]
    for best, offered in ((names[2], names), (names[1], names[:2]), (names[0], names[:1] + names[3:])):
        assert prepare.best_wheel("charset-normalizer", [entry(n) for n in offered]).name == best
    with pytest.raises(SystemExit, match="no wheel for CPython 3.12"):
        prepare.best_wheel("charset-normalizer", [entry(n) for n in names[3:]])

    source = tmp_path / "source.whl"
    source.write_bytes(b"wheel bytes")
    digest = hashlib.sha256(b"wheel bytes").hexdigest()
    fetched = tmp_path / "fetched"
    fetched.mkdir()
    good = prepare.Wheel("a-1.0-py3-none-any.whl", source.as_uri(), digest)
    assert prepare.download(good, fetched).read_bytes() == b"wheel bytes"
    with pytest.raises(SystemExit, match="sha256"):
        prepare.download(prepare.Wheel("b-1.0-py3-none-any.whl", source.as_uri(), "0" * 64), fetched)
    assert sorted(p.name for p in fetched.iterdir()) == [good.name]
