"""Worker of benchmarks/planner_validation.py for the product model: megatron-core's ``GPTModel`` built by
fp8lm (``megatron.training.model.build_model``, layer spec ``megatron.training.gpt_layer_specs``) on one
parallel layout per case, trained by ``megatron.training.training.TrainingRun`` exactly as ``pretrain_gpt.py``
does (model chunks, optimizer of the opt level, fp8lm DDP, 1F1B schedule, gloo on CPU).

Run under ``torchrun`` (one launch per world size, the cases looped inside, megatron-core's parallel
state re-initialised between cases as tests/megatron_worker.py does)::

    python -m torch.distributed.run --nproc_per_node 2 benchmarks/planner_validation_megatron.py \\
        --out DIR --cases '[{"name": "tp2sp", "flags": ["--tensor-model-parallel-size", "2",
        "--sequence-parallel"], "levels": ["none", "O2"], "recompute": [false, true]}]'

Per case, level and recompute setting, every rank trains two iterations on mock data and measures, in
the second one:

- model state: ``fp8.memory_report(model chunks, optimizer)`` right before the optimizer step (after the
  backward, the gradient reduction and clipping: what the step sees);
- gradients, peak in backward: the most gradient bytes held at once during the iteration (sampled at
  every gradient accumulation), against the planner's gradients (which, for O3 and the ZeRO-1 baseline,
  are the gradients after the reduction to their owners);
- activations: the peak, over the whole pipeline schedule of that iteration (every micro-batch's forward
  and backward; 1F1B keeps up to PP micro-batches in flight on the first stage), of the bytes autograd
  holds saved for backward (``torch.autograd.graph.saved_tensors_hooks``; each storage counted once while
  any saved reference to it is alive, model parameters and buffers excluded). With
  ``--recompute-activations`` this includes megatron-core's recomputation of each layer in backward.

and writes ``rank<R>.json``: rows ``{case, layout, level, recompute, rank, tp_rank, pp_rank, dp_rank,
what, planned, measured}`` where ``planned`` is ``tools.memory_planner.plan_memory`` of
``PlannerConfig.from_args`` on the very namespace the run was built from (this rank's pipeline stage and,
for O3, this rank's data-parallel shard).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.planner_validation import STATE_KEYS, SavedBytesTracker, plain_tensors, storage_key  # noqa: E402
from fp8.memory import memory_report  # noqa: E402
from fp8.comm import Collectives  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.training import training  # noqa: E402
from megatron.training.arguments import baseline_argv, parse_args, parse_config  # noqa: E402
from megatron.training.planning.memory_plan import PlannerConfig, plan_memory  # noqa: E402

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
         "--seq-length", "64", "--micro-batch-size", "4", "--mock-data", "--vocab-size", "512", "--fp32",
         "--train-iters", "2", "--eval-interval", "0", "--eval-iters", "0", "--no-progress", "--lr", "1e-3",
         "--lr-warmup-iters", "0", "--seed", "1234"]
"""The model of every case: 4 layers, hidden 64, 4 heads, ffn 256, seq 64, micro-batch 4, vocabulary 512
(padded to 128 x TP), FP32 high precision (CPU), no dropout, tied embeddings."""


class GradientPeak:
    """The largest gradient bytes held during backward (each storage once), sampled whenever a gradient
    is accumulated into a parameter (``register_post_accumulate_grad_hook``)."""

    def __init__(self, chunks) -> None:
        self.params = [p for c in chunks for p in c.parameters() if p.requires_grad]
        self.peak = 0
        self.handles = [p.register_post_accumulate_grad_hook(self.sample) for p in self.params]

    def sample(self, *_) -> None:
        seen, total = set(), 0
        for p in self.params:
            for grad in (p.grad, getattr(p, "main_grad", None)):  # --bf16: FP32 main gradients
                if grad is None:
                    continue
                for x in plain_tensors(grad):
                    key = storage_key(x)
                    if key not in seen:
                        seen.add(key)
                        total += key[1]
        self.peak = max(self.peak, total)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _excluded(chunks) -> set:
    return {storage_key(x) for c in chunks for p in [*c.parameters(), *c.buffers()] for x in plain_tensors(p.data)}


def _plan_state(cfg: PlannerConfig, stage: int, dp_rank: int) -> dict[str, int]:
    """The planner's model-state bytes of this stage and data-parallel rank."""
    plan = plan_memory(cfg)
    stage_plan = plan["stages"][stage]
    per_rank = stage_plan.get("dp_rank_bytes")
    return per_rank[dp_rank] if per_rank else {k: stage_plan["bytes"][k] for k in STATE_KEYS}


def run_case(case: dict, level: str, recompute: bool) -> list[dict]:
    flags = [f for f in MODEL if not ("--bf16" in case.get("flags", []) and f == "--fp32")]
    flags += list(case.get("flags", [])) + ["--fp8-opt-level", level]
    flags += ["--global-batch-size", str(case.get("global_batch_size", 8 * int(os.environ["WORLD_SIZE"])
                                                      // _model_parallel(case["flags"])))]
    if recompute:
        flags.append("--recompute-activations")
    if level == "none":  # the case's FP8-only flags have no effect at the baseline, which refuses them
        flags = baseline_argv(flags)
    run_cfg = parse_config(flags)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    training.initialize_distributed(run_cfg)
    # the planner for the device this run's GEMMs run on (on the CPU, --fp8-gemm-backend auto emulates them)
    cfg = PlannerConfig.from_run_config(run_cfg, gemm_device="cuda" if torch.cuda.is_available() else "cpu")
    datasets = training.Datasets(run_cfg)
    run = training.TrainingRun(run_cfg, datasets)
    data = run.data_iterators(datasets.train)
    reports: list[dict] = []
    real_step = run.optimizer.step

    def step(*a, **kw):  # the report the optimizer step sees: after backward, reduction and clipping
        model = run.bare_chunks[0] if len(run.bare_chunks) == 1 else torch.nn.ModuleList(run.bare_chunks)
        report = memory_report(model, run.optimizer.inner)
        main = run.optimizer.main_grad_bytes()  # --bf16's FP32 main gradients (level none)
        report["weight gradients"] += main
        report["total"] += main
        reports.append(report)
        return real_step(*a, **kw)

    run.optimizer.step = step
    run.train_step(data, 0)  # first step: lazy optimizer states, first scaling factors
    grads = GradientPeak(run.bare_chunks)
    compressors = [c.fp8_activation_compressor for c in run.bare_chunks if hasattr(c, "fp8_activation_compressor")]
    for compressor in compressors:  # counted through the tracker, which packs with it
        compressor.remove()
    with SavedBytesTracker(_excluded(run.bare_chunks), compressors[0] if compressors else None) as tracker:
        result = run.train_step(data, 1)
    grads.remove()
    if result["skipped"]:
        raise RuntimeError(f"{case['name']} {level}: the measured step was skipped (non-finite gradients)")
    report = reports[-1]
    stage = parallel_state.get_pipeline_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    base = {"case": case["name"], "layout": case.get("layout", case["name"]), "level": level,
            "recompute": "full" if recompute else "none", "rank": dist.get_rank(),
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(), "pp_rank": stage, "dp_rank": dp_rank}
    rows = []
    if not recompute:
        planned = _plan_state(cfg, stage, dp_rank)
        for key, category in STATE_KEYS.items():
            rows.append({**base, "what": key, "planned": planned[key], "measured": report.get(category, 0)})
        rows.append({**base, "what": "model state", "planned": sum(planned[k] for k in STATE_KEYS),
                     "measured": report["total"]})
        window = plan_memory(cfg)["stages"][stage]["bytes"]["gradient_accumulation"]  # fp32 sums before the DP reduction
        rows.append({**base, "what": "gradients, peak in backward", "planned": planned["gradients"] + window,
                     "measured": grads.peak})
    planned_act = plan_memory(cfg)["stages"][stage]["bytes"]["activations"]
    rows.append({**base, "what": f"activations (recompute {base['recompute']})", "planned": planned_act,
                 "measured": tracker.peak})
    return rows


def _model_parallel(flags: list[str]) -> int:
    size = 1
    for name in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size"):
        if name in flags:
            size *= int(flags[flags.index(name) + 1])
    return size


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--cases", required=True, help="JSON list of {name, layout, flags, levels, recompute}")
    a = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for case in json.loads(a.cases):
        for level in case["levels"]:
            for recompute in case.get("recompute", [False]):
                rows += run_case(case, level, recompute)
    with open(os.path.join(a.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(rows, f)
    Collectives().barrier("benchmark")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
