"""The dashboard says "disk full at PATH" while the server's writes fail for a full disk, at once
after a save answered 507, and takes it away once space is freed (a real server on a real
16 MiB tmpfs filled to its last byte; Debian chromium). Needs root with mount(8) rights."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.fixtures.disk import fill
from tests.frontend.conftest import PHONE, _start_server, _stop_server, picture

pytestmark = [pytest.mark.browser]


@pytest.fixture
def full_server(tmp_path):
    """``(base URL, data dir)`` of a server whose data dir is a 16 MiB tmpfs."""
    data_dir = (tmp_path / "srv" / "data").resolve()
    data_dir.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(data_dir)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"no tmpfs to fill: mount says {mounted.stderr.decode().strip()!r}")
    proc = None
    try:
        proc, base = _start_server(data_dir)
        yield base, data_dir
    finally:
        if proc is not None:
            _stop_server(proc)
        subprocess.run(["umount", "-l", str(data_dir)], check=True)


SAVE = """async () => {
  const { api } = await import("/static/js/api.js");
  const preset = await api.preset("tiny-ci");
  try { await api.createPreset("full", preset.config, "x".repeat(2000)); return "saved"; }
  catch (err) { return err.describe(); }
}"""


def test_disk_full_banner(full_server, page, open_page):
    base, data_dir = full_server
    page.goto(base)
    page.wait_for_selector("#system-strip .sys-item")
    assert page.locator("#disk-banner").is_hidden()

    filler = fill(data_dir)
    answer = page.evaluate(SAVE)
    assert answer.startswith(f"Disk full at {data_dir}: 0 bytes free; POST /api/presets"), answer
    assert answer.endswith("(HTTP 507, disk_full)"), answer
    banner = page.wait_for_selector("#disk-banner:not([hidden])", timeout=5000)
    assert banner.inner_text().startswith(f"disk full at {data_dir} — 0 bytes free."), (
        banner.inner_text()
    )
    picture(page, "disk-full-desktop", full_page=False)

    small = open_page(PHONE)
    small.goto(base)
    shown = small.wait_for_selector("#disk-banner:not([hidden])", timeout=5000)
    assert f"disk full at {data_dir}" in shown.inner_text()
    box = shown.bounding_box()
    assert box["width"] <= PHONE["width"]  # the long path wraps, no sideways scroll
    assert small.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    picture(small, "disk-full-phone", full_page=False)
    small.close()

    os.remove(filler)
    page.wait_for_selector("#disk-banner", state="hidden", timeout=10_000)
    assert page.evaluate(SAVE) == "saved"
