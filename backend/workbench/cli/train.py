"""``workbench train``: one training run (``workbench.worker.cli``) with the planner's activation peak,
which ``"auto"`` limits resolve with at build (``workbench.plan.activation_peak``). The worker's layer
sits below the planner's; this entry point, above both, hands it in."""

from __future__ import annotations

from workbench.plan.activation_peak import planned_activation_peak
from workbench.worker.cli import main as worker_main


def main(argv: list[str] | None = None) -> int:
    return worker_main(argv, activation_peak=planned_activation_peak)
