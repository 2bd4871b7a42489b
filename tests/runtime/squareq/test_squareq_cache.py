"""SquareQ's cache is verified before a run reads it: every corruption tried (flipped
bytes, an understated tensor, random data, a zeroed header, a header length of 2^64 - 1, an
empty file, a garbage ``squareq.json``) is found at set-up, the folder replaced by a fresh
quantization, and the run trains the losses of an intact cache; the checksum is hashed once per
process; nothing but the cache's own files is deleted."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest

from stagehand.squareq import checksum, store
from tests.runtime.squareq.test_squareq_runtime import runtime
from tests.runtime.weights._train import train


def flip(folder):
    """256 bytes of the data section inverted, mid-file (a packed weight's codes)."""
    path = folder / store.FILE
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 256] = bytes(b ^ 0xFF for b in data[mid : mid + 256])
    path.write_bytes(bytes(data))


def understate(folder):
    """The largest tensor declared one element short in the header (same header length)."""
    path = folder / store.FILE
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    key = max(
        (k for k in header if k != "__metadata__"),
        key=lambda k: header[k]["data_offsets"][1] - header[k]["data_offsets"][0],
    )
    assert header[key]["dtype"] == "U8"  # a packed weight: one byte an element
    header[key]["shape"][0] -= 1
    header[key]["data_offsets"][1] -= 1
    raw = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(data[:8] + raw.ljust(n) + data[8 + n :])


def randomize(folder):
    path = folder / store.FILE
    path.write_bytes(os.urandom(path.stat().st_size))


def zero_header(folder):
    path = folder / store.FILE
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    path.write_bytes(bytes(8 + n) + data[8 + n :])


def huge_length(folder):
    path = folder / store.FILE
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2**64 - 1) + data[8:])


def empty(folder):
    (folder / store.FILE).write_bytes(b"")


def garbage_meta(folder):
    (folder / store.META).write_bytes(b"\x00\x9fnot json{")


CASES = {
    "flipped-bytes": flip,
    "understated-tensor": understate,
    "random-data": randomize,
    "zeroed-header": zero_header,
    "length-2^64-1": huge_length,
    "empty-file": empty,
    "garbage-squareq-json": garbage_meta,
}


@pytest.fixture(scope="module")
def intact(tiny_flux, tmp_path_factory):
    """``(folder, losses)``: an intact int8 cache of the tiny FLUX and the losses of 2 steps
    trained on it."""
    cache = tmp_path_factory.mktemp("intact")
    model, rt, _ = runtime(tiny_flux, cache)
    losses, _ = train(model, rt, steps=2)
    rt.close()
    (folder,) = cache.iterdir()
    return folder, losses


@pytest.mark.parametrize("case", CASES)
def test_a_corrupt_cache_is_replaced_before_anything_trains(tiny_flux, intact, tmp_path, case):
    good, losses = intact
    cache = tmp_path / "sq"
    folder = cache / good.name
    shutil.copytree(good, folder)
    CASES[case](folder)
    model, rt, _ = runtime(tiny_flux, cache)
    assert train(model, rt, steps=2)[0] == losses  # the intact cache's numbers
    rt.close()
    info = rt.squareq.info
    assert info["cached"] is False
    assert info["replaced"].startswith(f"SquareQ cache {folder} did not verify: ")
    assert info["replaced"].endswith("; deleted and quantized again")
    assert sorted(os.listdir(cache)) == [good.name]  # the corrupt folder held only our files
    assert store.cached_meta(folder, verify=True)["cached"] is True
    assert (folder / store.FILE).read_bytes() == (good / store.FILE).read_bytes()


def test_what_failed_is_named(intact, tmp_path):
    """``cached_meta``'s reason per case: the planner shows it, a refused run raises it."""
    good, _ = intact
    expected = {
        "flipped-bytes": "blocks.safetensors does not match the checksum written when it was "
        "quantized",
        "understated-tensor": "data byte",
        "random-data": "blocks.safetensors: header length",
        "zeroed-header": "blocks.safetensors: the 0-byte header is not UTF-8 JSON",
        "length-2^64-1": "blocks.safetensors: header length 18446744073709551615 bytes",
        "empty-file": "blocks.safetensors is 0 bytes, squareq.json records",
        "garbage-squareq-json": "squareq.json is not readable JSON",
    }
    for case, corrupt in CASES.items():
        folder = tmp_path / case / good.name
        shutil.copytree(good, folder)
        corrupt(folder)
        if case == "flipped-bytes":  # sizes and header intact: only the checksum sees it
            assert store.cached_meta(folder)["cached"] is True
        with pytest.raises(store.CorruptCacheError) as info:
            store.cached_meta(folder, verify=True)
        message = str(info.value)
        assert message.startswith(f"SquareQ cache {folder} does not verify: "), case
        assert expected[case] in message, (case, message)
        assert message.endswith(
            f"delete it (rm -r '{folder}') and the next run quantizes the checkpoint again"
        )


def test_a_folder_holding_more_than_the_cache_is_kept_aside(tiny_flux, intact, tmp_path):
    good, losses = intact
    cache = tmp_path / "sq"
    folder = cache / good.name
    shutil.copytree(good, folder)
    garbage_meta(folder)
    (folder / "notes.txt").write_text("mine")
    model, rt, _ = runtime(tiny_flux, cache)
    assert train(model, rt, steps=2)[0] == losses
    rt.close()
    (aside,) = [p for p in cache.iterdir() if p != folder]
    assert aside.name.startswith(f"{good.name}.corrupt-")
    assert (aside / "notes.txt").read_text() == "mine"
    assert f"kept as {aside}" in rt.squareq.info["replaced"]


def test_a_folder_that_cannot_be_moved_is_refused_by_name(tiny_flux, intact, tmp_path, monkeypatch):
    good, _ = intact
    cache = tmp_path / "sq"
    folder = cache / good.name
    shutil.copytree(good, folder)
    flip(folder)
    real = type(folder).rename

    def refuse(self, target):
        if self == folder:
            raise PermissionError(13, "Permission denied")
        return real(self, target)

    monkeypatch.setattr(type(folder), "rename", refuse)
    with pytest.raises(store.CorruptCacheError) as info:
        runtime(tiny_flux, cache)
    assert str(info.value).startswith(f"SquareQ cache {folder} does not verify: ")
    assert f"rm -r '{folder}'" in str(info.value) and "could not be moved aside" in str(info.value)


def test_the_checksum_is_hashed_once_per_process_per_file_version(intact, tmp_path, monkeypatch):
    good, _ = intact
    folder = tmp_path / good.name
    shutil.copytree(good, folder)
    hashed = []
    real = checksum.file_digest
    monkeypatch.setattr(checksum, "file_digest", lambda p, **k: hashed.append(p) or real(p, **k))
    assert store.cached_meta(folder, verify=True) and len(hashed) == 1
    assert store.cached_meta(folder, verify=True) and len(hashed) == 1  # remembered
    os.utime(folder / store.FILE, ns=(1, 1))  # written since: hashed again
    assert store.cached_meta(folder, verify=True) and len(hashed) == 2


@pytest.mark.parametrize("threads", [1, 3])
def test_the_tree_hash_of_the_writer_is_the_files(tmp_path, monkeypatch, threads):
    """Fed in pieces that straddle chunk boundaries, ``TreeHash`` equals ``file_digest`` of the
    file on any number of threads; one byte changed changes it."""
    monkeypatch.setattr(checksum, "CHUNK_BYTES", 1000)
    monkeypatch.setattr(checksum, "READ_BYTES", 300)
    data = os.urandom(4321)
    tree = checksum.TreeHash()
    for start in range(0, len(data), 777):
        tree.update(data[start : start + 777])
    path = tmp_path / "f"
    path.write_bytes(data)
    assert checksum.file_digest(path, threads) == tree.hexdigest()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert checksum.file_digest(path, threads) != tree.hexdigest()
    (tmp_path / "empty").write_bytes(b"")
    assert checksum.file_digest(tmp_path / "empty", threads) == checksum.TreeHash().hexdigest()


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_the_device_branch_writes_the_bytes_and_errors_of_the_cpu_one(tiny_flux, tmp_path, fmt):
    """``_write`` given a device (a CUDA one in a run: NOTE [ Quantizing on the GPU ]; here the
    CPU, through the same branch: weights moved, codes and scales copied back, its own threads)
    writes the same file and the same errors as the CPU's path, in bf16."""
    import torch

    from stagehand.squareq.runtime import cache_entries
    from stagehand.weights import find_blocks
    from stagehand.weights.convert import register_blocks
    from stagehand.weights.sources import SafetensorsCheckpoint
    from tests.runtime.weights._train import make_model

    model = make_model("flux", tiny_flux).to(torch.bfloat16)
    source = SafetensorsCheckpoint(tiny_flux)
    blocks = register_blocks(model, find_blocks(model), source, True, False, False, 0.1)
    entries = cache_entries(blocks, source)
    assert any(e.quantized for e in entries)
    written = []
    for name, device in (("plain", None), ("device", torch.device("cpu"))):
        path = tmp_path / name
        errors, digest = store._write(source, entries, fmt, path, None, device)
        written.append((path.read_bytes(), digest, errors))
    source.close()
    assert written[0] == written[1]
    assert store.quantize_threads(100, torch.device("cpu")) == store.GPU_THREADS
