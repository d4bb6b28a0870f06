"""Every collective goes through fp8.comm: counted (bytes counted = bytes computed from the tensors handed to
torch.distributed), on the group's device, and no other file of the project calls a collective.

The 8-rank TP2 x PP2 x DP2 launch (tests/comm_worker.py) trains a tiny sequence-parallel GPT at O2 and at the
baseline, start-up, evaluation and log gathering included, while the worker watches every call that reaches
torch.distributed and computes its bytes itself.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fp8.comm import Collectives, CommBytesCounter
from tests.spawn import run_worker

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "comm_worker.py"
SEED = 3
LEVELS = ("O2", "none")

# tests/comm_worker.py's model: sequence 32, micro-batch 2, hidden 64, TP2 (sequence parallel), DP2, global
# batch 8 (2 micro-batches per step), 3 iterations, an evaluation (1 iteration of 2 micro-batches) after 2 and 3.
SEQ, MBS, HIDDEN, TP = 32, 2, 64, 2
MICRO_BATCHES, ITERS, EVALS = 2, 3, 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("comm_coverage")
    run_worker(WORKER, 8, ["--out", str(out), "--seed", str(SEED), "--levels", ",".join(LEVELS)], SEED)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(8)]


@pytest.mark.parametrize("level", LEVELS)
def test_counter_sees_every_collective(ranks, level):
    for result in ranks:
        run = result[level]
        assert run["watched_calls"] > 100
        assert run["counted_calls"] == run["watched_calls"], f"rank {result['rank']}: uncounted collectives"
        assert run["counted_bytes"] == pytest.approx(run["watched_bytes"], rel=1e-12, abs=1e-6)


def test_every_tensor_is_on_the_group_device_and_no_object_collective_reaches_torch(ranks):
    for result in ranks:
        assert result["misplaced"] == []
        assert result["unexpected"] == []


@pytest.mark.parametrize("level", LEVELS)
def test_pipeline_bytes_match_the_shapes(ranks, level):
    """Stage 0 sends each micro-batch's activations (its sequence-parallel slice), stage 1 each gradient back:
    FP8 at O2 (1 byte per value + a 4-byte scale per message), fp32 at the baseline."""
    values = SEQ // TP * MBS * HIDDEN
    message = values + 4 if level == "O2" else values * 4
    forward = (ITERS + EVALS) * MICRO_BATCHES
    backward = ITERS * MICRO_BATCHES
    for result in ranks:
        tags = result[level]["by_tag"]
        first_stage = "pp activations" in tags and tags["pp activations"] > 0
        if first_stage:
            assert tags["pp activations"] == forward * message
        else:
            assert tags["pp gradients"] == backward * message


def test_losses_finite(ranks):
    for level in LEVELS:
        losses = [loss for r in ranks for loss in r[level]["losses"] if loss is not None]
        assert losses and all(torch.isfinite(torch.tensor(losses)))


_COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
                "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast", "send", "recv", "isend",
                "irecv", "batch_isend_irecv", "barrier", "monitored_barrier", "gather", "scatter", "reduce",
                "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                "_all_gather_base", "_reduce_scatter_base"}


def _collective_calls(path: Path) -> list[str]:
    """``dist.<collective>(...)`` / ``torch.distributed.<collective>(...)`` calls in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in _COLLECTIVES:
            base = ast.unparse(node.value)
            if base in ("dist", "torch.distributed", "td"):
                calls.append(f"{path.relative_to(ROOT)}:{node.lineno} {base}.{node.attr}")
        if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            calls += [f"{path.relative_to(ROOT)}:{node.lineno} imports {a.name}" for a in node.names
                      if a.name in _COLLECTIVES]
    return calls


def test_no_file_but_fp8_comm_calls_a_collective():
    files = [p for d in ("fp8", "megatron", "tools", "benchmarks", "examples") for p in (ROOT / d).rglob("*.py")]
    files.append(ROOT / "pretrain_gpt.py")
    offenders = [c for f in files if f != ROOT / "fp8" / "comm.py" for c in _collective_calls(f)]
    assert offenders == []
    assert _collective_calls(ROOT / "fp8" / "comm.py")  # the check sees calls where they are


class _Recorder:
    """Stands in for the backend in one process: records the devices handed to it, returns a done handle."""

    def __init__(self) -> None:
        self.devices: list[torch.device] = []

    def __call__(self, *tensors, **kwargs):
        self.devices += [t.device for t in tensors if isinstance(t, torch.Tensor)]
        return _Done()


class _Done:
    def wait(self, timeout=None):
        return True


@pytest.fixture
def single_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_backend_sees_only_tensors_on_the_group_device(single_process_group, monkeypatch):
    """A group whose device is not the tensor's (here 'meta' stands for CUDA under NCCL): a tensor on the group's
    device reaches the backend (FP8 as uint8, counted); one elsewhere is refused before the backend sees it."""
    recorder = _Recorder()
    monkeypatch.setattr(dist, "isend", lambda t, dst, group=None: recorder(t))
    counter = CommBytesCounter()
    comm = Collectives(counter=counter, device=torch.device("meta"))
    comm.send(torch.empty(8, dtype=torch.float8_e4m3fn, device="meta"), 0, "test")
    assert recorder.devices == [torch.device("meta")]
    assert counter.by_tag["test"] == 8  # one byte per FP8 value
    with pytest.raises(ValueError, match="'misplaced': a tensor on cpu"):
        comm.send(torch.randn(8).to(torch.float8_e4m3fn), 0, "misplaced")
    assert recorder.devices == [torch.device("meta")]
    assert Collectives().device == torch.device("cpu")  # gloo's device


def test_objects_travel_as_tensors(single_process_group):
    """Python objects round-trip through the tensor collectives (pickled bytes), counted like tensors."""
    comm = Collectives(device=torch.device("cpu"))
    t = torch.arange(4.0)
    comm.all_reduce(t, tag="test").wait()
    assert torch.equal(t, torch.arange(4.0))
    objects = comm.all_gather_object({"a": [1, 2]}, "test")
    assert objects == [{"a": [1, 2]}]
    assert comm.broadcast_object(("x", 3), "test") == ("x", 3)
