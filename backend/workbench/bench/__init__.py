"""The benchmark suite behind ``workbench bench`` (every performance claim comes from it).

``cli`` parses arguments and prints the table, ``configs`` names the rows, ``workload`` is the
measured LoRA step, ``peers`` wraps diffusers group offloading and ``save_on_cpu``, ``probes``
measures pinned H2D bandwidth and the KEEP-path cost, ``runner`` forks one child per row,
``child`` runs inside the child process, ``report`` computes ratios, bounds and goals. The JSON shape is
documented in ``workbench.bench.cli``. ``layer_offload`` is a line of its own (``python -m
workbench.bench.layer_offload``): layer offload beside block streaming and the plain model.
"""
