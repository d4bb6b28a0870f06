"""Worker of tests/fp8/test_accelerate_fsdp.py: fp8.initialize models sharded by Accelerate's FSDP2 plugin
(``accelerator.prepare(model, optimizer)``) and ``FP8Trainer`` with ``fsdp_config={'version': 2}``, on ``world`` gloo
ranks.

Accelerate turns FSDP on only for GPU-like process types (its ``AcceleratorState`` picks ``MULTI_CPU`` on CPU
processes and would wrap the model in DDP, and ``prepare`` resets it so again); this harness sets the state to FSDP
with the plugin, as Accelerate has it on GPUs, before ``prepare`` and again after it, and everything else is
Accelerate's and transformers' own code.

Recorded per rank: the loss curves of Accelerate's prepare against a plain ``fully_shard`` of the same blocks
(tests/fsdp_worker.py), the Trainer's logged losses and gradient norms, and the error of each refused case.
"""

from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def force_fsdp(accelerator, plugin) -> None:
    """Accelerate's state as it is on GPUs with the FSDP plugin (see the module docstring)."""
    from accelerate.utils import DistributedType

    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin


def llama_plugin():
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                          transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
                                          reshard_after_forward=True)


def cpu_fsdp2_trainer():
    """``FP8Trainer`` whose Accelerator is put in FSDP mode with the plugin ``TrainingArguments`` describes (see the
    module docstring)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    from fp8.integrations.transformers import FP8Trainer

    class CPUFSDP2Trainer(FP8Trainer):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            self._plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            force_fsdp(self.accelerator, self._plugin)
            self.is_fsdp_enabled = True

        def _prepare_for_training(self, *args, **kwargs):
            out = super()._prepare_for_training(*args, **kwargs)
            force_fsdp(self.accelerator, self._plugin)
            assert self.accelerator.is_fsdp2
            return out

    return CPUFSDP2Trainer


def accelerate_case(level: str, seed: int, world: int, rank: int) -> dict:
    """20 steps of the tiny Llama: ``accelerator.prepare`` of the fp8.initialize model and optimizer, beside the
    same steps with ``fully_shard`` per decoder layer and at the root (what the plugin's policy shards)."""
    import fp8
    from accelerate import Accelerator
    from fp8.distributed.sharding import local
    from fp8.tensor import Float8Tensor

    from tests import fsdp_worker as W

    reference = W.run("llama", level, seed, world, rank, shard=True)["losses"]
    plugin = llama_plugin()
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)
    force_fsdp(accelerator, plugin)
    model = W.llama(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    model, optimizer = fp8.initialize(model, optimizer, level)
    model, optimizer = accelerator.prepare(model, optimizer)
    force_fsdp(accelerator, plugin)
    assert accelerator.is_fsdp2
    losses = []
    for x, y in W.batches("llama", seed, world):
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        loss = W.loss_of("llama", model, x, y)
        optimizer.zero_grad()  # between the forward and the backward, as many loops do (FSDP2's root stays unsharded)
        accelerator.backward(loss)
        optimizer.step()
        value = loss.detach().clone().reshape(1)
        dist.all_reduce(value)  # the test's own reading
        losses.append(float(value / world))
    inner = optimizer.optimizer  # AcceleratedOptimizer -> fp8's optimizer
    groups = [p for g in inner.param_groups for p in g["params"]]
    return {"reference": reference, "losses": losses,
            "groups_are_the_model": [id(p) for p in groups] == [id(p) for p in model.parameters()],
            "states_follow": all(p in inner.state for p in groups),
            "fp8_shards": sum(isinstance(local(p), Float8Tensor) for p in model.parameters())}


def fsdp2_args(path: str, seed: int, world: int, **overrides):
    """The trainer tests' ``TrainingArguments`` under FSDP2 (a unit per decoder layer), each rank its share of the
    batch."""
    from tests.fp8.test_trainer_integration import BATCH, training_args

    return training_args(path, seed, per_device_train_batch_size=BATCH // world, fsdp=True,
                         fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
                         **overrides)


def whole_grad_norm(model, norm_type: float = 2.0) -> float:
    """The norm of the whole gradients of a sharded model (each all-gathered, FP8 ones dequantized)."""
    import fp8

    grads = [p.grad.full_tensor() for p in model.parameters()]
    grads = [g.dequantize(torch.float32) if isinstance(g, fp8.Float8Tensor) else g.float() for g in grads]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads]),
                                          norm_type))


def trainer_case(seed: int, world: int, out_dir: str) -> dict:
    """FP8Trainer at O2 under FSDP2 for 20 steps with ``max_grad_norm=1.0`` (clipping over the shards), each rank its
    share of every batch, then ``save_model``; the test runs the same in one process on the whole batches."""
    from tests.fp8.test_trainer_integration import PermutationLanguage, tiny_llama

    path = os.path.join(out_dir, "trainer")
    args = fsdp2_args(path, seed, world, max_grad_norm=1.0)
    trainer = cpu_fsdp2_trainer()(model=tiny_llama(seed), args=args, train_dataset=PermutationLanguage(),
                                  fp8_opt_level="O2")
    trainer.train()
    trainer.save_model(path)
    logs = trainer.state.log_history
    out = {"losses": [float(h["loss"]) for h in logs if "loss" in h],
           "grad_norms": [float(h["grad_norm"]) for h in logs if "grad_norm" in h], "path": path,
           "fsdp2": trainer.fp8_fsdp2, "refused": {}}
    for level in ("O1", "O3"):
        try:
            cpu_fsdp2_trainer()(model=tiny_llama(seed), args=args, train_dataset=PermutationLanguage(), fp8_opt_level=level)
        except ValueError as error:
            out["refused"][level] = str(error)
    try:
        trainer.export_fp8(os.path.join(out_dir, "export"))
    except ValueError as error:
        out["refused"]["export_fp8"] = str(error)
    best = fsdp2_args(path, seed, world, load_best_model_at_end=True, eval_strategy="steps", save_strategy="steps")
    try:
        cpu_fsdp2_trainer()(model=tiny_llama(seed), args=best, train_dataset=PermutationLanguage(),
                            eval_dataset=PermutationLanguage(n=8), fp8_opt_level="O2")
    except ValueError as error:
        out["refused"]["load_best_model_at_end"] = str(error)
    return out


def resume_case(seed: int, world: int, out_dir: str) -> dict:
    """FP8Trainer at O2 under FSDP2: 6 steps with a checkpoint at step 3, and a second trainer resumed from it."""
    from tests.fp8.test_trainer_integration import PermutationLanguage, tiny_llama

    path = os.path.join(out_dir, "resume")

    def trainer(**overrides):
        args = fsdp2_args(path, seed, world, max_steps=6, **overrides)
        return cpu_fsdp2_trainer()(model=tiny_llama(seed), args=args, train_dataset=PermutationLanguage(),
                               fp8_opt_level="O2")

    full = trainer(save_strategy="steps", save_steps=3)
    full.train()
    resumed = trainer()
    resumed.train(resume_from_checkpoint=os.path.join(path, "checkpoint-3"))
    losses = lambda t: [float(h["loss"]) for h in t.state.log_history if "loss" in h]  # noqa: E731
    return {"full": losses(full), "resumed": losses(resumed), "step": resumed.state.global_step,
            "files": sorted(os.listdir(os.path.join(path, "checkpoint-3")))}


def remap_case(seed: int, world: int, rank: int) -> dict:
    """What Accelerate's prepare leaves in an fp8 optimizer's groups after ``fully_shard`` (every FP8 weight's entry
    the last FP8 weight's shard, their ``data_ptr()`` being 0; the others their own shards), a group added after that,
    and a group changed both with shards and otherwise."""
    import fp8
    from torch.distributed.fsdp import fully_shard

    from fp8.distributed.sharding import local

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 32), torch.nn.LayerNorm(32))
    model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O2")
    fully_shard(model)
    shard_of = dict(zip((id(p) for p in optimizer.param_groups[0]["params"]), model.parameters()))
    fp8_shards = [p for p in model.parameters() if isinstance(local(p), fp8.Float8Tensor)]
    group = optimizer.param_groups[0]
    group["params"] = [fp8_shards[-1] if isinstance(p, fp8.Float8Tensor) else shard_of[id(p)] for p in group["params"]]
    extra = torch.nn.Parameter(torch.zeros(4))
    optimizer.add_param_group({"params": [extra], "lr": 0.0})
    model(torch.randn(4, 32)).float().pow(2).mean().backward()
    optimizer.step()
    out = {"groups": [[id(p) for p in g["params"]] for g in optimizer.param_groups] ==
           [[id(p) for p in model.parameters()], [id(extra)]],
           "states": all(p in optimizer.state and optimizer.state[p] for p in model.parameters())}
    group["params"] = [fp8_shards[-1], *group["params"][1:-1], torch.nn.Parameter(torch.zeros(32))]
    try:
        optimizer.step()
    except RuntimeError as error:
        out["mixed"] = str(error)
    return out


def clip_case(seed: int, world: int, rank: int) -> dict:
    """``fp8.clip_grad_norm_`` over FSDP2 shards (a generator of parameters, as users pass it): the 2-norm and the
    inf norm against the whole gradients' norms, on a model whose last linear has fewer rows than ranks (some ranks
    hold empty shards), and a replicated DTensor gradient refused."""
    import fp8
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, init_device_mesh

    from tests import fsdp_worker as W

    out = {}
    for norm_type in (2.0, float("inf")):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
        model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O2")
        fully_shard(model)
        x, y = next(W.batches("mlp", seed, world))
        (model(x.chunk(world)[rank]).float() - y[:, :1].chunk(world)[rank]).pow(2).mean().backward()
        expected = whole_grad_norm(model, norm_type)
        got = fp8.clip_grad_norm_(model.parameters(), expected / 2, norm_type)
        out[norm_type] = {"expected": expected, "got": float(got), "clipped": whole_grad_norm(model, norm_type),
                          "empty_shard": any(p.to_local().numel() == 0 for p in model.parameters())}
    torch.manual_seed(seed)  # O3's own clip under FSDP2, before the optimizer's first step (it follows there)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O3")
    fully_shard(model)
    model(torch.randn(4, 32, generator=torch.Generator().manual_seed(seed))).float().pow(2).mean().backward()
    out["o3"] = {"expected": whole_grad_norm(model), "got": float(optimizer.clip_grad_norm_(float("inf")))}
    mesh = init_device_mesh("cpu", (world,))
    param = torch.nn.Parameter(DTensor.from_local(torch.ones(4), mesh, [Replicate()]))
    param.grad = DTensor.from_local(torch.ones(4), mesh, [Replicate()])
    try:
        fp8.clip_grad_norm_([param], 1.0)
    except NotImplementedError as error:
        out["replicated"] = str(error)
    return out


def worker(rank: int, world: int, port: int, seed: int, out_dir: str) -> None:
    from tests.spawn import init_gloo_worker

    init_gloo_worker(rank, world, port)
    result = {level: accelerate_case(level, seed, world, rank) for level in ("O2", "O3")}
    result["trainer"] = trainer_case(seed, world, out_dir)
    result["resume"] = resume_case(seed, world, out_dir)
    result["clip"] = clip_case(seed, world, rank)
    result["remap"] = remap_case(seed, world, rank)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
