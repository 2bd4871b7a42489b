"""Folders that stopped the server (issue 54): a FIFO in a pipeline folder held one thread per
inspection until the API stopped answering; malformed ``model_index.json`` entries, list
``weight_map`` values and JSON nested 150k levels deep were 500s (``unhashable type``,
``RecursionError``); a 1 GB caption was read whole. Each is now a named answer: a 4xx naming the
file and key, a time limit on every folder read (504, then 503 when every slot is held), a
caption cut at ``MAX_CAPTION_BYTES`` with a warning. Real FIFOs and files in temp folders; the
app runs in-process (``inprocess.in_process``), the worker in-process (``workbench.worker.cli.main``)."""

from __future__ import annotations

import json
import os
import struct
import threading
import tracemalloc

import pytest
from backend_helpers import assert_error_body
from inprocess import in_process

import workbench.api.data
import workbench.api.pipelines
import workbench.worker.pipelines
import workbench.worker.pipelines.folder
from stagehand.config.safe_read import MAX_JSON_DEPTH, NotRegularFile, json_depth_over, loads
from workbench.contract.preset import PRESETS_DIR
from workbench.contract.preset.merge import merge_overrides
from workbench.services.folder_reads import FolderReads
from workbench.worker.scan import MAX_CAPTION_BYTES, scan_folder

COMPONENTS = ("scheduler", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
COMPONENTS += ("transformer",)
DEEP = 150_000
"""Levels of nesting in the deep-JSON cases (100k-200k were RecursionErrors)."""
ROUTES = ("/api/runs", "/api/presets", "/api/system")
"""Routes that stopped answering once enough threads were stuck on FIFOs."""


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from workbench.worker.diffusers_classes import diffusers_class

    # Imported here, once: a cold import of diffusers' pipelines on a loaded machine can take
    # longer than a folder read's time limit, which is not what these tests are about.
    diffusers_class("FluxPipeline")
    with in_process(tmp_path_factory.mktemp("folders") / "data") as c:
        yield c


def flux_folder(root, index: dict | None = None, index_text: str | None = None):
    """A FluxPipeline folder's layout (``model_index.json``, one empty folder per component),
    its index updated with ``index`` or replaced by ``index_text``."""
    for name in COMPONENTS:
        (root / name).mkdir(parents=True, exist_ok=True)
    entries = {name: ["diffusers", "X"] for name in COMPONENTS}
    entries["transformer"] = ["diffusers", "FluxTransformer2DModel"]
    text = json.dumps({"_class_name": "FluxPipeline", **entries, **(index or {})})
    (root / "model_index.json").write_text(index_text if index_text is not None else text)
    return root


def safetensors(path, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


ONE_TENSOR = b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'


def deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def answered(call, *args, timeout_s: float = 60.0, **kwargs):
    """``call(*args, **kwargs)``'s answer, or a test failure when none comes within
    ``timeout_s`` (before the fix an inspection waited on its FIFO forever)."""
    out = {}

    def run() -> None:
        out["r"] = call(*args, **kwargs)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert "r" in out, f"no answer in {timeout_s} s"
    return out["r"]


def release_readers(fifo) -> None:
    """Ends any open() still waiting on ``fifo`` for a writer (only the unfixed code waits)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # ENXIO: no reader waits
        pass


def test_a_fifo_in_a_pipeline_folder_is_named_and_never_opened(client, tmp_path):
    """``mkfifo transformer/zz.safetensors``: no answer in 60 s, and after 45 such requests
    ``/api/runs``, ``/api/presets`` and ``/api/system`` timed out (53 threads stuck)."""
    folder = flux_folder(tmp_path / "flux")
    fifo = folder / "transformer" / "zz.safetensors"
    os.mkfifo(fifo)
    try:
        for _ in range(45):
            resp = answered(client.post, "/api/pipelines/inspect", json={"path": str(folder)})
            err = assert_error_body(resp, 422)
            assert err["field"] == "path"
            assert err["message"] == (
                f"{fifo}: a FIFO (named pipe), not a regular file; expected safetensors weights"
            )
        for route in ROUTES:
            assert answered(client.get, route, timeout_s=10).status_code == 200, route
    finally:
        release_readers(fifo)
    # The JSON files of the folder too: named for what they are, not "not found".
    (folder / "model_index.json").rename(folder / "index.json")
    os.mkfifo(folder / "model_index.json")
    try:
        resp = answered(client.post, "/api/pipelines/inspect", json={"path": str(folder)})
        assert assert_error_body(resp, 422)["message"].startswith(
            f"{folder / 'model_index.json'}: a FIFO (named pipe), not a regular file; expected"
        )
    finally:
        release_readers(folder / "model_index.json")


def test_fifos_in_a_data_folder_are_bad_files_never_opened(tmp_path):
    """A FIFO caption was "no caption file" and a FIFO image "empty file (0 bytes)" (its
    ``st_size``); a moment's swap of a real file for a FIFO would have hung the scan."""
    from PIL import Image

    from tests.worker.conftest import write_clip

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    os.mkfifo(tmp_path / "a.txt")
    os.mkfifo(tmp_path / "b.png")
    os.mkfifo(tmp_path / "c.mp4")
    write_clip(tmp_path / "d.mp4", 2, size_hw=(16, 16))
    (tmp_path / "d.txt").write_text("a clip")
    try:
        found = answered(scan_folder, tmp_path, videos=True, timeout_s=30).record()
    finally:
        for name in ("a.txt", "b.png", "c.mp4"):
            release_readers(tmp_path / name)
    fifo = "a FIFO (named pipe), not a regular file"
    assert found["usable"] == 1 and found["warnings"] == []
    assert found["skipped"] == [
        {"file": "a.png", "reason": f"its caption a.txt cannot be read ({fifo})", "bad": True},
        {"file": "b.png", "reason": fifo, "bad": True},
        {"file": "c.mp4", "reason": fifo, "bad": True},
    ]


def test_a_read_that_hangs_is_given_up_and_holds_no_more_than_its_slots(
    client, monkeypatch, tmp_path
):
    """Nothing keeps out a folder that does not answer (a stalled network mount): each read has
    a time limit (504 naming the path), a hung read keeps its slot, and with every slot held
    the next request is a 503 at once; the other routes keep answering."""
    release = threading.Event()
    entered = []

    def stalled(path):
        entered.append(path)
        release.wait()
        raise workbench.worker.pipelines.PipelineFolderError(f"{path}: released")

    reads = FolderReads(slots=2, timeout_s=0.5)
    monkeypatch.setattr(workbench.api.pipelines, "READS", reads)
    monkeypatch.setattr(workbench.api.data, "READS", reads)
    monkeypatch.setattr(workbench.worker.pipelines.folder, "detect_family", stalled)
    try:
        for i in range(2):
            resp = answered(client.post, "/api/pipelines/inspect", json={"path": f"/x/{i}"})
            err = assert_error_body(resp, 504)
            assert (err["code"], err["field"]) == ("timeout", "path")
            assert err["message"] == (
                f"path: reading '/x/{i}' took over 0.5 s (the time limit, "
                "STAGEHAND_WORKBENCH_FOLDER_READ_S); something in the folder does not answer"
            )
        resp = answered(client.post, "/api/pipelines/inspect", json={"path": "/x/2"})
        err = assert_error_body(resp, 503)
        assert err["code"] == "busy" and err["message"].startswith("path: '/x/2' not read: 2 ")
        overrides = {"data": {"factory": None, "path": str(tmp_path)}}
        body = {"preset": "tiny-ci", "overrides": overrides}
        assert answered(client.post, "/api/data/scan", json=body).status_code == 503
        assert entered == ["/x/0", "/x/1"]  # the busy requests started nothing
        for route in ROUTES:
            assert answered(client.get, route, timeout_s=10).status_code == 200, route
    finally:
        release.set()
        for thread in threading.enumerate():
            if thread.name.startswith("folder-read"):
                thread.join(10)
    # The slots are free again once the stalled reads end.
    resp = answered(client.post, "/api/pipelines/inspect", json={"path": "/x/3"})
    assert assert_error_body(resp, 422)["message"] == "/x/3: released"


def test_a_scan_that_hangs_answers_504_naming_the_data_path(client, monkeypatch, tmp_path):
    release = threading.Event()
    monkeypatch.setattr(workbench.api.data, "READS", FolderReads(slots=1, timeout_s=0.3))
    monkeypatch.setattr(workbench.api.data, "scan_folder", lambda *a, **k: release.wait())
    body = {"preset": "tiny-ci", "overrides": {"data": {"factory": None, "path": str(tmp_path)}}}
    try:
        err = assert_error_body(answered(client.post, "/api/data/scan", json=body), 504)
    finally:
        release.set()
    assert err["field"] == "overrides.data.path"
    assert err["message"].startswith(f"overrides.data.path: reading {str(tmp_path)!r} took over")


def malformed(tmp_path) -> dict[str, tuple]:
    """Case -> (folder, the start of the message naming the file and key)."""
    cases = {}
    for name, value in (("list", ["FluxPipeline"]), ("dict", {"a": 1})):
        folder = flux_folder(tmp_path / f"class_{name}", {"_class_name": value})
        why = f"{folder / 'model_index.json'}: _class_name is {value!r}; expected one of ["
        cases[f"_class_name {name}"] = (folder, why)
    folder = flux_folder(tmp_path / "entry", {"vae": [123, {"x": 1}]})
    why = f"{folder / 'model_index.json'}: vae is [123, {{'x': 1}}]; expected [\"library\", "
    cases["component entry"] = (folder, why)
    folder = flux_folder(tmp_path / "weight_map")
    index = folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": ["x.safetensors"]}}))
    why = f"{index}: weight_map['a'] is ['x.safetensors']; expected a shard's file name"
    cases["weight_map list"] = (folder, why)
    too_deep = f"objects and arrays nested more than {MAX_JSON_DEPTH} levels deep"
    text = '{"_class_name": "FluxPipeline", "x": ' + deep(DEEP) + "}"
    folder = flux_folder(tmp_path / "deep_index", index_text=text)
    cases["deep model_index.json"] = (
        folder,
        f"{folder / 'model_index.json'}: not readable JSON ({too_deep}",
    )
    folder = flux_folder(tmp_path / "deep_config")
    safetensors(folder / "transformer" / "w.safetensors", ONE_TENSOR, b"\0" * 4)
    (folder / "transformer" / "config.json").write_text('{"x": ' + deep(DEEP) + "}")
    why = f"{folder / 'transformer' / 'config.json'}: not readable JSON ({too_deep}"
    cases["deep config.json"] = (folder, why)
    folder = flux_folder(tmp_path / "deep_header")
    header = ('{"__metadata__": ' + deep(DEEP) + "}").encode()
    weights = folder / "transformer" / "w.safetensors"
    safetensors(weights, header)
    why = f"{weights}: the {len(header)}-byte header is not UTF-8 JSON ({too_deep}"
    cases["deep safetensors header"] = (folder, why)
    return cases


def test_malformed_pipeline_folders_are_422_naming_the_file_and_key(client, tmp_path):
    """Each was a 500: ``unhashable type: 'list'`` / ``'dict'`` or ``RecursionError``."""
    for case, (folder, why) in malformed(tmp_path).items():
        resp = answered(client.post, "/api/pipelines/inspect", json={"path": str(folder)})
        err = assert_error_body(resp, 422)
        assert err["field"] == "path" and err["message"].startswith(why), (case, err)


def test_the_data_scan_names_a_malformed_model_index(client, tmp_path):
    """The scan looks at ``model.path``'s family (video families take clips): its malformed
    ``model_index.json`` was a 500 there too; a folder without one is still no pipeline."""
    from PIL import Image

    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (8, 8)).save(data / "a.png")
    (data / "a.txt").write_text("a caption")
    cases = malformed(tmp_path)
    for case in ("_class_name list", "_class_name dict", "deep model_index.json"):
        folder, why = cases[case]
        model = {"factory": None, "path": str(folder), "text_encoder_model_name": None}
        body = {"preset": "tiny-ci", "overrides": {"model": model, "data": {"path": str(data)}}}
        err = assert_error_body(answered(client.post, "/api/data/scan", json=body), 422)
        assert err["field"] == "overrides.model.path" and err["message"].startswith(why), case
    model = {"factory": None, "path": str(data), "text_encoder_model_name": None}
    body = {"preset": "tiny-ci", "overrides": {"model": model, "data": {"path": str(data)}}}
    assert answered(client.post, "/api/data/scan", json=body).json()["usable"] == 1


def test_a_run_on_a_malformed_folder_fails_naming_the_file_and_key(tmp_path, capsys, monkeypatch):
    """The worker inspects the folder as the API does: its run failed with ``TypeError:
    unhashable type: 'list'``."""
    from workbench.worker.cli import main

    monkeypatch.setenv("STAGEHAND_WORKBENCH_CACHE", str(tmp_path / "cache"))
    cases = malformed(tmp_path)
    for case in ("_class_name list", "component entry", "deep config.json"):
        folder, why = cases[case]
        base = json.loads((PRESETS_DIR / "tiny-ci.json").read_text())
        model = {"factory": None, "path": str(folder), "text_encoder_model_name": None}
        preset = tmp_path / "preset.json"
        preset.write_text(json.dumps(merge_overrides(base, {"model": model})))
        run_dir = tmp_path / f"run-{len(case)}-{case[:5]}"
        assert main([str(preset), "--run-dir", str(run_dir)]) == 1, case
        out = capsys.readouterr().out
        assert f"failed: PipelineFolderError: {why}" in out, (case, out[-2000:])


def test_a_huge_caption_is_cut_with_a_warning_not_read_whole(tmp_path):
    """A 1 GB caption took the server from 0.73 to 2.8 GB during a scan."""
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    with open(tmp_path / "a.txt", "wb") as f:
        f.write("€".encode() * 30_000)  # 90,000 bytes: the cut falls inside a character
        f.truncate(64 << 20)  # a sparse tail of 64 MiB
    tracemalloc.start()
    try:
        found = scan_folder(tmp_path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * MAX_CAPTION_BYTES + (1 << 20), peak  # was over 64 MiB: the whole file
    (sample,) = found.samples
    assert sample.caption == "€" * (MAX_CAPTION_BYTES // 3)  # the split character dropped
    assert [(w.file, w.message) for w in found.warnings] == [
        (
            "a.txt",
            f"{64 << 20} bytes: only the first {MAX_CAPTION_BYTES} are read (the text encoders "
            "read a few hundred tokens); shorten the caption",
        )
    ]


def test_safe_read_refuses_what_is_not_a_regular_file_and_json_too_deep(tmp_path):
    from stagehand.config.safe_read import JsonTooDeep, read_prefix

    os.mkfifo(tmp_path / "fifo")
    for path, kind in (
        (tmp_path / "fifo", "a FIFO (named pipe)"),
        ("/dev/zero", "a character device"),
        (tmp_path, "a folder"),
    ):
        with pytest.raises(NotRegularFile) as info:
            read_prefix(path, 10)
        assert info.value.strerror == f"{kind}, not a regular file"
        assert str(info.value) == f"{path}: {kind}, not a regular file"
    (tmp_path / "f").write_bytes(b"0123456789")
    assert read_prefix(tmp_path / "f", 4) == (b"0123", 10)
    # Depth counts objects and arrays, not brackets inside strings; text opened deeper than
    # the limit is refused before the parser sees it, closing brackets alone are the parser's.
    assert not json_depth_over(b'{"a": [[1]], "b": "[[[[[[["}', 3)
    assert json_depth_over(b'{"a": [[{}]]}', 3)
    assert json_depth_over(b"[[[[", 3)
    assert not json_depth_over(b"]]]]", 3)
    assert loads(deep(MAX_JSON_DEPTH)) is not None
    with pytest.raises(JsonTooDeep, match=f"nested more than {MAX_JSON_DEPTH} levels deep"):
        loads(deep(MAX_JSON_DEPTH + 1))
