"""Integrations of the FP8 engine with other training libraries, one module per library.

- :mod:`fp8.integrations.transformers`: ``FP8Trainer`` (a ``transformers.Trainer`` that trains in FP8) and
  ``FP8TrainerMixin`` (the same for any ``Trainer`` subclass).

Each module imports its library (an optional dependency) when it is imported itself; ``import fp8`` and
``import fp8.integrations`` import none of them.
"""
