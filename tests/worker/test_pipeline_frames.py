"""``data.frames`` left out on a video pipeline (Wan, LTX-2): 1 for a folder of images, for clips
the largest ``t k + 1`` every clip gives (t: the VAE's temporal compression, 4 in Wan, 2 in the
tiny LTX-2), recorded with its reason in ``trainer/run_started``; an explicit value wins."""

import pytest

from tests.worker.conftest import write_clip
from workbench.worker.assets import ENV_VAR
from workbench.worker.cli import main
from workbench.worker.clips import _frames, default_frames, frame_count
from workbench.worker.scan import scan_folder


@pytest.fixture(scope="module")
def uneven_clips(tmp_path_factory):
    """Clips of 7 and 11 frames and an image (a clip of one frame), captioned."""
    import numpy as np
    from PIL import Image

    folder = tmp_path_factory.mktemp("uneven-clips")
    arr = (np.random.default_rng(3).random((60, 120, 3)) * 255).astype("uint8")
    Image.fromarray(arr).save(folder / "00.png")
    (folder / "00.txt").write_text("a photo of the digit zero")
    for i, (n, word) in enumerate([(11, "one"), (7, "two")], start=1):
        write_clip(folder / f"{i:02d}.mp4", n, seed=i)
        (folder / f"{i:02d}.txt").write_text(f"a photo of the digit {word}")
    return folder


def test_default_is_the_largest_tk_plus_1_every_clip_gives(uneven_clips, wide_images):
    clips = scan_folder(uneven_clips, videos=True).samples
    assert [frame_count(s.files[0]) for s in clips[1:]] == [11, 7]
    assert [len(_frames(s.files[0], None)) for s in clips[1:]] == [11, 7]  # as decoded
    frames, why = default_frames(clips, 4)
    assert frames == 5
    assert why == (
        "default: the largest 4k + 1 every clip gives (2 clips, the shortest '02.mp4' has 7 frames)"
    )
    assert default_frames(clips, 2)[0] == 7
    assert default_frames(clips, 8)[0] == 1
    assert default_frames(scan_folder(wide_images, videos=True).samples, 4) == (
        1,
        "default for a folder of images: 1 frame",
    )


def _run(pipe_io, tmp_path, pipeline, folder, name, **data):
    preset = pipe_io.preset(
        tmp_path,
        pipeline,
        folder,
        name=name,
        batch_size=1,
        max_steps=1,
        validation_every=None,
        samples={"prompts": []},
        data={"max_caption_tokens": 16, **data},
    )
    assert main([str(preset), "--run-dir", str(tmp_path / name)]) == 0
    recs = pipe_io.records(tmp_path / name)
    started = pipe_io.of(recs, "trainer", "run_started")
    assert recs[-1]["status"] == "succeeded" and len(started) == 1
    return started[0], recs


def test_wan_and_ltx2_choose_frames_and_record_them(
    wan_pipeline_dir, ltx2_pipeline_dir, uneven_clips, wide_images, tmp_path, monkeypatch, pipe_io
):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "cache"))
    images, _ = _run(pipe_io, tmp_path, wan_pipeline_dir, wide_images, "wan-images")
    assert (images["frames"], images["frames_from"]) == (
        1,
        "default for a folder of images: 1 frame",
    )

    clips, recs = _run(pipe_io, tmp_path, wan_pipeline_dir, uneven_clips, "wan-clips")
    assert clips["frames"] == 5 and clips["frames_from"].startswith("default: the largest 4k + 1")
    latents = [r for r in pipe_io.of(recs, "trainer", "stage") if r["stage"] == "cache"]
    assert latents[-1]["done"] == latents[-1]["total"]

    ltx2, _ = _run(pipe_io, tmp_path, ltx2_pipeline_dir, uneven_clips, "ltx2-clips")
    assert ltx2["frames"] == 7 and ltx2["frames_from"].startswith("default: the largest 2k + 1")

    explicit, _ = _run(pipe_io, tmp_path, wan_pipeline_dir, uneven_clips, "wan-explicit", frames=1)
    assert (explicit["frames"], explicit["frames_from"]) == (1, "data.frames")


def test_a_messy_clip_folder_is_scanned_as_an_image_folder_is(
    wan_pipeline_dir, uneven_clips, tmp_path, monkeypatch, pipe_io
):
    """Wan / LTX-2 folders get the dataset scan too: before it, a clip folder's uncaptioned
    image reached UMT5 as ``None`` (``TypeError: argument of type 'NoneType' is not
    iterable``), and macOS ``._`` files and empty files were taken as images."""
    import shutil

    monkeypatch.setenv(ENV_VAR, str(tmp_path / "cache"))
    folder = tmp_path / "clips"
    folder.mkdir()
    shutil.copy(uneven_clips / "00.png", folder)  # an image without a caption
    shutil.copy(uneven_clips / "01.mp4", folder)
    shutil.copy(uneven_clips / "01.txt", folder)
    (folder / "._01.mp4").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    (folder / "empty.png").write_bytes(b"")
    (folder / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 64)
    (folder / "broken.txt").write_text("a clip cut short")
    started, recs = _run(pipe_io, tmp_path, wan_pipeline_dir, folder, "wan-messy", frames=1)
    (scan,) = pipe_io.of(recs, "trainer", "dataset_scan")
    assert scan["usable"] == 2 and scan["bad"] == 2
    reasons = {s["file"]: s["reason"] for s in scan["skipped"]}
    assert reasons["._01.mp4"] == "hidden file" and reasons["empty.png"] == "empty file (0 bytes)"
    assert reasons["broken.mp4"].startswith("unreadable clip (")
    assert [w["file"] for w in scan["warnings"]] == ["00.png"]

    data = {"path": str(folder), "frames": 1, "on_bad_file": "fail"}
    preset = pipe_io.preset(tmp_path, wan_pipeline_dir, folder, name="wan-fail", data=data)
    assert main([str(preset), "--run-dir", str(tmp_path / "wan-fail")]) == 1
    recs = pipe_io.records(tmp_path / "wan-fail")
    assert [r["kind"] for r in recs] == ["dataset_scan", "error"]
    assert "  broken.mp4: unreadable clip (" in recs[-1]["message"]
