"""Distributed plumbing of the training loop: pipeline P2P, gradient finalisation and norms, megatron-core's own collectives (their bytes and their trace), and megatron-core on CPU (gloo)."""
