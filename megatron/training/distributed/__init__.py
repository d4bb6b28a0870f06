"""Distributed plumbing of the training loop: gradient finalisation and norms, and the bytes of megatron-core's own collectives (what patches megatron-core is in :mod:`megatron.training.compat`)."""
