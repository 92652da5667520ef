"""The doors between trillm's parts, read from the sources' import statements (top-level and
inside functions alike, in .py and Cython .pyx files):

- the lower layers (kernels, sched_ext, model) import nothing from the engine or the HTTP layer;
- the HTTP layer reaches the engine through its one door, `trillm.engine.api`, and never the
  model, the kernels or the scheduler directly;
- the engine imports nothing from the HTTP layer;
- the launcher (what `trillm serve` runs around the app) imports the HTTP layer, never the
  other way round, and nothing below either imports it.
"""
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "trillm"
IMPORT = re.compile(r"^\s*(?:from\s+(trillm[\w.]*)\s+c?import\b|c?import\s+(trillm[\w.]*))", re.M)


def imports(package: str) -> dict[str, set[str]]:
    """Each module of `package` (its path under trillm/) -> the trillm modules it names."""
    found = {}
    for path in sorted((ROOT / package).rglob("*")):
        if path.suffix in (".py", ".pyx", ".pxd"):
            names = {a or b for a, b in IMPORT.findall(path.read_text())}
            found[str(path.relative_to(ROOT))] = names
    assert found, f"no sources under {package}"
    return found


def crossing(package: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> list[str]:
    return sorted(f"{module} imports {name}" for module, names in imports(package).items() for name in names
                  if name.startswith(forbidden) and name not in allowed)


@pytest.mark.parametrize("package", ["kernels", "sched_ext", "model"])
def test_lower_layers_import_no_engine_and_no_http(package):
    assert crossing(package, ("trillm.engine", "trillm.http")) == []


def test_http_reaches_the_engine_through_its_door_alone():
    below = ("trillm.engine", "trillm.model", "trillm.kernels", "trillm.sched_ext")
    assert crossing("http", below, allowed=("trillm.engine.api",)) == []
    assert any("trillm.engine.api" in names for names in imports("http").values())


def test_engine_imports_no_http():
    assert crossing("engine", ("trillm.http",)) == []


@pytest.mark.parametrize("package", ["http", "engine", "model", "kernels"])
def test_nothing_under_the_launcher_imports_it(package):
    assert crossing(package, ("trillm.launch",)) == []


def test_the_scanner_sees_a_crossing(tmp_path, monkeypatch):
    """The check can fail: a module that reaches past the door is reported."""
    (tmp_path / "http").mkdir()
    (tmp_path / "http" / "route.py").write_text("def f():\n    from trillm.engine.core import EngineCore\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert crossing("http", ("trillm.engine",), allowed=("trillm.engine.api",)) == [
        "http/route.py imports trillm.engine.core"]
