"""Everything fp8lm changes or reads inside megatron-core, in one place, for one megatron-core version.

fp8lm builds on megatron-core's public modules (``GPTModel``, ``ModuleSpec``, the schedules, ``parallel_state``);
where it has to reach further, it does so here, and only for :data:`MEGATRON_CORE_VERSION`. Any other installed
version is refused at start-up (:func:`check_megatron_core_version`, called by ``pretrain_gpt.py``'s argument
validation) instead of failing somewhere inside a patched module. Each entry: what, why, what it relies on.

- :mod:`.cpu` (megatron-core on CPU with gloo, inactive where CUDA exists): rebinds ``torch`` in 8 megatron-core
  modules to a view whose ``cuda`` allocations land on the CPU, replaces the CUDA RNG tracker by named CPU generator
  states, and all-reduces tied embeddings in place. Why: megatron-core hard-codes CUDA where a GPT step reaches.
  Relies on: those modules' names and their module-level ``torch`` imports; ``tensor_parallel.random``'s tracker
  and RNG helpers; ``LanguageModule.setup_embeddings_and_output_layer``.
- :mod:`.core_trace` (``--collective-trace``): rebinds ``torch.distributed`` in 5 megatron-core modules to a
  recording view. Why: megatron-core's own collectives must be in the trace NCCL's rules are checked on. Relies on:
  those modules' module-level ``torch.distributed`` imports.
- :mod:`.pipeline_p2p` (FP8 pipeline messages): ``FP8P2PCommunicator`` subclasses ``P2PCommunicator`` and overrides
  its private ``_communicate``. Why: the schedules call ``_communicate`` for every stage exchange; FP8 messages and
  one ``batch_isend_irecv`` group per exchange replace it there. Relies on: ``_communicate``'s signature.
- :func:`index_header` (data): the private ``_INDEX_HEADER`` of megatron-core's ``indexed_dataset``. Why: a corrupt
  or foreign ``.idx`` is refused with the command that rebuilds it instead of megatron-core's assertion. Relies on:
  the header bytes.

Importing this package imports no megatron-core; :func:`index_header` imports it when called.
"""

from __future__ import annotations

__all__ = ["MEGATRON_CORE_VERSION", "MegatronCoreVersionError", "check_megatron_core_version", "index_header"]

MEGATRON_CORE_VERSION = "0.16.1"
"""The one megatron-core version these patches are written and tested against (``requirements.txt`` pins it)."""


class MegatronCoreVersionError(RuntimeError):
    """The installed megatron-core is not :data:`MEGATRON_CORE_VERSION`; the message names the fix."""


def check_megatron_core_version(installed: str | None = None) -> str:
    """The installed megatron-core version (``installed`` given: that one), refused unless it is
    :data:`MEGATRON_CORE_VERSION`. Reads the package metadata: megatron-core is not imported."""
    if installed is None:
        from importlib import metadata

        try:
            installed = metadata.version("megatron-core")
        except metadata.PackageNotFoundError:
            raise MegatronCoreVersionError(
                f"megatron-core is not installed: pip install megatron-core=={MEGATRON_CORE_VERSION} "
                f"(or make install)") from None
    if installed != MEGATRON_CORE_VERSION:
        raise MegatronCoreVersionError(
            f"megatron-core {installed} is installed; fp8lm patches and reads megatron-core "
            f"{MEGATRON_CORE_VERSION} only (megatron/training/compat/): pip install "
            f"megatron-core=={MEGATRON_CORE_VERSION}")
    return installed


def index_header() -> bytes:
    """The first bytes of every megatron-core ``.idx`` file (its private ``_INDEX_HEADER``)."""
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER

    return _INDEX_HEADER
