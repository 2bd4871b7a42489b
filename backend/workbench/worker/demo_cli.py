"""``workbench demo-assets``: build the digits, the demo's trained VAE and base model and the
factory models as resumable stages (``demo_stages``), with a progress bar per stage and the
status file the dashboard reads; check the encoder.

Exit status: 0 built (or already built), 1 a stage failed (named, with its error; run the
command again to retry from that stage), 2 bad input, 3 another process is already building
into this cache, 130 interrupted (run it again to resume).
"""

from __future__ import annotations

import argparse
import sys
import time

from workbench.worker.asset_status import STATUS_FILE
from workbench.worker.assets.cache import AssetError, cache_root
from workbench.worker.assets.models import ARCHS, SIZES, build_model
from workbench.worker.assets.stages import BuildBusy, Interrupted, run_stages
from workbench.worker.assets.text_encoder import minilm_path
from workbench.worker.demo import demo_spec
from workbench.worker.demo_stages import all_stages

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_BUSY, EXIT_INTERRUPTED = 1, 2, 3, 130


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="workbench demo-assets",
        description="Build the digits image folder, the demo's VAE and base model trained on "
        "the digits (~4 minutes on one core, once) and the factory models into the cache "
        "folder, as resumable stages, and locate the MiniLM text encoder. Stages already built "
        "are kept: a second call is a no-op, and a call after a failure or an interruption "
        "resumes at the stage that did not finish.",
    )
    parser.add_argument(
        "--cache-dir",
        help="cache folder (default $STAGEHAND_WORKBENCH_CACHE or ~/.cache/stagehand-workbench)",
    )
    parser.add_argument("--arch", choices=ARCHS, help="build only this factory architecture")
    parser.add_argument("--size", choices=SIZES, help="with --arch: only this size")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    try:
        root = cache_root(args.cache_dir)
        minilm = minilm_path()
        if args.arch:
            sizes = [args.size] if args.size else ["tiny", "small"]
            for s in sizes:
                print(f"{args.arch}-{s:<9} {build_model(args.arch, s, root)}")
            return 0

        stages = all_stages(root, demo_spec(), log=lambda line: print(line, file=sys.stderr))
    except (AssetError, ValueError) as exc:
        print(f"workbench demo-assets: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"demo assets: building into {root} (progress in {root / STATUS_FILE})", flush=True)
    try:
        status = run_stages(stages, root)
    except BuildBusy as exc:
        print(f"workbench demo-assets: {exc}; its progress: {root / STATUS_FILE}", file=sys.stderr)
        return EXIT_BUSY
    except (KeyboardInterrupt, Interrupted):
        print("\ndemo assets: interrupted; run `workbench demo-assets` again to resume")
        return EXIT_INTERRUPTED
    if status["state"] != "ready":
        return EXIT_FAILED
    print(f"text encoder   {minilm}")
    print(f"demo assets ready in {time.perf_counter() - t0:.1f} s (cache {root})", flush=True)
    return 0
