"""The planner: predicted VRAM and step time of a preset on a device, before launch.

``workbench plan PRESET --device rtx4090`` (``workbench.cli.plan``) reads a preset, builds its
transformer on the ``meta`` device from its config (no weights; dtypes from the safetensors
headers), measures blocks, resident bytes, LoRA and optimizer bytes and each block's saved
activations and FLOPs (``inventory``), and runs the weight runtime's own schedule (its
``BlockScheduler`` and eviction policy) and the activation runtime's spill decision in a
discrete-event simulation with a cost model (``simulate``). ``plan`` puts them together and names
the knob that makes a plan that does not fit fit; ``profiles`` holds the device table.

``feedback`` compares a finished run's measured figures with its plan and scales later plans of
the same device and family by the ratios (the backend stores them: ``backend/workbench/services/calibration.py``);
``tune`` proposes limits within a VRAM budget, run as trials by ``workbench tune`` and
``POST /api/tunes``.
"""

from workbench.plan.inventory import Inventory, PlanInputError, inventory
from workbench.plan.plan import Plan, plan_model, plan_preset
from workbench.plan.profiles import PROFILES, DeviceProfile, cpu_profile, profile

__all__ = [
    "PROFILES",
    "DeviceProfile",
    "Inventory",
    "Plan",
    "PlanInputError",
    "cpu_profile",
    "inventory",
    "plan_model",
    "plan_preset",
    "profile",
]
