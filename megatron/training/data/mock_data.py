"""Synthetic token data for tests and benchmarks (``--mock-data``): learnable, deterministic, any size."""

from __future__ import annotations

import torch

__all__ = ["MockGPTDataset"]


class MockGPTDataset:
    """Sample ``i`` is a sequence from a fixed random first-order Markov chain over ``vocab_size`` tokens
    (each token has 4 likely successors), drawn with a generator seeded by ``(seed, i)``: the same sample
    on every rank and run, and a loss that falls as a model learns the chain. Items are megatron-core
    GPTDataset-style dicts: ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` (length ``seq_length``).
    """

    def __init__(self, vocab_size: int, seq_length: int, num_samples: int, seed: int) -> None:
        self.vocab_size, self.seq_length, self.num_samples, self.seed = vocab_size, seq_length, num_samples, seed
        g = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(0, vocab_size, (vocab_size, 4), generator=g)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + int(index) * 7_919 + 1) % (2**63))
        choices = torch.randint(0, 4, (self.seq_length + 1,), generator=g)
        noise = torch.rand(self.seq_length + 1, generator=g) < 0.1
        random_tokens = torch.randint(0, self.vocab_size, (self.seq_length + 1,), generator=g)
        seq = torch.empty(self.seq_length + 1, dtype=torch.int64)
        seq[0] = random_tokens[0]
        for t in range(1, self.seq_length + 1):
            seq[t] = random_tokens[t] if noise[t] else self.successors[seq[t - 1], choices[t]]
        return {
            "tokens": seq[:-1].clone(),
            "labels": seq[1:].clone(),
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float32),
            "position_ids": torch.arange(self.seq_length, dtype=torch.int64),
        }
