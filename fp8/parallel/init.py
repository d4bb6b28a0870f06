"""Layout-independent, sharded initialisation of tensor-parallel weights.

Every value of a weight is a pure function of ``(key, global row, global column)``: a counter-based
generator (a 32-bit integer hash of the element's global index, two rounds per uniform, Box-Muller for
the normal distribution) computes it from its global position. Each rank therefore materializes only its
own shard (no full-size weight anywhere, on any rank), on the device it asks for, and the initial
weights are identical for every tensor- and pipeline-parallel layout: shard ``r`` of any layout holds
exactly the rows (or columns) of the same global weight.

- :func:`initialize_sharded_weight` (used by :mod:`fp8.parallel.linear`): the key is drawn from the
  default CPU generator, which the caller seeds per layer (``SeededTransformerLayer``), so the keys
  follow the layer, not the layout. Normal initialisers (``functools.partial(torch.nn.init.normal_,
  mean=..., std=...)``, megatron-core's ``init_method_normal`` and ``scaled_init_method_normal``) are
  generated shard-wise; any other initialiser falls back to the full-size weight on the CPU (with a
  warning).
- :func:`fill_normal_shard_` re-initialises an existing shard in place (embeddings and output layers
  megatron-core allocates itself), :func:`name_key` gives a key from a name.

All arithmetic is on int64 tensors with every product kept below 2^63 (no reliance on overflow).
"""

from __future__ import annotations

import functools
import hashlib
import math
import warnings
from collections.abc import Callable

import torch

__all__ = ["initialize_sharded_weight", "fill_normal_shard_", "normal_shard", "name_key", "draw_key", "reinitialize_named_"]

_M32 = 0xFFFFFFFF
_CHUNK = 1 << 20  # elements generated per step: bounds the int64 temporaries (~40 B per element, ~40 MB)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of ``0 <= x < 2^32`` (int64, in place; xorshift-multiply rounds with odd
    constants below 2^31, so every product stays below 2^63)."""
    x ^= x >> 16
    x.mul_(0x7FEB352D).bitwise_and_(_M32)
    x ^= x >> 15
    x.mul_(0x31848BAB).bitwise_and_(_M32)
    x ^= x >> 14
    return x


def _uniform(pair: torch.Tensor, k0: int, k1: int) -> torch.Tensor:
    """Uniform fp32 values in (0, 1) from int64 pair indices (>= 0) and two 32-bit keys."""
    h = _mix32((pair & _M32) ^ k0)
    h ^= (pair >> 32) ^ k1
    h = _mix32(h)
    return (h >> 8).to(torch.float32).add_(0.5).mul_(1.0 / (1 << 24))


def _subkeys(key: int) -> tuple[int, int, int, int]:
    digest = hashlib.blake2b(int(key).to_bytes(16, "little", signed=True), digest_size=16).digest()
    return tuple(int.from_bytes(digest[4 * i:4 * i + 4], "little") for i in range(4))  # type: ignore[return-value]


def _normal_from_index(index: torch.Tensor, keys: tuple[int, int, int, int], aligned: bool) -> torch.Tensor:
    """N(0, 1) values of the elements with global flat indices ``index`` (2-D, int64): element ``g`` is
    component ``g % 2`` (cos, sin) of the Box-Muller pair ``g // 2``. ``aligned``: every row of ``index``
    starts at an even index and has even width (each pair is hashed once then)."""
    rows, width = index.shape
    pair = (index[:, 0::2] if aligned else index) >> 1
    u1 = _uniform(pair, keys[0], keys[1])
    u2 = _uniform(pair, keys[2], keys[3])
    radius = u1.log_().mul_(-2.0).sqrt_()
    angle = u2.mul_(2.0 * math.pi)
    if aligned:
        return torch.stack([radius * torch.cos(angle), radius.mul_(torch.sin(angle))], dim=-1).reshape(rows, width)
    return torch.where(index % 2 == 0, radius * torch.cos(angle), radius * torch.sin(angle))


def name_key(*parts: object) -> int:
    """A 62-bit key from ``parts`` (e.g. seed and parameter name), the same in every process."""
    text = "/".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 2


def draw_key() -> int:
    """A 62-bit key drawn from the default CPU generator (one draw, no device involved)."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64, device="cpu"))


def _row_ranges(size: int, partition_dim_size: int, rank: int, world: int, stride: int) -> list[tuple[int, int]]:
    """Global [begin, end) index ranges along the partition dimension held by ``rank`` (megatron's
    strided partitioning: blocks ``rank, rank + world, ...`` of ``world * stride``)."""
    block = partition_dim_size // (world * stride)
    return [((rank + j * world) * block, (rank + j * world + 1) * block) for j in range(stride)]


def _check_divisible(full_shape, partition_dim: int, world_size: int, stride: int) -> int:
    """The size of ``full_shape`` along ``partition_dim``, refused unless ``world_size * stride`` blocks
    split it evenly."""
    size = full_shape[partition_dim]
    if size % (world_size * stride):
        raise ValueError(
            f"dimension {partition_dim} of a {tuple(full_shape)} weight is not divisible by tensor-parallel size "
            f"{world_size} x stride {stride}; choose sizes divisible by the tensor-parallel size"
        )
    return size


def fill_normal_shard_(
    out: torch.Tensor, key: int, full_shape: tuple[int, ...], partition_dim: int = 0, rank: int = 0,
    world_size: int = 1, stride: int = 1, std: float = 1.0, mean: float = 0.0,
) -> torch.Tensor:
    """Fill ``out`` (this rank's shard of a 1-D or 2-D ``full_shape`` weight, on any device) in place
    with its values of N(``mean``, ``std``^2) drawn from ``key``: the same values, element for
    element, as the matching slice of the full weight at any ``world_size``."""
    if out.is_meta:
        return out
    full_shape = tuple(int(s) for s in full_shape)
    if len(full_shape) == 1:
        full_shape, view = (full_shape[0], 1), out.view(-1, 1)
        partition_dim = 0
    elif len(full_shape) == 2:
        view = out
    else:
        raise ValueError(f"fill_normal_shard_ takes 1-D or 2-D weights, got {full_shape}")
    rows, cols = full_shape
    size = _check_divisible(full_shape, partition_dim, world_size, stride)
    keys = _subkeys(key)
    device = out.device
    offset = 0  # along the partition dimension of the shard
    with torch.no_grad():
        for begin, end in _row_ranges(rows, size, rank, world_size, stride):
            if partition_dim == 0:
                step = max(1, _CHUNK // max(1, cols))
                col = torch.arange(cols, device=device, dtype=torch.int64)
                for r0 in range(begin, end, step):
                    r1 = min(end, r0 + step)
                    row = torch.arange(r0, r1, device=device, dtype=torch.int64)
                    index = row[:, None] * cols + col[None, :]
                    values = _normal_from_index(index, keys, cols % 2 == 0)
                    view[offset + r0 - begin: offset + r1 - begin].copy_(values.mul_(std).add_(mean))
            else:
                step = max(1, _CHUNK // max(1, end - begin))
                col = torch.arange(begin, end, device=device, dtype=torch.int64)
                for r0 in range(0, rows, step):
                    r1 = min(rows, r0 + step)
                    row = torch.arange(r0, r1, device=device, dtype=torch.int64)
                    index = row[:, None] * cols + col[None, :]
                    values = _normal_from_index(index, keys, cols % 2 == 0 and begin % 2 == 0 and (end - begin) % 2 == 0)
                    view[r0:r1, offset: offset + end - begin].copy_(values.mul_(std).add_(mean))
            offset += end - begin
    return out


def normal_shard(
    key: int, full_shape: tuple[int, int], partition_dim: int, rank: int, world_size: int, stride: int = 1,
    std: float = 1.0, mean: float = 0.0, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
) -> torch.Tensor:
    """A new tensor: this rank's shard of the N(``mean``, ``std``^2) weight of ``key`` (see
    :func:`fill_normal_shard_`)."""
    shape = list(full_shape)
    shape[partition_dim] //= world_size
    out = torch.empty(shape, dtype=torch.float32, device=device)
    return fill_normal_shard_(out, key, full_shape, partition_dim, rank, world_size, stride, std, mean).to(dtype)


def _normal_params(init_method: Callable) -> tuple[float, float] | None:
    """(mean, std) when ``init_method`` is a partial of ``torch.nn.init.normal_``, else None."""
    if isinstance(init_method, functools.partial) and init_method.func is torch.nn.init.normal_ and not init_method.args:
        kw = init_method.keywords
        if set(kw) <= {"mean", "std"}:
            return float(kw.get("mean", 0.0)), float(kw.get("std", 1.0))
    return None


_WARNED: set[str] = set()


def initialize_sharded_weight(
    full_shape: tuple[int, int],
    partition_dim: int,
    rank: int,
    world_size: int,
    init_method: Callable[[torch.Tensor], object] | None,
    stride: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """This rank's shard (fp32 unless ``dtype``) of a ``full_shape`` weight initialised by ``init_method``,
    on ``device`` (default: the default device, e.g. inside ``with torch.device("cuda")``).

    The full weight is split along ``partition_dim`` into ``world_size * stride`` equal blocks and rank
    ``r`` keeps blocks ``r, r + world_size, ...`` (megatron-core's strided partitioning, used by fused
    gated projections). ``init_method=None`` leaves the weight zero. Normal initialisers generate only
    the shard (module docstring); others initialise the full weight on the CPU and keep the shard.
    """
    size = _check_divisible(full_shape, partition_dim, world_size, stride)
    shape = list(full_shape)
    shape[partition_dim] //= world_size
    if init_method is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    normal = _normal_params(init_method)
    if normal is not None:
        mean, std = normal
        return normal_shard(draw_key(), tuple(full_shape), partition_dim, rank, world_size, stride, std, mean,
                            dtype, device)
    name = getattr(init_method, "__qualname__", repr(init_method))
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(f"initialize_sharded_weight: {name} is not a normal initialiser; every rank builds the full "
                      f"{tuple(full_shape)} weight on the CPU to keep its shard", stacklevel=2)
    full = torch.zeros(full_shape, dtype=torch.float32)
    init_method(full)
    blocks = torch.split(full, size // (world_size * stride), dim=partition_dim)
    mine = torch.cat(blocks[rank::world_size], dim=partition_dim)
    return mine.to(dtype=dtype, device=device).contiguous()


def reinitialize_named_(params: dict[str, torch.Tensor], seed: int, std: float, rank: int, world_size: int) -> None:
    """Re-initialise parameters in place from N(0, ``std``^2) keyed by ``(seed, name)``: tensor-parallel
    ones (``tensor_model_parallel``, ``partition_dim``, ``partition_stride`` attributes, as megatron-core
    sets them) as this rank's shard of the full weight, others whole. Two parameters given the same
    name (e.g. tied embedding copies on two pipeline stages) get the same values."""
    for name, p in params.items():
        sharded = bool(getattr(p, "tensor_model_parallel", False))
        dim = int(getattr(p, "partition_dim", 0)) if sharded else 0
        stride = int(getattr(p, "partition_stride", 1)) if sharded else 1
        world = world_size if sharded else 1
        full = list(p.shape)
        full[dim] *= world
        target = p.data
        if target.dtype == torch.float32 and target.is_contiguous():
            fill_normal_shard_(target, name_key(seed, name), tuple(full), dim, rank if sharded else 0, world, stride, std)
        else:
            tmp = torch.empty(p.shape, dtype=torch.float32, device=p.device)
            fill_normal_shard_(tmp, name_key(seed, name), tuple(full), dim, rank if sharded else 0, world, stride, std)
            target.copy_(tmp)
