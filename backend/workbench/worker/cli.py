"""``workbench train PRESET_OR_CONFIG --run-dir DIR [--resume] [--device cpu|cuda] [--card-gb G]``.

The worker the backend launches for each run (``docs/contracts.md``): stage 1 caches text
embeddings and latents (``encode.py``), stage 2 trains (``loop.py``); everything it reports goes
into ONE telemetry stream, ``DIR/telemetry.jsonl``, shared with the memory strategy.

Exit codes: 0 succeeded or cancelled (the last ``trainer/run_finished`` says which), 1 failed
(the last record is ``trainer/error`` with type, message, traceback, ``oom``), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from stagehand.common.card import GIB, card_gb_problem, emulate_card  # noqa: E402
from stagehand.common.memory import cache_host_allocations  # noqa: E402
from stagehand.config.memory import AUTO_DEVICE, check_device  # noqa: E402
from workbench.worker.outputs import folder_problem  # noqa: E402
from workbench.worker.run import ActivationPeak, Run  # noqa: E402


def quiet_libraries() -> None:
    """No per-shard progress bars from diffusers / transformers: our own lines say where we are."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


def device_arg(text: str) -> str:
    """``--device``'s value, checked by the rule the backend's run request uses."""
    try:
        return check_device(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def card_gb_arg(text: str) -> float:
    """``--card-gb``'s value: GiB in (0, 4096], the bench's rule (``card_gb_problem``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--card-gb must be a number of GiB, got {text!r}"
        ) from None
    problem = card_gb_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return value


def pick_device(name: str) -> torch.device:
    """The torch device for ``--device`` (``"auto"``, ``"cpu"`` or ``"cuda:N"``).

    Raises ``SystemExit`` naming the device when CUDA is absent or has no device ``N``."""
    if name == AUTO_DEVICE:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.index is None or device.index >= count:
            raise SystemExit(
                f"workbench train: --device {name} but this machine has {count} CUDA device(s)"
            )
    return device


def main(argv: list[str] | None = None, activation_peak: ActivationPeak | None = None) -> int:
    """``workbench train``. ``activation_peak``: the planner's, for ``"auto"`` limits
    (``workbench.worker.run.ActivationPeak``; ``backend/workbench/cli/train.py`` gives it)."""
    parser = argparse.ArgumentParser(
        prog="workbench train",
        description="Train a LoRA: stage 1 caches text embeddings and latents, stage 2 trains "
        "under the preset's memory strategy. Writes into --run-dir (see docs/contracts.md).",
    )
    parser.add_argument("preset", help="built-in preset name (presets/NAME.json) or a JSON path")
    parser.add_argument("--run-dir", required=True, type=Path, help="folder the run writes into")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    parser.add_argument(
        "--device",
        type=device_arg,
        default=AUTO_DEVICE,
        help='"auto" (CUDA device 0 when present, else the CPU), "cpu", "cuda" or "cuda:N"',
    )
    parser.add_argument(
        "--card-gb",
        type=card_gb_arg,
        default=None,
        help="run as on a card of G GiB: on CUDA the allocator is capped "
        "(set_per_process_memory_fraction), on the CPU the runtimes' tracked device bytes; "
        "a step out of memory is re-planned and run again (docs/contracts.md, oom_recovery)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "0")) or torch.get_num_threads())
    quiet_libraries()
    try:
        args.run_dir.mkdir(parents=True, exist_ok=True)
        device = pick_device(args.device)
        if device.type == "cpu":
            cache_host_allocations()  # block loads reuse freed buffers (stagehand.common.memory)
        if args.card_gb is not None:
            emulate_card(device, int(args.card_gb * GIB))
        run = Run(args.preset, args.run_dir, device, args.resume, activation_peak)
    except OSError as exc:
        print(
            f"workbench train: {folder_problem(args.run_dir, exc, started=False)}", file=sys.stderr
        )
        return 1
    status = 0
    try:
        run.execute()
    except (Exception, KeyboardInterrupt) as exc:
        status = 1
        try:
            run.fail(exc)
        except OSError as inner:  # fail() printed the error; its record cannot be written
            problem = folder_problem(args.run_dir, inner) or inner
            print(f"workbench train: no error record written: {problem}", file=sys.stderr)
    finally:
        run.stop.uninstall()
        run.progress.close()
    try:
        run.telemetry.close()
    except OSError as exc:  # the last records could not reach the file
        if status == 0:
            problem = folder_problem(args.run_dir, exc) or f"telemetry.jsonl: {exc}"
            print(f"workbench train: {problem}", file=sys.stderr)
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
