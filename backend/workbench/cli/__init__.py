"""``workbench``: the one command line of the project.

Sub-commands, each implemented by the module named beside it (imported only when used, so the
server never imports torch):

- ``serve``        the dashboard and API on http://127.0.0.1:8000   (workbench.cli.serve)
- ``train``        one training run, the worker the backend launches  (workbench.worker.cli)
- ``bench``        the benchmark suite                                (workbench.bench.cli)
                   ``bench --telemetry``: telemetry latency            (workbench.cli.bench_latency)
- ``demo-assets``  build the local models, digits and text encoder   (workbench.worker.demo_cli)
- ``plan``         predicted VRAM and step time of a preset (workbench.cli.plan)
- ``tune``         trials of limits that fit a VRAM budget          (workbench.plan.tune_cli)
"""

from __future__ import annotations

import importlib
import sys

from workbench.worker.preload import TRAIN, import_frozen

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("workbench.cli.serve", "serve the dashboard and API (default http://127.0.0.1:8000)"),
    "train": ("workbench.cli.train", "run one training job: workbench train PRESET --run-dir DIR"),
    "bench": ("workbench.bench.cli", "run the benchmark suite and print its table"),
    "demo-assets": ("workbench.worker.demo_cli", "build the local demo models, digits and encoder"),
    "plan": ("workbench.cli.plan", "predict a preset's VRAM and step time on a device profile"),
    "tune": ("workbench.plan.tune_cli", "find the fastest limits within a VRAM budget by trials"),
}


def usage() -> str:
    lines = ["usage: workbench COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`workbench COMMAND --help` describes each command's arguments."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"workbench: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    target = COMMANDS[name][0]
    if name == "bench" and "--telemetry" in rest:
        # The backend's own benchmark (telemetry latency, its own arguments): the runtime's
        # bench does not reach into the backend.
        target = "workbench.cli.bench_latency"
    # The command's modules (a worker's: its libraries too) with the collector paused, then
    # frozen: a cold ``workbench train tiny-ci`` 10.3 CPU-s, not 14.3 (``workbench.worker.preload``).
    import_frozen(TRAIN if name == "train" else (target,))
    module = importlib.import_module(target)
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
