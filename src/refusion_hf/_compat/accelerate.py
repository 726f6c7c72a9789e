"""The seam to accelerate's private names (see `refusion_hf._compat`); tests/_compat/test_accelerate.py checks
`PRIVATE_MEMBERS` against the installed accelerate."""

from __future__ import annotations

from . import ATTRIBUTE

PRIVATE_MEMBERS = (
    # The state every `PartialState` shares (borg pattern). No public setter of the distributed type: accelerate
    # decides it at launch and runs FSDP only on GPUs; `AcceleratorState.__init__` writes this same dict.
    ("accelerate.state:PartialState", "_shared_state", ATTRIBUTE),
)


def set_shared_distributed_type(distributed_type) -> None:
    """Every `PartialState` (and so `Accelerator`) from now on sees `distributed_type`."""
    from accelerate.state import PartialState

    PartialState._shared_state["distributed_type"] = distributed_type
