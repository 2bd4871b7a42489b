"""The application's tools around the memory runtimes (``stagehand``) and the training worker
(``worker``): the model and data factory (``assets``) and the demo build's status file
(``asset_status``), presets loaded by name and checked whole (``preset``), the planner
(``plan``: VRAM and step time before launch, tune) and the benchmark suite (``bench``).
"""
