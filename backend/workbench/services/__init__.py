"""What the server does besides answering HTTP: launching and watching workers
(supervisor, executors), tailing their telemetry (tailer, hub), calibration, limits,
assets, presets, settings."""
