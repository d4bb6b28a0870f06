"""``fp8.integrations.transformers``: ``FP8Trainer`` on a tiny ``LlamaForCausalLM`` built from a config.

The task: a learnable synthetic language (each token's successor is a fixed random permutation of the
vocabulary), so the loss falls well below ``log(vocab)`` in a few steps. Bounds come from
``python tests/fp8/test_trainer_integration.py`` (it prints the figures measured over several seeds); each test's
bound has at least 2x headroom over the largest value measured.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (pip install -e '.[test]')")

import fp8  # noqa: E402
from fp8.integrations.transformers import FP8Trainer, fp8_optimizer_of, high_precision_state_dict  # noqa: E402

VOCAB, HIDDEN, INTERMEDIATE, LAYERS, SEQ = 256, 64, 256, 2, 32
STEPS, BATCH, LR = 20, 8, 3e-3
N_LINEARS = LAYERS * 7  # q, k, v, o, gate, up, down per layer; plus the untied lm_head: 15 linears, all convert

# Measured (python tests/fp8/test_trainer_integration.py, seeds 0-4, 20 steps; see docs/trainer.md):
LOSS_GAP_BOUND = 0.02  # |mean loss of the last 5 steps, O2 - none|: max measured 0.0065 (seeds 0-4)
LOGIT_REL_BOUND = 0.1  # ||logits(FP8 model) - logits(reloaded)|| / ||logits(reloaded)||: max measured 0.0464
GPT2_LOGIT_REL_BOUND = 0.06  # the same for a tiny GPT-2 after 5 steps: max measured 0.0281 (seeds 0-3, O1 and O2)
RESUME_GAP_BOUND = 2e-3  # |loss, resumed at step 3 - uninterrupted|, steps 4-6: max measured 5.3e-4 (seeds 0-3)
# First-step gradients, 2 micro-batches of 4 vs 1 batch of 8, largest relative difference over parameters:
GA_REL_BOUND = {"fp32": 1e-5,  # max measured 4.4e-7 (seeds 0-2): fp32 rounding
                "fp8": 0.1}  # max measured 0.048 (seeds 0-2): the E4M3 running sum


def tiny_llama(seed: int = 0) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=SEQ, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config)


class PermutationLanguage(torch.utils.data.Dataset):
    """Sequences where token i+1 = perm[token i] (perm: a fixed random permutation), random first tokens."""

    def __init__(self, n: int = 256, length: int = SEQ, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(VOCAB, generator=g)
        x = torch.empty(n, length, dtype=torch.long)
        x[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
        for i in range(1, length):
            x[:, i] = perm[x[:, i - 1]]
        self.x = x

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def training_args(tmp_path, seed: int = 0, **overrides) -> transformers.TrainingArguments:
    kwargs = dict(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=LR,
                  report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, seed=seed, disable_tqdm=True,
                  dataloader_num_workers=0)
    kwargs.update(overrides)
    return transformers.TrainingArguments(**kwargs)


def train(tmp_path, level: str, seed: int = 0, trainer_cls=FP8Trainer, fp8_kwargs=None, **overrides):
    trainer = trainer_cls(model=tiny_llama(seed), args=training_args(tmp_path, seed, **overrides),
                          train_dataset=PermutationLanguage(), fp8_opt_level=level, **(fp8_kwargs or {}))
    trainer.train()
    return trainer


def losses(trainer) -> list[float]:
    return [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]


def final_loss(trainer) -> float:
    """Mean logged loss of the last 5 optimizer steps (float64)."""
    return math.fsum(losses(trainer)[-5:]) / 5


def grad_norms(trainer) -> list[float]:
    return [float(h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the tiny model gains nothing from more, and on a shared 2-core machine more threads
    only wait on each other (the figures in the bounds above were measured so)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_thread):
    """The none and O2 runs of seed 0, shared by the tests that read them."""
    return {level: train(tmp_path_factory.mktemp(level), level) for level in ("none", "O2")}


def test_o2_trains_fp8_and_tracks_the_baseline(runs):
    trainer = runs["O2"]
    linears = [m for m in trainer.model.modules() if isinstance(m, fp8.Float8Linear)]
    assert len(linears) == N_LINEARS + 1  # lm_head (256 x 64) converts too: untied, dims multiples of 16
    assert not any(type(m) is torch.nn.Linear for m in trainer.model.modules())
    assert all(isinstance(m.weight, fp8.Float8Tensor) and m.weight.payload.dtype == torch.float8_e4m3fn
               for m in linears)
    assert isinstance(fp8_optimizer_of(trainer.optimizer), fp8.optim.AdamW)
    assert fp8_optimizer_of(trainer.lr_scheduler.optimizer) is fp8_optimizer_of(trainer.optimizer)  # built on it
    assert trainer.optimizer.param_groups[0]["lr"] == 0.0  # linear decay to 0 reached it: the schedule ran
    o2, none = losses(trainer), losses(runs["none"])
    assert len(o2) == len(none) == STEPS
    assert final_loss(trainer) < o2[0] - 1.0, o2  # it learns (from log(256) = 5.55)
    gap = abs(final_loss(trainer) - final_loss(runs["none"]))
    assert gap < LOSS_GAP_BOUND, (gap, o2, none)
    # evaluate() runs the FP8 model (no grad: its scaling histories are left alone) on the same language
    history = [m.input_scaling.amax_history.clone() for m in linears]
    eval_loss = trainer.evaluate(PermutationLanguage(n=16, seed=1))["eval_loss"]
    assert eval_loss < o2[0] - 1.0, eval_loss
    assert all(torch.equal(h, m.input_scaling.amax_history) for h, m in zip(history, linears))


def test_none_is_the_plain_trainer(tmp_path, runs):
    plain = train(tmp_path, "none", trainer_cls=_PlainTrainer)
    assert losses(runs["none"]) == losses(plain)  # same seed, same data, same numbers: bit for bit
    assert type(runs["none"].optimizer.optimizer) is torch.optim.AdamW
    assert not any(isinstance(m, fp8.Float8Linear) for m in runs["none"].model.modules())


class _PlainTrainer(transformers.Trainer):
    def __init__(self, *args, fp8_opt_level=None, **kwargs):
        super().__init__(*args, **kwargs)


def test_save_model_writes_the_masters_as_plain_weights(tmp_path, runs):
    trainer = runs["O2"]
    out = tmp_path / "saved"
    trainer.save_model(str(out))
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    from safetensors.torch import load_file

    saved = load_file(str(out / "model.safetensors"))
    assert not any("scaling" in k for k in saved)
    assert {v.dtype for v in saved.values()} == {torch.float32}  # the model's dtype
    optimizer = fp8_optimizer_of(trainer.optimizer)
    for name, module in trainer.model.named_modules():
        if isinstance(module, fp8.Float8Linear):
            weight = saved[f"{name}.weight"]
            torch.testing.assert_close(weight, optimizer.master_value(module.weight), rtol=0, atol=0)
            # The FP8 weight is the saved master quantized: the same payload bits and scale.
            again = module.config.quantize_weight(weight)
            assert torch.equal(again.payload.view(torch.uint8), module.weight.payload.view(torch.uint8)), name
            assert torch.equal(again.scale, module.weight.scale), name
    ids = PermutationLanguage(n=8, seed=7).x
    trainer.model.eval()
    with torch.no_grad():
        ours, theirs = trainer.model(ids).logits.double(), loaded(ids).logits.double()
    rel = ((ours - theirs).norm() / theirs.norm()).item()
    assert 0 < rel < LOGIT_REL_BOUND, rel  # FP8 weights and inputs vs the masters: E4M3 rounding, not more


@pytest.mark.parametrize("fmt", ["compressed-tensors", "fp8-block"])
def test_export_fp8_writes_the_trained_fp8_weights_for_serving(tmp_path, runs, fmt):
    """``trainer.export_fp8``: the FP8 weights as trained (payload bytes), loaded by transformers (compressed-tensors
    through its package) within the FP8-vs-reloaded logit bound; a none-level trainer is refused."""
    pytest.importorskip("compressed_tensors", reason="pip install -e '.[test]' (compressed-tensors)")
    from safetensors.torch import load_file

    trainer = runs["O2"]
    report = trainer.export_fp8(str(tmp_path / "served"), fmt)
    saved = load_file(str(tmp_path / "served" / "model.safetensors"))
    linears = {n: m for n, m in trainer.model.named_modules() if isinstance(m, fp8.Float8Linear)}
    assert report.dequantized == ["lm_head"]  # served unquantized: its exact values
    assert torch.equal(saved["lm_head.weight"], linears.pop("lm_head").weight.dequantize(torch.float32))
    assert set(report.fp8_weights) == set(linears) and not report.requantized
    for name, module in linears.items():
        assert torch.equal(saved[f"{name}.weight"].view(torch.uint8), module.weight.payload.view(torch.uint8)), name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "served"), dtype=torch.float32)
    ids = PermutationLanguage(n=8, seed=7).x
    trainer.model.eval()
    with torch.no_grad():
        ours, theirs = trainer.model(ids).logits.double(), loaded(ids).logits.double()
    assert ((ours - theirs).norm() / theirs.norm()).item() < LOGIT_REL_BOUND
    with pytest.raises(ValueError, match="fp8_opt_level='none'"):
        runs["none"].export_fp8(str(tmp_path / "none"))


def test_high_precision_state_dict_at_o1_and_in_bf16(tmp_path):
    model = tiny_llama().to(torch.bfloat16)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O1")
    state = high_precision_state_dict(model, optimizer)
    assert state.keys() == reference.keys()
    for k, v in state.items():
        assert type(v) is torch.Tensor and v.dtype == torch.bfloat16, k
        torch.testing.assert_close(v, reference[k], rtol=0, atol=0)  # O1's masters are the original weights
    fp32 = high_precision_state_dict(model, optimizer, dtype=torch.float32)
    assert {v.dtype for v in fp32.values()} == {torch.float32}
    deq = high_precision_state_dict(model)  # no optimizer: dequantized FP8 weights
    q = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(deq[q], model.model.layers[0].self_attn.q_proj.weight.dequantize(torch.bfloat16))
    assert not torch.equal(deq[q], reference[q])  # E4M3 rounding: not the masters


def test_a_bf16_model_trains_and_saves_in_bf16(tmp_path):
    trainer = FP8Trainer(model=tiny_llama().to(torch.bfloat16), args=training_args(tmp_path, max_steps=3),
                         train_dataset=PermutationLanguage(), fp8_opt_level="O2")
    trainer.train()
    assert all(math.isfinite(x) for x in losses(trainer)) and len(losses(trainer)) == 3
    trainer.save_model(str(tmp_path / "saved"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    optimizer = fp8_optimizer_of(trainer.optimizer)
    q = trainer.model.model.layers[0].self_attn.q_proj.weight
    torch.testing.assert_close(loaded.model.layers[0].self_attn.q_proj.weight,
                               optimizer.master_value(q).to(torch.bfloat16), rtol=0, atol=0)


def test_fp8_embeddings_train_and_save_their_masters(tmp_path):
    from fp8.embedding import Float8Embedding

    trainer = FP8Trainer(model=tiny_llama(), args=training_args(tmp_path, max_steps=3), train_dataset=PermutationLanguage(),
                         fp8_opt_level="O2", fp8_embeddings=True)
    trainer.train()
    table = trainer.model.model.embed_tokens
    assert isinstance(table, Float8Embedding) and all(math.isfinite(x) for x in losses(trainer))
    trainer.save_model(str(tmp_path / "saved"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))
    master = fp8_optimizer_of(trainer.optimizer).master_value(table.weight)
    torch.testing.assert_close(loaded.model.embed_tokens.weight, master.to(loaded.dtype), rtol=0, atol=0)
    with pytest.raises(ValueError, match="fp8_embeddings=True needs an FP8 fp8_opt_level"):
        FP8Trainer(model=tiny_llama(), args=training_args(tmp_path), fp8_opt_level="none", fp8_embeddings=True)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_gpt2_conv1d_weights_are_saved_back_transposed(tmp_path, level):
    """GPT-2's Conv1D layers (weights stored (in, out)) become Float8Linear (out, in); the saved directory has them
    (in, out) again. Its c_proj is square: a missing transpose would load silently, and the logits would show it."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=4,
                                                                 vocab_size=VOCAB, n_positions=SEQ))
    trainer = FP8Trainer(model=model, args=training_args(tmp_path, max_steps=5), train_dataset=PermutationLanguage(),
                         fp8_opt_level=level)
    trainer.train()
    assert sum(isinstance(m, fp8.Float8Linear) for m in trainer.model.modules()) == 4 * LAYERS  # lm_head: tied
    trainer.save_model(str(tmp_path / "saved"))
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ids = PermutationLanguage(n=8, seed=7).x
    trainer.model.eval()
    with torch.no_grad():
        ours, theirs = trainer.model(ids).logits.double(), loaded(ids).logits.double()
    rel = ((ours - theirs).norm() / theirs.norm()).item()
    assert 0 < rel < GPT2_LOGIT_REL_BOUND, rel


class _RecordingTrainer(FP8Trainer):
    """Records, at each clip, the gradients' norm in float64 before and after clipping."""

    def _clip_grad_norm(self, model):
        self.before = getattr(self, "before", []) + [_norm64(model)]
        norm = super()._clip_grad_norm(model)
        self.after = getattr(self, "after", []) + [_norm64(model)]
        self.fp8_grads = [isinstance(p.grad, fp8.Float8Tensor) for p in model.parameters() if p.grad is not None]
        return norm


def _norm64(model) -> float:
    total = 0.0
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.dequantize(torch.float64) if isinstance(p.grad, fp8.Float8Tensor) else p.grad.double()
            total += float((g * g).sum())
    return math.sqrt(total)


@pytest.mark.parametrize("accumulation", ["fp32", "fp8"])
def test_grad_accumulation_and_clipping_go_through_fp8(tmp_path, accumulation):
    max_norm = 0.05  # below every gradient norm measured here: clipping engages at every step
    config = fp8.Float8LinearConfig(grad_accumulation=accumulation)
    trainer = train(tmp_path, "O2", trainer_cls=_RecordingTrainer, fp8_kwargs={"fp8_config": config}, max_steps=4,
                    per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=max_norm)
    assert trainer.state.global_step == 4 and len(trainer.before) == 4
    # FP8 weight gradients are Float8Tensors under grad_accumulation="fp8" (torch's clip_grad_norm_ cannot read them)
    assert sum(trainer.fp8_grads) == (N_LINEARS + 1 if accumulation == "fp8" else 0)
    logged = grad_norms(trainer)
    for before, after, reported in zip(trainer.before, trainer.after, logged):
        assert before > max_norm
        assert reported == pytest.approx(before, rel=1e-5)  # the logged norm is the pre-clip norm
        assert after == pytest.approx(max_norm, rel=1e-4)  # clipped to max_grad_norm
    assert all(math.isfinite(x) for x in losses(trainer))


class _GradTrainer(FP8Trainer):
    """Keeps the step's gradients (float64, FP8 ones dequantized) when Trainer reads their norm."""

    def _get_grad_norm(self, model, grad_norm=None):
        self.grads = {n: (p.grad.dequantize(torch.float64) if isinstance(p.grad, fp8.Float8Tensor) else p.grad.double())
                      for n, p in model.named_parameters() if p.grad is not None}
        return super()._get_grad_norm(model, grad_norm)


def micro_batch_gradient_error(tmp_path, accumulation: str, seed: int = 0) -> float:
    """The largest relative difference, over parameters, between the first step's gradient summed over 2
    micro-batches of 4 and that of one batch of the same 8 samples (O2)."""
    grads = []
    for batch, steps in ((8, 1), (4, 2)):
        trainer = train(tmp_path / f"{accumulation}{batch}", "O2", seed=seed, trainer_cls=_GradTrainer,
                        fp8_kwargs={"fp8_config": fp8.Float8LinearConfig(grad_accumulation=accumulation)},
                        max_steps=1, per_device_train_batch_size=batch, gradient_accumulation_steps=steps,
                        max_grad_norm=0.0)
        grads.append(trainer.grads)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == len(list(tiny_llama().parameters()))
    return max(((grads[0][k] - grads[1][k]).norm() / grads[0][k].norm()).item() for k in grads[0])


@pytest.mark.parametrize("accumulation", ["fp32", "fp8"])
def test_two_micro_batches_give_the_gradient_of_one_batch(tmp_path, accumulation):
    """Gradient accumulation: FP8 weight gradients summed in fp32 match one batch to fp32 rounding; in E4M3
    (``grad_accumulation="fp8"``) to E4M3 rounding of the running sum."""
    error = micro_batch_gradient_error(tmp_path, accumulation)
    assert error < GA_REL_BOUND[accumulation], error


def test_resume_from_a_checkpoint_and_train_again(tmp_path):
    """Checkpoints hold the plain weights (loaded before conversion) and the FP8 optimizer's state (its masters):
    a resumed run follows the uninterrupted one; the delayed-scaling amax histories restart, hence a small gap."""
    full = train(tmp_path, "O2", max_steps=6, save_strategy="steps", save_steps=3)
    resumed = FP8Trainer(model=tiny_llama(), args=training_args(tmp_path, max_steps=6),
                         train_dataset=PermutationLanguage(), fp8_opt_level="O2")
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert resumed.state.global_step == 6
    gaps = [abs(a - b) for a, b in zip(losses(full)[3:], losses(resumed)[3:], strict=True)]
    assert max(gaps) < RESUME_GAP_BOUND, gaps
    optimizer = fp8_optimizer_of(resumed.optimizer)
    resumed.args.max_steps = 2
    resumed.train()  # a second train() on the same trainer keeps its FP8 model and optimizer
    assert fp8_optimizer_of(resumed.optimizer) is optimizer and len(losses(resumed)) == 2


def test_bad_choices_are_refused_with_the_fix(tmp_path):
    args = training_args(tmp_path)
    with pytest.raises(ValueError, match=r"fp8_opt_level.*'none', 'O1', 'O2', 'O3'.*got 'O4'.*fp8_opt_level='O2'"):
        FP8Trainer(model=tiny_llama(), args=args, fp8_opt_level="O4")
    with pytest.raises(ValueError, match=r"fp8_recipe.*'tensorwise', 'rowwise', 'blockwise'.*got 'colwise'"):
        FP8Trainer(model=tiny_llama(), args=args, fp8_recipe="colwise")
    with pytest.raises(ValueError, match="use fp8_opt_level='O2'"):
        FP8Trainer(model=tiny_llama(), args=args, fp8_opt_level="O3")
    with pytest.raises(ValueError, match="pass optimizers=\\(optimizer, None\\)"):
        model = tiny_llama()
        opt = torch.optim.AdamW(model.parameters())
        FP8Trainer(model=model, args=args, optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)))
    FP8Trainer(model=tiny_llama(), args=args, fp8_opt_level="O0")  # Apex's name of the baseline
    adafactor = FP8Trainer(model=tiny_llama(), args=training_args(tmp_path, optim="adafactor"),
                           train_dataset=PermutationLanguage(), fp8_opt_level="O2")
    with pytest.raises(TypeError, match=r"Adafactor.*optim='adamw_torch'.*fp8_opt_level='O1' keeps optim='adafactor'"):
        adafactor.train()
    assert not any(isinstance(m, fp8.Float8Linear) for m in adafactor.model.modules())  # refused before converting


def test_import_fp8_does_not_import_transformers():
    code = ("import sys, fp8, fp8.integrations\n"
            "assert 'transformers' not in sys.modules and 'accelerate' not in sys.modules, 'imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def _measure(seeds=range(5)) -> None:  # pragma: no cover - run by hand: python tests/fp8/test_trainer_integration.py
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        for seed in seeds:
            row = {}
            for level in ("none", "O1", "O2"):
                trainer = train(f"{d}/{level}{seed}", level, seed=seed)
                row[level] = (final_loss(trainer), trainer.state.log_history[-1]["train_runtime"] / STEPS)
                if level == "O2":
                    trainer.save_model(f"{d}/saved{seed}")
                    loaded = transformers.AutoModelForCausalLM.from_pretrained(f"{d}/saved{seed}")
                    ids = PermutationLanguage(n=8, seed=7).x
                    trainer.model.eval()
                    with torch.no_grad():
                        a, b = trainer.model(ids).logits.double(), loaded(ids).logits.double()
                    row["logit_rel"] = ((a - b).norm() / b.norm()).item()
            row["ga_rel"] = {acc: micro_batch_gradient_error(Path(d) / f"ga{seed}", acc, seed) for acc in ("fp32", "fp8")}
            gap = {lvl: abs(row[lvl][0] - row["none"][0]) for lvl in ("O1", "O2")}
            print(f"seed {seed}: final loss none {row['none'][0]:.4f} O1 {row['O1'][0]:.4f} O2 {row['O2'][0]:.4f} "
                  f"(gap O1 {gap['O1']:.4f}, O2 {gap['O2']:.4f}); s/step none {row['none'][1]:.3f} "
                  f"O1 {row['O1'][1]:.3f} O2 {row['O2'][1]:.3f}; logit rel {row['logit_rel']:.4f}; "
                  f"GA rel fp32 {row['ga_rel']['fp32']:.2e} fp8 {row['ga_rel']['fp8']:.4f}", flush=True)


if __name__ == "__main__":  # pragma: no cover
    torch.set_num_threads(1)
    _measure()


def test_fp8_statistics_and_precision_rules_reach_the_logs(tmp_path):
    rules = [{"pattern": "model.layers.0.*", "precision": "bf16"}, {"pattern": "*", "precision": "fp8"}]
    trainer = train(tmp_path, "O2", max_steps=4, logging_steps=2,
                    fp8_kwargs={"fp8_stats_interval": 2, "fp8_precision": rules})
    layers = [n for n, m in trainer.model.named_modules() if isinstance(m, fp8.Float8Linear)]
    assert layers and not any(n.startswith("model.layers.0.") for n in layers)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logged] == [2, 4]
    for h in logged:  # steps 2 and 4 observed, read at each log
        keys = {k for k in h if k.startswith("fp8_stats/")}
        assert {f"fp8_stats/{n}/{op}/saturated" for n in layers for op in ("input", "grad_output", "weight")} <= keys
        assert all(0.0 <= h[f"fp8_stats/{n}/input/flush_to_zero"] <= 1.0 for n in layers)
        assert all(h[f"fp8_stats/{n}/input/scale"] > 0 for n in layers)
    with pytest.raises(ValueError, match="fp8_stats_interval=2 needs an FP8 fp8_opt_level"):
        FP8Trainer(model=tiny_llama(), args=training_args(tmp_path), train_dataset=PermutationLanguage(),
                   fp8_opt_level="none", fp8_stats_interval=2)


def test_auto_fallback_and_scheduled_precision_through_the_trainer(tmp_path):
    """``fp8_high_precision_from_step=3, fp8_high_precision_mode="linear"``: every FP8 linear in high precision after
    the run, the first two steps' losses as without it; ``fp8_auto_fallback`` at a flush threshold so low that the
    attention's output gradients trip it: the layers it moved are the ones ``layer_precisions`` shows off tensorwise,
    and the optimizer's state dict carries the decisions (what the Trainer's checkpoints save)."""
    plain = train(tmp_path / "plain", "O2", max_steps=4, logging_steps=1)
    hp = train(tmp_path / "hp", "O2", max_steps=4, logging_steps=1,
               fp8_kwargs={"fp8_high_precision_from_step": 3, "fp8_high_precision_mode": "linear"})
    assert losses(hp)[:2] == losses(plain)[:2] and losses(hp)[2] != losses(plain)[2]
    assert set(fp8.layer_precisions(hp.model).values()) == {"fp8:tensorwise:high-precision"}
    cfg = fp8.FallbackConfig(interval=1, patience=1, flush=1e-6)
    fb = train(tmp_path / "fb", "O2", max_steps=3, logging_steps=1, fp8_kwargs={"fp8_auto_fallback": cfg})
    state = fb.optimizer.state_dict()["fp8_auto_fallback"]
    moved = {n for n, v in fp8.layer_precisions(fb.model).items() if v.startswith("fp8:") and v != "fp8:tensorwise"}
    assert moved == set(state["settings"]) and len(state["decisions"]) >= len(moved) > 0
    with pytest.raises(ValueError, match="drop fp8_stats_interval, or the fallback"):
        FP8Trainer(model=tiny_llama(), args=training_args(tmp_path), train_dataset=PermutationLanguage(),
                   fp8_opt_level="O2", fp8_stats_interval=2, fp8_auto_fallback=True)


def test_the_optimizer_precision_reaches_the_o2_optimizer(tmp_path):
    """``fp8_optimizer_precision``: the O2 optimizer stores its states as asked (here its E4M3 first moment rounded
    stochastically) and trains; other levels and other types are refused naming the fix."""
    precision = fp8.optim.OptimizerPrecision(exp_avg_rounding="stochastic")
    trainer = train(tmp_path, "O2", max_steps=3, fp8_kwargs={"fp8_optimizer_precision": precision})
    assert trainer._fp8_optimizer.precision == precision
    assert all(torch.isfinite(torch.tensor(losses(trainer))))
    with pytest.raises(ValueError, match="use fp8_opt_level='O2'"):
        FP8Trainer(model=tiny_llama(), args=training_args(tmp_path), fp8_opt_level="O1",
                   fp8_optimizer_precision=precision)
    with pytest.raises(TypeError, match="fp8.optim.OptimizerPrecision"):
        FP8Trainer(model=tiny_llama(), args=training_args(tmp_path), fp8_optimizer_precision="O2")
