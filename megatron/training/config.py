"""The run's configuration: frozen, typed sections built once from ``pretrain_gpt.py``'s validated flags.

:func:`megatron.training.arguments.parse_config` parses, validates (:func:`~megatron.training.arguments.validate_args`
fills in the derived sizes) and returns a :class:`RunConfig`; every component of the training side takes it, or the
section it needs (``config.model``, ``config.parallel``, ``config.precision``, ``config.optimizer``,
``config.training``, ``config.data``, ``config.checkpoint``, ``config.stats``, ``config.logging``), and nothing changes
it: a variant (another ``--compare`` level, the resolved default corpus) is a new config made with
:meth:`RunConfig.replace`.

Every flag has one home: the field of the same name (dashes -> underscores) in one section
(``tests/training/test_run_config.py`` checks that against the parser). What a resumed run must match is declared on
the fields themselves (``metadata={"resume": ...}``): :data:`RESUME_MATCH` (the model, its precision and optimizer
kind: a checkpoint saved with other values is refused, naming the flag and both values) and :data:`RESUME_SCHEDULE`
(learning-rate schedule, batch and optimizer hyper-parameters: refused unless ``--override-opt-param-scheduler``).
The checkpoint's compatibility check and the memory planner read these declarations: no list mirrors the flags.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["ModelConfig", "MoEConfig", "ParallelConfig", "PrecisionConfig", "OptimizerConfig", "TrainingConfig",
           "DataConfig", "CheckpointConfig", "StatsConfig", "LoggingConfig", "RunConfig", "SECTIONS", "RESUME_MATCH",
           "RESUME_SCHEDULE", "config_from_args"]

_MATCH = {"resume": "match"}
_SCHEDULE = {"resume": "schedule"}


def _match(default=None) -> Any:
    return field(default=default, metadata=_MATCH)


def _schedule(default=None) -> Any:
    return field(default=default, metadata=_SCHEDULE)


@dataclass(frozen=True)
class ModelConfig:
    """The GPT's architecture (``--num-layers`` ... ``--attention-dropout``)."""

    num_layers: int = _match(4)
    hidden_size: int = _match(128)
    ffn_hidden_size: int | None = _match(None)
    num_attention_heads: int = _match(4)
    num_query_groups: int | None = _match(None)
    seq_length: int = 128
    max_position_embeddings: int | None = _match(None)
    vocab_size: int | None = None
    make_vocab_size_divisible_by: int = _match(128)
    normalization: str = _match("LayerNorm")
    swiglu: bool = _match(False)
    disable_bias_linear: bool = _match(False)
    untie_embeddings_and_output_weights: bool = _match(False)
    position_embedding_type: str = _match("learned_absolute")
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0


@dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts (``--num-experts`` None: dense MLPs); the experts' spread is ``ParallelConfig``'s."""

    num_experts: int | None = _match(None)
    moe_router_topk: int = _match(2)
    moe_ffn_hidden_size: int | None = _match(None)
    moe_shared_expert_intermediate_size: int | None = _match(None)
    moe_token_dispatcher_type: str = "allgather"
    moe_grouped_gemm: bool = False
    moe_aux_loss_coeff: float = 0.0
    moe_router_load_balancing_type: str = "aux_loss"
    moe_fp8_dispatch: bool = False


@dataclass(frozen=True)
class ParallelConfig:
    """The layout (TP x PP x DP, virtual stages, SP, EP) and how layers run (recomputation, compilation)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: int | None = None
    virtual_pipeline_model_parallel_size: int | None = None
    sequence_parallel: bool = False
    data_parallel_size: int | None = None
    expert_model_parallel_size: int = 1
    recompute_activations: bool = False
    compile_layers: bool = False


@dataclass(frozen=True)
class PrecisionConfig:
    """FP8 (opt level, recipe, scaling, which layers) and the high-precision dtype."""

    fp8_opt_level: str = _match("O2")
    compare: str | None = None
    compare_levels: tuple[str, ...] = ()
    bf16: bool = False
    fp32: bool = False
    params_dtype: torch.dtype = torch.float32
    fp8_amax_history_len: int = _match(16)
    fp8_margin: int = _match(0)
    fp8_grad_accumulation: str = _match("fp16")
    fp8_recipe: str = _match("tensorwise")
    fp4_format: str | None = None
    fp4_recipe: str | None = None
    fp4_hadamard: bool = True
    fp4_stochastic_rounding: bool = True
    fp4_bf16_forward_from_iteration: int | None = None
    fp8_high_precision_from_iteration: int | None = None
    fp8_high_precision_mode: str = "forward"
    swiglu_smooth: bool = False
    fp8_gemm_backend: str = "auto"
    fp8_activations: bool = False
    first_last_layers_bf16: bool = _match(False)
    num_layers_at_start_in_bf16: int = _match(1)
    num_layers_at_end_in_bf16: int = _match(1)
    fp8_precision_config: str | None = None
    fp8_precision_rules: tuple | None = _match(None)  # --fp8-precision-config's rules as read (compared by content)
    fp8_min_dim: int | None = None
    fp8_pipeline: str = "auto"

    @property
    def trained_levels(self) -> tuple[str, ...]:
        """``--compare``'s other levels, then ``--fp8-opt-level``: the order the run trains them."""
        return (*self.compare_levels, self.fp8_opt_level)


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer and its learning-rate schedule."""

    optimizer: str = _match("adam")
    lr: float = _schedule(1e-3)
    min_lr: float = _schedule(0.0)
    lr_decay_style: str = _schedule("cosine")
    lr_warmup_iters: int = _schedule(0)
    lr_decay_iters: int | None = _schedule(None)
    weight_decay: float = _schedule(0.1)
    adam_beta1: float = _schedule(0.9)
    adam_beta2: float = _schedule(0.95)
    adam_eps: float = _schedule(1e-8)
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = _match(False)


@dataclass(frozen=True)
class TrainingConfig:
    """Batches, iterations, evaluation, the skipped-step limit and the seed."""

    micro_batch_size: int = 16
    global_batch_size: int | None = _schedule(None)
    num_microbatches: int | None = None
    train_iters: int = 300
    eval_interval: int = 100
    eval_iters: int = 8
    log_interval: int = 10
    max_skipped_steps: int = 10
    skipped_steps_window: int = 100
    seed: int = 1234


@dataclass(frozen=True)
class DataConfig:
    """The corpus (``data_path``/``tokenizer_model`` None and not ``mock_data``: the default corpus, resolved at
    start-up into a new config)."""

    data_path: str | None = None
    tokenizer_model: str | None = None
    split: str = "949,50,1"
    mock_data: bool = False


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving, loading and stopping (``start_time``: when ``pretrain_gpt.py`` started, for
    ``--exit-duration-in-mins``; None: when this process imported the exit policy)."""

    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    ckpt_step: int | None = None
    load_fallback: bool = False
    override_opt_param_scheduler: bool = False
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None
    exit_signal_handler: bool = False
    start_time: float | None = None


@dataclass(frozen=True)
class StatsConfig:
    """FP8 numerics statistics and their alarms (``fp8_stats_interval`` 0: off)."""

    fp8_stats_interval: int = 0
    fp8_stats_saturation_alarm: float = 1e-3
    fp8_stats_flush_alarm: float = 0.5
    fp8_stats_loss_spike: float = 2.0
    fp8_stats_stop: bool = False
    fp8_auto_fallback: bool = False
    fp8_fallback_patience: int = 3
    fp8_fallback_ladder: str = "tensorwise,rowwise,blockwise,high"
    fp8_fallback_restore_after: int = 0


@dataclass(frozen=True)
class LoggingConfig:
    """What the run writes besides checkpoints."""

    log_json: str | None = None
    plot: str | None = None
    no_progress: bool = False
    tensorboard_dir: str | None = None
    wandb_project: str | None = None
    collective_trace: str | None = None


SECTIONS = {"model": ModelConfig, "moe": MoEConfig, "parallel": ParallelConfig, "precision": PrecisionConfig,
            "optimizer": OptimizerConfig, "training": TrainingConfig, "data": DataConfig,
            "checkpoint": CheckpointConfig, "stats": StatsConfig, "logging": LoggingConfig}
"""Section name -> its dataclass: the :class:`RunConfig` attribute each section lives under."""


def _declared(kind: str) -> tuple[str, ...]:
    return tuple(f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls) if f.metadata.get("resume") == kind)


RESUME_MATCH = _declared("match")
"""Fields a resumed run must match (the checkpoint's model, precision and optimizer kind)."""
RESUME_SCHEDULE = _declared("schedule")
"""Fields a resumed run must match unless ``--override-opt-param-scheduler``."""


@dataclass(frozen=True)
class RunConfig:
    """One run of ``pretrain_gpt.py``: its sections, plus ``dry_run`` and ``demo`` (the embedded default run)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    stats: StatsConfig = field(default_factory=StatsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    dry_run: bool = False
    demo: bool = False

    def replace(self, **sections: dict[str, Any]) -> RunConfig:
        """A new config with some fields of some sections changed: ``replace(precision={"fp8_opt_level": "O1"})``."""
        changed = {}
        for name, values in sections.items():
            if name not in SECTIONS:
                raise TypeError(f"RunConfig has no section {name!r}; sections: {', '.join(SECTIONS)}")
            changed[name] = dataclasses.replace(getattr(self, name), **values)
        return dataclasses.replace(self, **changed)

    def flat(self) -> dict[str, Any]:
        """Every field by its flag's name (what checkpoints record as the run's arguments)."""
        out: dict[str, Any] = {}
        for name in SECTIONS:
            section = getattr(self, name)
            out.update({f.name: getattr(section, f.name) for f in dataclasses.fields(section)})
        out["dry_run"], out["demo"] = self.dry_run, self.demo
        return out


def _frozen(value: Any) -> Any:
    """Lists (from JSON or argparse) as tuples, all the way down, so a frozen config holds no mutable value."""
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The :class:`RunConfig` of a namespace :func:`~megatron.training.arguments.validate_args` completed. A
    destination with no home in a section is an error (a new flag must be given one)."""
    values = {k: v for k, v in vars(args).items() if k != "explicit_flags"}
    sections = {}
    for name, cls in SECTIONS.items():
        names = [f.name for f in dataclasses.fields(cls)]
        sections[name] = cls(**{k: _frozen(values.pop(k)) for k in names if k in values})
    run = {k: values.pop(k) for k in ("dry_run", "demo") if k in values}
    if values:
        raise TypeError(f"flags without a section of RunConfig: {', '.join(sorted(values))} "
                        f"(add each to one section of megatron/training/config.py)")
    return RunConfig(**sections, **run)
