"""Folders import each other one way: ``stagehand.strategy`` uses ``stagehand.layer_offload``, never
the reverse."""

import ast
from pathlib import Path

import stagehand.layer_offload


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_layer_offload_imports_nothing_of_the_strategies():
    files = sorted(Path(stagehand.layer_offload.__file__).parent.glob("*.py"))
    assert len(files) >= 5
    found = {
        f.name: sorted(n for n in _imported(f) if n.startswith("stagehand.strategy")) for f in files
    }
    assert found == {f.name: [] for f in files}
