"""The expert-parallel token all-to-all (``fp8.parallel.token_a2a``): rows in FP8 with one scale each, on 2 processes.

Each rank sends rows of ``x`` (rows whose magnitudes span 1e-3 to 1e3, so one scale per tensor could not hold them)
with uneven splits, through :func:`fp8.parallel.token_a2a.all_to_all_rows`, then back-propagates a random upstream
gradient. Checked against a float64 reference of the same exchange:

- every received value within its FP8 rounding: ``|q - v| <= 2**-(m+1) |v|`` for a value in the normal range of
  its row's scale, or half the smallest subnormal step ``2**-(emin_sub+1) / scale`` below it (m = 3 for E4M3,
  2 for E5M2), and the gradients sent back likewise in the gradient format;
- without a format the rows arrive bit for bit;
- the bytes counted are exactly the rows sent to the other rank times ``hidden + 4`` (FP8) or ``hidden * 4`` (fp32);
- a row holding inf arrives non-finite (NaN scale), the other rows unaffected.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.distributed as dist

from fp8.comm import Collectives, CommBytesCounter
from fp8.parallel.token_a2a import all_to_all_rows, decode_rows, encode_rows
from tests.spawn import CachedLaunch

SEED = int(os.environ.get("FP8LM_TEST_SEED", random.SystemRandom().randrange(2**31))) % 100_000
HIDDEN = 48
SPLITS = [[3, 7], [5, 0]]  # SPLITS[r][j]: rows rank r sends to rank j
FORMATS = {"e4m3": (3, 2.0**-9), "e5m2": (2, 2.0**-16)}  # mantissa bits, smallest subnormal


def _rows(seed: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 10 + rank)
    n = sum(SPLITS[rank])
    magnitudes = 10.0 ** (torch.rand(n, 1, generator=g, dtype=torch.float64) * 6 - 3)
    return (torch.randn(n, HIDDEN, generator=g, dtype=torch.float64) * magnitudes).float()


def _upstream(seed: int, rank: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 10 + rank + 5)
    magnitudes = 10.0 ** (torch.rand(rows, 1, generator=g, dtype=torch.float64) * 6 - 3)
    return (torch.randn(rows, HIDDEN, generator=g, dtype=torch.float64) * magnitudes).float()


def _worker(rank: int, world: int, port: int, seed: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out = {}
        input_splits = SPLITS[rank]
        output_splits = [SPLITS[j][rank] for j in range(world)]
        for fmt, grad_fmt in ((None, None), ("e4m3", "e5m2"), ("e4m3", "e4m3")):
            counter = CommBytesCounter()
            comm = Collectives(dist.group.WORLD, counter)
            x = _rows(seed, rank).requires_grad_(True)
            y = all_to_all_rows(x, comm, output_splits, input_splits, fmt=fmt, grad_fmt=grad_fmt, tag="moe dispatch")
            y.backward(_upstream(seed, rank, y.shape[0]))
            out[(fmt, grad_fmt)] = {"y": y.detach(), "dx": x.grad, "bytes": dict(counter.by_tag)}
        x = _rows(seed, rank)
        if rank == 0:
            x[0, 0] = float("inf")
        out["inf"] = all_to_all_rows(x, Collectives(dist.group.WORLD), output_splits, input_splits, fmt="e4m3")
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


_launch = CachedLaunch(_worker, "moe_dispatch")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _launch(2, SEED, tmp_path_factory)


def _received(seed: int, rank: int, make) -> torch.Tensor:
    """The rows ``rank`` receives, in rank order (float64): ``make(seed, sender)``'s rows for ``rank``."""
    parts = []
    for j in range(2):
        rows = make(seed, j).double()
        start = sum(SPLITS[j][:rank])
        parts.append(rows[start:start + SPLITS[j][rank]])
    return torch.cat(parts)


def _within_rounding(got: torch.Tensor, want: torch.Tensor, fmt: str) -> None:
    mant, sub = FORMATS[fmt]
    fmax = {"e4m3": 448.0, "e5m2": 57344.0}[fmt]
    amax = want.abs().amax(dim=1, keepdim=True)
    scale = torch.exp2(torch.floor(torch.log2(fmax / amax)))  # the row's power-of-two scale
    bound = torch.maximum(want.abs() * 2.0 ** -(mant + 1), sub / 2 / scale)
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


def test_rows_arrive_within_their_own_fp8_rounding(ranks):
    seed, results = ranks
    for rank, r in enumerate(results):
        want = _received(seed, rank, _rows)
        assert torch.equal(r[(None, None)]["y"].double(), want)  # high precision: bit for bit
        for grad_fmt in ("e5m2", "e4m3"):
            _within_rounding(r[("e4m3", grad_fmt)]["y"], want, "e4m3")


def test_gradients_travel_back_in_the_gradient_format(ranks):
    seed, results = ranks
    for rank, r in enumerate(results):
        # the gradient of the rows rank sent: its receivers' upstream rows for them, in the order it sent them
        parts = []
        for j in range(2):
            upstream = _upstream(seed, j, sum(SPLITS[i][j] for i in range(2))).double()
            start = sum(SPLITS[i][j] for i in range(rank))
            parts.append(upstream[start:start + SPLITS[rank][j]])
        want = torch.cat(parts)
        assert torch.equal(r[(None, None)]["dx"].double(), want)
        for grad_fmt in ("e5m2", "e4m3"):
            _within_rounding(r[("e4m3", grad_fmt)]["dx"], want, grad_fmt)


def test_bytes_counted_are_the_rows_sent_to_the_other_rank(ranks):
    _, results = ranks
    for rank, r in enumerate(results):
        sent = SPLITS[rank][1 - rank]
        back = SPLITS[1 - rank][rank]  # the gradient rows for what this rank received
        assert r[(None, None)]["bytes"] == {"moe dispatch": sent * HIDDEN * 4, "moe dispatch grad": back * HIDDEN * 4}
        for grad_fmt in ("e5m2", "e4m3"):
            assert r[("e4m3", grad_fmt)]["bytes"] == {"moe dispatch": sent * (HIDDEN + 4),
                                                      "moe dispatch grad": back * (HIDDEN + 4)}


def test_a_non_finite_row_arrives_non_finite_and_alone(ranks):
    _, results = ranks
    got = results[0]["inf"]  # rank 0 receives its own first rows, the first of which holds inf, then rank 1's
    assert not bool(torch.isfinite(got[0]).any())
    assert bool(torch.isfinite(got[1:]).all())


def test_encode_decode_round_trip_single_process():
    x = _rows(SEED, 0)
    for fmt in FORMATS:
        wire = encode_rows(x, fmt)
        assert wire.dtype == torch.uint8 and wire.shape == (x.shape[0], HIDDEN + 4)
        _within_rounding(decode_rows(wire, fmt, torch.float32), x.double(), fmt)
