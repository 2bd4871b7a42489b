"""``./dev test`` reruns the tests marked ``parity`` on ATen's baseline kernels, from the folders
its ``-m parity`` line names (collecting no more of the suite than it must): every test module
that marks a test ``parity`` lies under one of them, so none is left out of that rerun."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parity_folders() -> list[str]:
    text = (REPO / "dev").read_text()
    found = re.findall(r"-m parity ((?:tests/\S+ ?)+)", text)
    assert len(found) == 1, "dev: expected one `-m parity tests/...` line"
    return found[0].split()


def test_every_parity_test_is_in_a_folder_the_rerun_collects():
    folders = parity_folders()
    assert folders and all((REPO / f).is_dir() for f in folders), folders
    marked = sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "tests").rglob("test_*.py")
        if re.search(r"pytest\.mark\.parity\b", p.read_text())
    )
    assert len(marked) >= 10, marked  # the suite's exactness tests (runtime, worker)
    outside = [m for m in marked if not any(m.startswith(f + "/") for f in folders)]
    assert outside == [], f"parity tests outside the rerun's folders {folders}: {outside}"
