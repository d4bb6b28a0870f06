"""Run a script with the host copies of odd ranks landing late (:class:`fp8.host_read.HostCopy`'s ``late``), as GPU
copies still in flight do: the readiness skew the collective-trace tests train under.

    python -m torch.distributed.run ... tests/skewed_readiness.py pretrain_gpt.py FLAGS...

:func:`skew_readiness` installs it in this process (the in-process tests use it through a fixture); the engine has no
switch for it.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import torch.distributed as dist

if __name__ == "__main__":  # run as a script: the repository's packages, as pretrain_gpt.py finds them
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8 import host_read  # noqa: E402


def skew_readiness() -> object:
    """Make every :class:`HostCopy` made without an explicit ``late`` land late on odd global ranks; returns the
    original ``__init__`` (to restore)."""
    original = host_read.HostCopy.__init__

    def late_on_odd_ranks(self, values, late=None):
        if late is None:
            late = dist.is_available() and dist.is_initialized() and dist.get_rank() % 2 == 1
        original(self, values, late)

    host_read.HostCopy.__init__ = late_on_odd_ranks
    return original


if __name__ == "__main__":
    script = Path(sys.argv[1]).resolve()
    sys.argv = [str(script), *sys.argv[2:]]
    skew_readiness()
    runpy.run_path(str(script), run_name="__main__")
