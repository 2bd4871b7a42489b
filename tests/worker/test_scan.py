"""The dataset scan on a messy folder built here, caption encodings, and the conversions that
used to damage images (16-bit PNGs, transparency, EXIF orientation), for the image and the
video families alike."""

import numpy as np
import pytest
import torch
from PIL import Image

from tests.worker.messy_data import BAD, LEFT_OUT, USABLE, WARNED, build_messy
from workbench.worker.clips import load_clip
from workbench.worker.data import load_image, load_sample, to_rgb
from workbench.worker.scan import DataError, Sample, read_caption, scan_folder


def _reasons(scan, bad: bool) -> dict[str, str]:
    return {s.file: s.reason for s in scan.skipped if s.bad is bad}


def test_messy_folder_scan_names_every_file_left_out(tmp_path):
    scan = scan_folder(build_messy(tmp_path / "messy"))
    assert [s.files[0].name for s in scan.samples] == USABLE
    bad = _reasons(scan, bad=True)
    assert sorted(bad) == sorted(BAD)
    for name, reason in BAD.items():
        assert bad[name].startswith(reason), (name, bad[name])
    listed = _reasons(scan, bad=False)
    assert sorted(listed) == sorted(LEFT_OUT)
    for name, reason in LEFT_OUT.items():
        assert listed[name].startswith(reason), (name, listed[name])
    warned = {w.file: w.message for w in scan.warnings}
    assert sorted(warned) == sorted(WARNED)
    for name, message in WARNED.items():
        assert warned[name].startswith(message), (name, warned[name])
    captions = {s.files[0].name: s.caption for s in scan.samples}
    assert captions["l_latin1.png"] == "café au lait" and captions["k_no_caption.png"] == ""
    assert captions["G_UPPER.PNG"] == "a picture called G_UPPER.PNG"
    assert scan.problem() is None  # on_bad_file: skip goes on with 9 samples
    record = scan.record()
    assert (record["usable"], record["bad"], len(record["skipped"])) == (9, 4, 9)
    assert {"file": "orphan.txt", "reason": "caption without an image", "bad": True} in (
        record["skipped"]
    )


def test_fail_policy_and_a_folder_without_a_usable_image(tmp_path):
    folder = build_messy(tmp_path / "messy")
    strict = scan_folder(folder, on_bad_file="fail")
    with pytest.raises(DataError) as info:
        strict.check()
    text = str(info.value)
    assert text.startswith("data.on_bad_file is fail and 4 file(s) cannot be used:")
    assert all(f"  {name}: " in text for name in BAD)
    for name in USABLE:
        (folder / name).unlink()
    empty = scan_folder(folder)
    assert empty.problem().startswith(f"data.path: no usable image in {str(folder)!r}:")
    assert "  i_empty.png: empty file (0 bytes)" in empty.problem()
    clips = scan_folder(folder, videos=True)  # a video family's folder
    assert clips.problem().startswith(f"data.path: no usable image or clip in {str(folder)!r}:")
    limited = scan_folder(build_messy(tmp_path / "again"), default_caption="untitled", limit=2)
    assert [s.caption for s in limited.samples] == [
        "a picture called G_UPPER.PNG",
        "a picture called a_gray.png",
    ]


def test_captions_in_other_encodings_are_read_with_a_warning(tmp_path):
    cases = {
        "bom.txt": ("\ufeffa cat".encode(), "a cat", None),
        "utf16.txt": ("a dog".encode("utf-16"), "a dog", "read as UTF-16"),
        "cp1252.txt": (b"\x93quoted\x94", "\u201cquoted\u201d", "read as cp1252"),
        "latin1.txt": (b"odd \x81 byte", "odd \x81 byte", "read as Latin-1"),
    }
    for name, (raw, text, warning) in cases.items():
        (tmp_path / name).write_bytes(raw)
        caption, said = read_caption(tmp_path / name)
        assert caption == text, name
        assert (said is None) if warning is None else (warning in said), (name, said)


def test_sixteen_bit_png_is_scaled_not_clipped(tmp_path):
    ramp16 = np.tile(np.linspace(0, 65535, 64), (8, 1)).astype(np.uint16)
    Image.fromarray(ramp16).save(tmp_path / "ramp16.png")
    Image.fromarray(np.rint(ramp16 / 257).astype(np.uint8)).save(tmp_path / "ramp8.png")
    wide = load_image(tmp_path / "ramp16.png", (8, 64))  # (3, 8, 64)
    narrow = load_image(tmp_path / "ramp8.png", (8, 64))
    assert float((wide - narrow).abs().max()) <= 1 / 127.5
    assert float((wide == 1.0).float().mean()) == pytest.approx(1 / 64)  # only the last column


def test_transparent_pixels_take_the_background(tmp_path):
    rgba = np.zeros((4, 4, 4), dtype=np.uint8)
    rgba[:2, :, 3] = 0  # top: black under full transparency
    rgba[2:, :] = (255, 0, 0, 128)  # bottom: half-transparent red
    img = Image.fromarray(rgba, mode="RGBA")
    white = np.asarray(to_rgb(img))
    assert white[0, 0].tolist() == [255, 255, 255]
    assert white[3, 0].tolist() == [255, 127, 127]
    black = np.asarray(to_rgb(img, (0, 0, 0)))
    assert black[0, 0].tolist() == [0, 0, 0] and black[3, 0].tolist() == [128, 0, 0]
    palette = img.convert("RGB").convert("P")
    palette.info["transparency"] = palette.getpixel((0, 0))  # black is transparent
    assert np.asarray(to_rgb(palette, (0, 0, 255)))[0, 0].tolist() == [0, 0, 255]


def test_a_caption_whose_extension_differs_in_case_is_the_images(tmp_path):
    """``IMG_1.JPG`` + ``IMG_1.TXT`` (Windows, cameras): the caption was listed as "caption
    without an image" and the image trained uncaptioned."""
    for name in ("IMG_1.JPG", "IMG_2.png", "img_3.png"):
        Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(tmp_path / name)
    (tmp_path / "IMG_1.TXT").write_text("upper case")
    (tmp_path / "IMG_2.Txt").write_text("mixed case")
    (tmp_path / "img_3.txt").write_text("exact")
    (tmp_path / "img_3.TXT").write_text("folded")
    scan = scan_folder(tmp_path)
    assert [(s.files[0].name, s.caption) for s in scan.samples] == [
        ("IMG_1.JPG", "upper case"),
        ("IMG_2.png", "mixed case"),
        ("img_3.png", "exact"),  # an exact match wins
    ]
    assert [(s.file, s.reason) for s in scan.skipped] == [("img_3.TXT", "caption without an image")]
    assert scan.warnings == []


def test_exif_orientation_turns_a_phone_photo_upright(tmp_path):
    # A phone stores a portrait photo as landscape pixels tagged "rotate 90 clockwise" (6).
    stored = np.zeros((40, 80, 3), dtype=np.uint8)  # (H, W, 3): 80 wide, 40 high as stored
    stored[:, :40] = 255  # the stored left half white: the top half once upright
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation
    Image.fromarray(stored).save(tmp_path / "portrait.jpg", exif=exif.tobytes(), quality=95)
    sample = Sample((tmp_path / "portrait.jpg",), "a portrait")
    for pixels in (load_sample(sample, 96, True), load_clip(sample, 1, 96, True)[0]):
        assert tuple(pixels.shape) == (3, 128, 64)  # the portrait bucket, not the landscape one
        assert float(pixels[:, :60].mean()) > 0.95 and float(pixels[:, 68:].mean()) < -0.95


def test_video_families_read_images_as_the_image_families_do(tmp_path):
    """A still image in a Wan / LTX-2 folder: 16-bit scaled, not clipped; transparent pixels
    on ``data.background`` (they came out clipped to white, and black, before)."""
    ramp16 = np.tile(np.linspace(0, 65535, 64), (64, 1)).astype(np.uint16)
    Image.fromarray(ramp16).save(tmp_path / "ramp16.png")
    Image.fromarray(np.zeros((64, 64, 4), dtype=np.uint8), mode="RGBA").save(tmp_path / "clear.png")
    for name in ("ramp16.png", "clear.png"):
        sample = Sample((tmp_path / name,), "")
        for background in ((255, 255, 255), (0, 0, 255)):
            clip = load_clip(sample, 1, 64, False, background)  # (1, 3, 64, 64)
            assert tuple(clip.shape) == (1, 3, 64, 64)
            assert torch.equal(clip[0], load_sample(sample, 64, False, background))
    blue = load_clip(Sample((tmp_path / "clear.png",), ""), 1, 64, False, (0, 0, 255))[0]
    assert blue[:, 0, 0].tolist() == [-1.0, -1.0, 1.0]
    assert float(
        (load_clip(Sample((tmp_path / "ramp16.png",), ""), 1, 64, False) == 1).float().mean()
    ) == pytest.approx(1 / 64)


def test_messy_folder_trains_with_every_bad_file_named(cache_env, tmp_path, make_preset, run_io):
    from workbench.worker.cli import main

    folder = build_messy(tmp_path / "messy")
    preset = make_preset(
        data={"factory": None, "path": str(folder)}, max_steps=2, checkpoint_every=None
    )
    run_dir = tmp_path / "run"
    assert main([str(preset), "--run-dir", str(run_dir)]) == 0
    recs = run_io.records(run_dir)
    scan = recs[0]  # recorded before anything else, before any model is built or loaded
    assert (scan["source"], scan["kind"]) == ("trainer", "dataset_scan")
    assert scan["folder"] == str(folder) and scan["usable"] == len(USABLE)
    assert {s["file"] for s in scan["skipped"] if s["bad"]} == set(BAD)
    assert {s["file"] for s in scan["skipped"] if not s["bad"]} == set(LEFT_OUT)
    assert {w["file"] for w in scan["warnings"]} == set(WARNED) and scan["problem"] is None
    stages = run_io.of(recs, "trainer", "stage")
    assert stages[0]["message"].startswith(f"{len(USABLE)} samples")
    assert [r["step"] for r in run_io.of(recs, "trainer", "step")] == [1, 2]
    assert recs[-1]["kind"] == "run_finished" and recs[-1]["status"] == "succeeded"


@pytest.mark.parametrize("policy", ["skip", "fail"])
def test_a_run_that_cannot_use_its_data_fails_before_any_model_loads(
    cache_env, tmp_path, make_preset, run_io, policy
):
    from workbench.worker.cli import main

    folder = build_messy(tmp_path / "messy")
    if policy == "skip":  # nothing usable left
        for name in USABLE:
            (folder / name).unlink()
    data = {"factory": None, "path": str(folder), "on_bad_file": policy}
    run_dir = tmp_path / "run"
    assert main([str(make_preset(data=data)), "--run-dir", str(run_dir)]) == 1
    recs = run_io.records(run_dir)
    assert [r["kind"] for r in recs] == ["dataset_scan", "error"]
    error = recs[-1]
    assert error["error_type"] == "DataError" and error["message"] == recs[0]["problem"]
    assert all(f"  {name}: {reason}" in error["message"] for name, reason in BAD.items())
    assert not (run_dir / "lora").exists()
