"""``workbench demo-assets``: build the local models, the digits folder, the demo's trained VAE
and base model, and check the encoder."""

from __future__ import annotations

import argparse
import time

from runtime.assets.cache import AssetError, cache_root
from runtime.assets.digits import build_digits
from runtime.assets.models import ARCHS, SIZES, build_all, build_model
from runtime.assets.text_encoder import minilm_path
from runtime.trainer.demo import build_demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="workbench demo-assets",
        description="Build the demo models (sharded safetensors), the digits image folder, the "
        "demo's VAE and base model trained on the digits (a few minutes on 2 CPU cores, once) "
        "and locate the MiniLM text encoder, into the cache folder. A second call is a no-op.",
    )
    parser.add_argument(
        "--cache-dir",
        help="cache folder (default $STAGEHAND_WORKBENCH_CACHE or ~/.cache/stagehand-workbench)",
    )
    parser.add_argument("--arch", choices=ARCHS, help="build only this architecture")
    parser.add_argument("--size", choices=SIZES, help="with --arch: only this size")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    try:
        root = cache_root(args.cache_dir)
        if args.arch:
            sizes = [args.size] if args.size else ["tiny", "small"]
            paths = {f"{args.arch}-{s}": build_model(args.arch, s, root) for s in sizes}
        else:
            paths = build_all(root)
            paths["digits"] = build_digits(root)
            paths["demo"] = build_demo(root, log=print)
        paths["text-encoder"] = minilm_path()
    except AssetError as exc:
        print(f"workbench demo-assets: {exc}")
        return 2
    for name, path in paths.items():
        print(f"{name:<14} {path}")
    print(f"ready in {time.perf_counter() - t0:.1f} s (cache {root})")
    return 0
