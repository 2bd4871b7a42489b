"""Errors of the weight streaming runtime. Set-up errors are raised when the runtime is built,
naming the parameter, block or field at fault, never on step 40 (house style, diffusers hooks)."""

from __future__ import annotations


class StagehandError(RuntimeError):
    """Base class of the weight runtime's run-time errors."""


class StagehandSetupError(ValueError):
    """Base class of errors raised while building the runtime (bad model, checkpoint or config)."""


class BlockDiscoveryError(StagehandSetupError):
    """No repeated blocks were found, or ``block_pattern`` matched nothing."""


class UnmatchedParameterError(StagehandSetupError):
    """A parameter has no tensor in the checkpoint (it is never filled with zeros)."""


class ParameterMismatchError(StagehandSetupError):
    """A parameter's shape or dtype differs from its checkpoint tensor."""


class BlockTooLargeError(StagehandSetupError):
    """A block cannot be staged or placed at all with the configured pool and VRAM budget."""


class PoolConfigError(StagehandSetupError):
    """The pinned pool cannot be built (zero slabs, non-positive sizes)."""


class SlabTimeoutError(StagehandError):
    """A slab acquire waited longer than ``slab_acquire_timeout_s``; names the holders."""


class FrozenParameterError(StagehandError):
    """A block parameter frozen when the runtime was built requires grad now (unfrozen mid-run):
    which block parameters train is fixed at set-up."""


class BlockStateError(StagehandError):
    """An illegal block state transition; names the state expected and the state found."""


class LostWriteError(StagehandError):
    """A block parameter with no host copy (read from its checkpoint file, or held by SquareQ in
    8 bits) was written between steps while its block was on the device: the write would be
    lost at the block's eviction. Names the parameter."""
