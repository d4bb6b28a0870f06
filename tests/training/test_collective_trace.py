"""NCCL's rules on the CPU: the collective-trace checker (fp8.comm_trace), proven on the two orderings gloo ran and
NCCL would not, then applied to pretrain_gpt.py's multi-rank layouts with asynchronous copies landing late on odd
ranks (``tests/skewed_readiness.py``: odd ranks' host copies land late).

- The checker's own rules on hand-written traces (deadlocks, crossed messages, collectives some ranks skip).
- Replays of the old orderings, which the checker must catch: the pipeline communicator posting unbatched
  receives before its sends (megatron-core's real 1F1B and interleaved schedules, two ranks), and the scaling
  histories confirmed when a rank sees its probe land (modelled: rank 1's copies two updates late).
- The same steps as the code is now: no violation.
- ``pretrain_gpt.py --collective-trace`` under torchrun at PP2 (1F1B), PP2 interleaved, TP2+SP, DP2 at O2 (the
  FP8 DDP path) and O3, and TP2 x PP2, with the readiness skew: the run's own check passes and this test checks the
  traces again.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fp8
from fp8.comm import Collectives, CommBytesCounter, P2PMessage
from fp8.comm_trace import CollectiveTrace, TraceCall, check_traces, load_traces
from fp8.host_read import HostCopy
from fp8.scaling import ScalingConfig, ScalingState
from tests.spawn import free_port, run_worker

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "trace_worker.py"

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--mock-data", "--vocab-size",
         "256", "--no-progress", "--lr", "3e-3", "--lr-warmup-iters", "0", "--seed", "5"]


# -- the checker's rules on hand-written traces -------------------------------------------------------------------
def _p2p(trace: CollectiveTrace, kind: str, peer: int, nbytes: int = 16, tag: str | None = None) -> None:
    trace.record(kind, "pp", (0, 1), nbytes, "torch.uint8", peer=peer, tag=tag)


def _two(build) -> dict[int, list[TraceCall]]:
    traces = {r: CollectiveTrace(r) for r in (0, 1)}
    build(traces)
    return {r: t.calls for r, t in traces.items()}


def test_unbatched_receives_first_on_both_sides_deadlock():
    def build(t):
        for rank, peer in ((0, 1), (1, 0)):
            _p2p(t[rank], "recv", peer)
            _p2p(t[rank], "send", peer)
    violations = check_traces(_two(build))
    assert [v.rule for v in violations] == ["p2p-deadlock"]
    assert "ranks 0 and 1" in violations[0].message and "unbatched" in violations[0].message


def test_both_sides_sending_first_unbatched_deadlock_too():
    def build(t):
        for rank, peer in ((0, 1), (1, 0)):
            _p2p(t[rank], "send", peer)
            _p2p(t[rank], "recv", peer)
    assert [v.rule for v in check_traces(_two(build))] == ["p2p-deadlock"]


def test_a_batched_exchange_or_even_odd_order_runs():
    def batched(t):
        for rank, peer in ((0, 1), (1, 0)):
            with t[rank].batch():
                _p2p(t[rank], "recv", peer)
                _p2p(t[rank], "send", peer)

    def even_odd(t):
        _p2p(t[0], "send", 1)
        _p2p(t[0], "recv", 1)
        _p2p(t[1], "recv", 0)
        _p2p(t[1], "send", 0)
    assert check_traces(_two(batched)) == []
    assert check_traces(_two(even_odd)) == []


def test_a_longer_cycle_across_units_is_found():
    """Batched on one side does not save an exchange whose partner waits behind an earlier unit."""
    def build(t):
        with t[0].batch():
            _p2p(t[0], "send", 1)
            _p2p(t[0], "recv", 1)
        _p2p(t[1], "recv", 0, nbytes=8)  # an earlier message rank 0 never sends...
        _p2p(t[1], "recv", 0)
        _p2p(t[1], "send", 0)
    violations = check_traces(_two(build))
    assert {v.rule for v in violations} == {"p2p-mismatch"}  # sizes and counts disagree: reported as such


def test_crossed_messages_and_unmatched_sends_are_reported():
    def crossed(t):
        with t[0].batch():
            _p2p(t[0], "send", 1, tag="pp gradients")
            _p2p(t[0], "send", 1, tag="pp activations")
        with t[1].batch():
            _p2p(t[1], "recv", 0, tag="pp activations")
            _p2p(t[1], "recv", 0, tag="pp gradients")

    def unmatched(t):
        _p2p(t[0], "send", 1)
        _p2p(t[0], "send", 1)
        _p2p(t[1], "recv", 0)
    crossed_violations = check_traces(_two(crossed))
    assert len(crossed_violations) == 2 and all(v.rule == "p2p-mismatch" for v in crossed_violations)
    assert "pp gradients" in crossed_violations[0].message
    unmatched_violations = check_traces(_two(unmatched))
    assert [v.rule for v in unmatched_violations] == ["p2p-mismatch"]
    assert "no partner" in unmatched_violations[0].message


def _coll(trace, kind="all_reduce", nbytes=4, group="tp", op="SUM", tag=None):
    trace.record(kind, group, (0, 1), nbytes, "torch.float32", op=op, tag=tag)


def test_collectives_must_agree_in_order_kind_size():
    def extra(t):
        for rank in (0, 1):
            _coll(t[rank], nbytes=12)
        _coll(t[1], nbytes=4, tag="fp8 amax")  # only rank 1: a hang

    def size(t):
        _coll(t[0], nbytes=12)
        _coll(t[1], nbytes=4)

    def kind(t):
        _coll(t[0], "all_reduce")
        _coll(t[1], "all_gather")

    def uneven(t):  # all-to-all with uneven splits: only the kind must agree
        _coll(t[0], "all_to_all_v", nbytes=8, op=None)
        _coll(t[1], "all_to_all_v", nbytes=24, op=None)

    for build, word in ((extra, "fp8 amax"), (size, "12 B"), (kind, "all_gather")):
        violations = check_traces(_two(build))
        assert [v.rule for v in violations] == ["collective"], build.__name__
        assert word in violations[0].message
    assert check_traces(_two(uneven)) == []


def test_a_rank_without_a_trace_is_reported(tmp_path):
    trace = CollectiveTrace(0)
    _coll(trace)
    trace.save(tmp_path / "rank0.jsonl")
    assert [v.rule for v in check_traces(load_traces(tmp_path))] == ["missing"]
    with pytest.raises(FileNotFoundError, match="rank1.jsonl"):
        load_traces(tmp_path, world_size=2)


def test_traces_round_trip_through_files(tmp_path):
    trace = CollectiveTrace(3)
    with trace.batch():
        _p2p(trace, "send", 1, tag="x")
    _coll(trace)
    rank, calls = CollectiveTrace.load(trace.save(tmp_path / "rank3.jsonl"))
    assert rank == 3 and calls == trace.calls and calls[0].batch == 0 and calls[1].batch is None


def test_a_truncated_trace_names_the_file_and_the_line(tmp_path):
    trace = CollectiveTrace(0)
    _coll(trace)
    _coll(trace)
    path = trace.save(tmp_path / "rank0.jsonl")
    path.write_text(path.read_text()[:-20])  # the rank died while writing
    with pytest.raises(ValueError, match=r"rank0.jsonl: line 3 is not a trace record .*truncated"):
        load_traces(tmp_path)
    done = subprocess.run([sys.executable, "tools/check_collective_trace.py", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "rank0.jsonl: line 3 is not a trace record" in done.stderr
    assert "Traceback" not in done.stderr


# -- Collectives: the group's device, traced batches --------------------------------------------------------------
@pytest.fixture
def single_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_collectives_refuse_a_tensor_off_the_group_device(single_process_group):
    """A group whose device is not the tensor's ('meta' stands for CUDA under NCCL): refused, never copied."""
    comm = Collectives(device=torch.device("meta"))
    with pytest.raises(ValueError, match=r"'fp8 amax'.*cpu.*meta"):
        comm.all_reduce(torch.ones(2), tag="fp8 amax")
    with pytest.raises(ValueError, match=r"'pp activations'.*cpu"):
        comm.batch_isend_irecv([P2PMessage("send", torch.ones(2), 0, "pp activations")])


def test_collectives_trace_each_call_and_each_batch():
    """Rank 0 of two on the ``fake`` backend (calls complete at once): each call recorded as NCCL sizes it, the
    batch's operations marked as one group, FP8 as bytes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        trace = CollectiveTrace(0)
        comm = Collectives(counter=CommBytesCounter(trace=trace))
        comm.all_reduce(torch.ones(3), tag="grads").wait()
        payload = torch.randn(8).to(torch.float8_e4m3fn)
        out = torch.empty(8, dtype=torch.float8_e4m3fn)
        works = comm.batch_isend_irecv([P2PMessage("send", payload, 1, "msg"), P2PMessage("recv", out, 1, "msg")])
        for work in works:
            work.wait()
        comm.send(payload, 1, "alone").wait()
    finally:
        dist.destroy_process_group()
    kinds = [(c.kind, c.nbytes, c.dtype, c.peer, c.batch, c.tag) for c in trace.calls]
    assert kinds == [("all_reduce", 12, "torch.float32", None, None, "grads"),
                     ("send", 8, "torch.uint8", 1, 0, "msg"), ("recv", 8, "torch.uint8", 1, 0, "msg"),
                     ("send", 8, "torch.uint8", 1, None, "alone")]


# -- the old orderings, replayed: the checker catches both -------------------------------------------------------
PIPELINE_CASES = {
    "1f1b": ["--pipeline-model-parallel-size", "2"],
    "interleaved": ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
}


@pytest.fixture(scope="module")
def pipeline_replays(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pipeline_replays")
    cases = [{"name": f"{name}-{'legacy' if legacy else 'now'}", "legacy": legacy,
              "flags": MODEL + ["--train-iters", "2", "--eval-interval", "0", "--fp8-opt-level", "O2", *flags]}
             for name, flags in PIPELINE_CASES.items() for legacy in (True, False)]
    run_worker(WORKER, 2, ["--out", str(out), "--cases", json.dumps(cases)], seed=5)
    return out


@pytest.mark.parametrize("schedule", sorted(PIPELINE_CASES))
def test_checker_finds_the_old_pipeline_deadlock(pipeline_replays, schedule):
    traces = load_traces(pipeline_replays / f"{schedule}-legacy", world_size=2)
    violations = check_traces(traces)
    assert violations and all(v.rule == "p2p-deadlock" for v in violations)
    # Both ranks' first blocked operations are unbatched receives from each other.
    assert violations[0].message.count("waits in recv") == 2 and "unbatched" in violations[0].message


@pytest.mark.parametrize("schedule", sorted(PIPELINE_CASES))
def test_the_pipeline_now_posts_each_step_as_one_group(pipeline_replays, schedule):
    traces = load_traces(pipeline_replays / f"{schedule}-now", world_size=2)
    assert check_traces(traces) == []
    p2p = [c for calls in traces.values() for c in calls if c.kind in ("send", "recv")]
    assert len(p2p) >= 16 and all(c.batch is not None for c in p2p)


def _legacy_update_scales(states: list[ScalingState], update: int, lag: int) -> None:
    """``fp8.update_scales`` as it was: the step's amaxes agreed in one all-reduce, the histories rolled, and each
    state confirmed once its probe's copy was *seen* to have landed (``event.query()``); modelled here as a probe
    posted at update ``k`` landing at ``k + 1 + lag``."""
    amaxes = torch.stack([s.amax_history[0] for s in states])
    states[0].amax_comm.all_reduce(amaxes, op=dist.ReduceOp.MAX, tag="fp8 amax").wait()
    for state, amax in zip(states, amaxes):
        state.amax_history[0] = amax
        state.update(reduce=False)
    pending = [s for s in states if not s.history_confirmed]
    probe = getattr(pending[0], "legacy_probe", None) if pending else None
    if probe is not None:
        posted, flags, members = probe
        if update < posted + 1 + lag:
            return  # "still in flight" on this rank
        pending[0].legacy_probe = None
        for state, started in zip(members, flags):
            state.history_confirmed = state.history_confirmed or started
        pending = [s for s in pending if not s.history_confirmed]
    if pending:
        pending[0].legacy_probe = (update, [bool(s.has_history) for s in pending], pending)


def _scaling_trace(rank: int, legacy: bool, store) -> list[TraceCall]:
    """One rank's collectives over six steps of three delayed-scaling states agreeing over the world group (the
    ``fake`` backend: each rank replayed in turn in this process; the decisions never read the values)."""
    dist.init_process_group("fake", store=store, rank=rank, world_size=2)
    try:
        trace = CollectiveTrace(rank)
        comm = Collectives(counter=CommBytesCounter(trace=trace))
        states = torch.nn.ModuleList(ScalingState(ScalingConfig(kind="delayed")) for _ in range(3))
        for state in states:
            state.amax_comm = comm
        gen = torch.Generator().manual_seed(rank)
        for step in range(6):
            for state in states:
                state.scale_for(torch.randn(64, generator=gen))  # per-cast MAX all-reduce until confirmed
            if legacy:
                _legacy_update_scales(list(states), step, lag=2 if rank == 1 else 0)
            else:
                fp8.update_scales(states)
        return trace.calls
    finally:
        dist.destroy_process_group()


def test_checker_finds_the_old_timing_dependent_amax_all_reduce():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    traces = {rank: _scaling_trace(rank, True, FakeStore()) for rank in (0, 1)}
    violations = check_traces(traces)
    assert [v.rule for v in violations] == ["collective"]
    assert "fp8 amax" in violations[0].message and "differs between rank 0 and rank 1" in violations[0].message


@pytest.fixture
def skewed_readiness():
    from fp8 import host_read
    from tests.skewed_readiness import skew_readiness

    original = skew_readiness()
    yield
    host_read.HostCopy.__init__ = original


def test_the_confirmation_is_the_same_step_on_every_rank_with_late_copies(skewed_readiness):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    traces = {rank: _scaling_trace(rank, False, FakeStore()) for rank in (0, 1)}
    assert check_traces(traces) == []
    per_cast = [sum(1 for c in traces[r] if c.nbytes == 4) for r in (0, 1)]
    assert per_cast[0] == per_cast[1] < 6 * 3  # per-cast all-reduces stop, at the same step on both ranks


def test_late_copies_hold_no_values_until_waited_for():
    flags = torch.tensor([1.0, 0.0])
    late = HostCopy(flags, late=True)
    assert torch.isnan(late.host).all()  # what reading the buffer without waiting would see
    assert late.result() == [1.0, 0.0]
    assert HostCopy(flags, late=False).result() == [1.0, 0.0]


def test_no_decision_reads_asynchronous_readiness():
    """The audit: no project file asks whether an event or a work has completed (``query()``,
    ``is_completed()``); device values reach the host only through HostCopy.result, at a fixed step."""
    offenders = []
    files = [p for d in ("fp8", "megatron", "tools") for p in (ROOT / d).rglob("*.py")] + [ROOT / "pretrain_gpt.py"]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in ("query", "is_completed"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.Attribute) and node.attr == "Event" and path.name != "host_read.py":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} Event")
    assert offenders == []


# -- pretrain_gpt.py under the trace, with late copies on odd ranks ----------------------------------------------
LAYOUTS = {
    "pp2-1f1b": (2, ["--pipeline-model-parallel-size", "2", "--fp8-opt-level", "O2"]),
    "pp2-interleaved": (2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                            "--fp8-opt-level", "O2"]),
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--fp8-opt-level", "O2"]),
    "dp2-o2-o3": (2, ["--fp8-opt-level", "O3", "--compare", "O2"]),  # the FP8 DDP path, then O3's owners
    "tp2xpp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel",
                    "--fp8-opt-level", "O2"]),
    # O3 on tied embeddings with pipeline and data parallelism: the embedding-group sum, then the owner reduction.
    "pp2xdp2-o3-tied": (4, ["--pipeline-model-parallel-size", "2", "--fp8-opt-level", "O3"]),
    # expert parallelism: FP8 token all-to-alls (uneven splits) and the experts' O3 owners over expert data parallelism
    "ep2-o3-moe": (2, ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
                       "--expert-model-parallel-size", "2", "--moe-fp8-dispatch", "--fp8-opt-level", "O3"]),
}


@pytest.fixture(scope="module")
def traced_runs(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Each layout trained for 3 iterations (an evaluation after 2 and 3) by pretrain_gpt.py under torchrun,
    traced, the host copies of odd ranks landing late (``tests/skewed_readiness.py``)."""
    out = tmp_path_factory.mktemp("traced_runs")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}
    runs = {}
    for name, (nproc, flags) in LAYOUTS.items():
        trace_dir = out / name
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               str(free_port()), "tests/skewed_readiness.py", "pretrain_gpt.py", *MODEL, "--train-iters", "3", "--eval-interval", "2",
               "--eval-iters", "1", "--log-interval", "1", "--collective-trace", str(trace_dir), *flags]
        runs[name] = (subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900), trace_dir)
    return runs


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_pretrain_gpt_collectives_follow_nccl_rules(traced_runs, layout):
    proc, trace_dir = traced_runs[layout]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "follow NCCL's rules" in proc.stdout
    nproc = LAYOUTS[layout][0]
    traces = load_traces(trace_dir, world_size=nproc)
    assert check_traces(traces) == []
    calls = [c for r in traces.values() for c in r]
    kinds = Counter(c.kind for c in calls)
    tags = Counter(c.tag for c in calls)
    assert tags["fp8 amax"] > 0 or layout.startswith("pp2") or layout.startswith("dp2")
    if "pp2" in layout:
        p2p = [c for c in calls if c.kind in ("send", "recv")]
        assert p2p and all(c.batch is not None for c in p2p), "unbatched point-to-point operations"
    if "tp2" in layout:  # megatron-core's own tensor-parallel collectives are in the trace too
        assert any(c.source == "megatron-core" and len(c.ranks) == 2 for c in calls)
    if layout.startswith("dp2"):
        assert kinds["all_gather"] > 0  # O3: the owners' weight all-gather
    if layout == "ep2-o3-moe":  # each MoE layer's dispatch and combine, forward and backward, through Collectives
        for tag in ("moe dispatch", "moe combine", "moe dispatch grad", "moe combine grad"):
            assert tags[tag] > 0 and all(c.kind == "all_to_all_v" for c in calls if c.tag == tag), tag
    if layout == "pp2xdp2-o3-tied":  # each step: the copies summed over the embedding group (first and last stage),
        for rank, rank_calls in traces.items():  # then reduced to their owner over data parallel
            seq = [c for c in rank_calls if c.kind not in ("send", "recv")]
            tied = [i for i, c in enumerate(seq) if c.tag == "tied embedding grads"]
            assert len(tied) == 3, rank
            for i in tied:
                assert seq[i].kind == "all_reduce" and rank in seq[i].ranks and len(seq[i].ranks) == 2
                assert {r // 2 for r in seq[i].ranks} == {0, 1}  # one rank of each pipeline stage
                assert seq[i + 1].kind == "all_to_all_v" and {r // 2 for r in seq[i + 1].ranks} == {rank // 2}
