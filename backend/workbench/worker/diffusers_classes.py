"""diffusers classes by name, safe to resolve from several threads at once.

diffusers imports a class's module on first access to ``diffusers.<Name>`` (its lazy module).
Two of the server's request threads resolving classes at once (two plans, a plan beside a
folder inspection) can see a module another thread is still importing: a plan of
``FluxTransformer2DModel`` was refused as "not in diffusers" while a second plan resolved it.
One lock around the lookup makes the first import happen once, in one thread.
"""

from __future__ import annotations

import threading

_RESOLVING = threading.Lock()


def diffusers_class(name: str) -> type:
    """The diffusers class ``name`` (``FluxTransformer2DModel``, ``FluxPipeline``...).

    Raises:
        AttributeError: diffusers has no class of that name.
    """
    with _RESOLVING:
        import diffusers

        cls = getattr(diffusers, name, None)
    if not isinstance(cls, type):
        raise AttributeError(f"diffusers has no class {name!r}")
    return cls
