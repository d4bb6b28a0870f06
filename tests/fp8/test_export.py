"""``fp8.export``: trained FP8 weights exported for serving (compressed-tensors, fp8-block) and imported back.

A tiny transformers Llama (hidden 128, so the ``blockwise`` recipe tiles its 128-wide layers; k/v projections 64 wide
run ``tensorwise``) trained a few AdamW steps at O2, exported, loaded back by transformers (``from_pretrained``: on CPU
both formats are dequantized; compressed-tensors also quantizes the activations per token, as a GPU serving engine
does) and by :func:`fp8.export.import_fp8`. Bounds from ``python tests/fp8/test_export.py`` (seeds 0-4, printed), each
with at least 2x headroom over the largest value measured.
"""

from __future__ import annotations

import json
from contextlib import nullcontext

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

import fp8  # noqa: E402
from fp8.blocks import expand_scales  # noqa: E402
from fp8.convert import high_precision_forward as high_precision  # noqa: E402
from fp8.export import (FORMATS, SERVING_BLOCK, export_fp8, import_fp8, quantization_config,  # noqa: E402
                        serving_weight)

VOCAB, HIDDEN, INTERMEDIATE, LAYERS, SEQ = 256, 128, 256, 2, 16
STEPS, LR = 5, 3e-3
RECIPES = ("tensorwise", "rowwise", "blockwise")
# Measured (python tests/fp8/test_export.py, seeds 0-4), relative Frobenius error of the logits:
# transformers' load of the export vs the FP8 model's own forward (the served model quantizes activations per token, or
# not at all on CPU for fp8-block; the FP8 model with its delayed per-tensor scales): max measured 0.0503
SERVED_VS_FP8_BOUND = 0.11
EXACT_WEIGHTS_BOUND = 1e-6  # fp8-block (dequantized on CPU) vs the FP8 model with a high-precision forward: measured 0
# rowwise -> 128x128 blocks, largest change of a value over the weight's amax (analysis): a block's scale is a power of
# two of its amax (amax * scale in [224, 448]), values re-quantized from their row's scale change only below E4M3's
# normal range, by at most half its subnormal step 2^-9: 2^-10 / 224 = 4.4e-6 of the block's amax (measured 3.05e-6)
REQUANT_ERROR_BOUND = 2 ** -10 / 224


def tiny_llama(seed: int = 0, tied: bool = False) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(config)


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(1000 + seed))


def trained(recipe: str, level: str = "O2", seed: int = 0, tied: bool = False, steps: int = STEPS):
    model = tiny_llama(seed, tied)
    model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR), level, recipe=recipe)
    x = tokens(seed)
    for _ in range(steps):
        model(input_ids=x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def fp8_linears(model) -> dict[str, fp8.Float8Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, fp8.Float8Linear)}


def logits(model, x, high_precision_forward: bool = False) -> torch.Tensor:
    with torch.no_grad(), (high_precision(model) if high_precision_forward else nullcontext()):
        return model(input_ids=x).logits.float()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def served_value(tensors: dict, key: str, fmt: str) -> torch.Tensor:
    """The value a serving engine computes with: payload times the multiplier of its block."""
    payload = tensors[key].to(torch.float32)
    inv = tensors[key + ("_scale_inv" if fmt == "fp8-block" else "_scale")]
    if inv.numel() == 1:
        return payload * inv.reshape(())
    if inv.shape == (payload.shape[0], 1):
        return payload * inv
    return payload * expand_scales(inv, (SERVING_BLOCK, SERVING_BLOCK), tuple(payload.shape))


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    return {recipe: trained(recipe) for recipe in RECIPES}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_exported_payloads_are_the_trained_bytes(models, tmp_path, recipe, fmt):
    model, _ = models[recipe]
    report = export_fp8(model, tmp_path, fmt)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    linears = fp8_linears(model)
    assert len(linears) == LAYERS * 7 + 1  # the LM head too: serving engines hold it unquantized, its exact values
    assert report.dequantized == ["lm_head"] and tensors["lm_head.weight"].dtype == torch.float32
    assert torch.equal(tensors["lm_head.weight"], linears.pop("lm_head").weight.dequantize(torch.float32))
    assert set(report.fp8_weights) == set(linears) and "lm_head" in report.ignored
    requantized = recipe == "rowwise" and fmt == "fp8-block"  # per-row scales cannot share a 128x128 block's
    for name, module in linears.items():
        key = f"{name}.weight"
        assert tensors[key].dtype == torch.float8_e4m3fn and tensors[key].shape == module.weight.shape
        exact = torch.equal(served_value(tensors, key, fmt), module.weight.dequantize(torch.float32))
        same_bytes = torch.equal(tensors[key].view(torch.uint8), module.weight.payload.view(torch.uint8))
        if name in report.requantized:  # other bytes; values changed only below E4M3's normal range of their block
            assert requantized and not same_bytes
            error, changed = report.requantized[name]
            assert 0 <= error < REQUANT_ERROR_BOUND and exact is (changed == 0)
        else:
            assert exact and same_bytes, name
    assert bool(report.requantized) == requantized
    if requantized:  # measured: a few of them lose bits (seeds 0-4: 2 to 4 of 14)
        assert any(changed for _, changed in report.requantized.values())
    strategies = set(report.fp8_weights.values())
    # blockwise: k/v (64 wide) run tensorwise, written as blocks with their q's (one fused qkv_proj in vLLM)
    expected = {"tensorwise": {"tensor"}, "rowwise": {"channel"}, "blockwise": {"block"}}[recipe]
    assert strategies == ({"block"} if fmt == "fp8-block" else expected)
    # bytes on disk: 1 byte per FP8 weight element plus 4 per scale, the rest fp32 (this model's dtype)
    fp8_elements = sum(m.weight.numel() for m in linears.values())
    assert report.payload_bytes == fp8_elements
    assert report.bytes_on_disk == (tmp_path / "model.safetensors").stat().st_size
    hp = sum(t.numel() * t.element_size() for k, t in tensors.items() if t.dtype != torch.float8_e4m3fn
             and not k.endswith(("_scale", "_scale_inv")))
    assert report.high_precision_bytes == hp and report.bytes_on_disk > fp8_elements + report.scale_bytes + hp


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_transformers_loads_the_export_and_reproduces_the_fp8_model(models, tmp_path, recipe, fmt):
    pytest.importorskip("compressed_tensors", reason="pip install -e '.[test]' (compressed-tensors)")
    model, _ = models[recipe]
    report = export_fp8(model, tmp_path, fmt)
    served = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    x = tokens(7)
    with torch.no_grad():
        out = served(input_ids=x).logits.float()  # compressed-tensors decompresses at the first forward on CPU
    for name, module in fp8_linears(model).items():  # the served weights are the trained FP8 values
        weight = served.get_submodule(name).weight
        assert weight.dtype == torch.float32
        if name not in report.requantized or not report.requantized[name][1]:
            assert torch.equal(weight, module.weight.dequantize(torch.float32)), name
    assert rel(out, logits(model, x)) < SERVED_VS_FP8_BOUND
    if fmt == "fp8-block" and not report.requantized:  # dequantized weights, activations unquantized on CPU
        assert rel(out, logits(model, x, high_precision_forward=True)) < EXACT_WEIGHTS_BOUND


def test_quantization_config_is_what_compressed_tensors_parses(models, tmp_path):
    ct = pytest.importorskip("compressed_tensors.quantization", reason="pip install -e '.[test]' (compressed-tensors)")
    model, _ = models["blockwise"]
    export_fp8(model, tmp_path, "compressed-tensors")
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    parsed = ct.QuantizationConfig.model_validate(qc)
    assert parsed.format == "float-quantized" and parsed.quantization_status == "compressed"
    (group,) = parsed.config_groups.values()  # k/v's tensor-wise scales written as blocks: one scheme for qkv_proj
    assert group.targets == ["Linear"] and parsed.ignore == ["lm_head"]
    assert group.weights.strategy == "block" and group.weights.block_structure == [128, 128]
    assert group.input_activations.strategy == "group" and group.input_activations.dynamic
    assert group.weights.type == "float" and group.weights.num_bits == 8
    # two strategies (rules mixing recipes): each group names its layers; every FP8 linear in exactly one group
    qc2 = quantization_config("compressed-tensors", {"a.q_proj": "tensor", "a.o_proj": "channel"}, [])
    parsed = ct.QuantizationConfig.model_validate(qc2)
    assert sorted(t for g in parsed.config_groups.values() for t in g.targets) == [r"re:^a\.o_proj$",
                                                                                 r"re:^a\.q_proj$"]
    assert {g.input_activations.strategy for g in parsed.config_groups.values()} == {"token"}


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_fused_group_half_in_fp8_is_served_in_high_precision(tmp_path, fmt):
    """q in FP8 beside k/v kept in high precision (min_fp8_dim: k/v are 64 wide): vLLM fuses them into one qkv_proj
    of one precision, so q is written with its exact values and the three are listed as not quantized."""
    model = tiny_llama()
    model, _ = fp8.initialize(model, None, "O1", min_fp8_dim=100)
    report = export_fp8(model, tmp_path, fmt)
    qkv = [f"model.layers.{i}.self_attn.{p}" for i in range(LAYERS) for p in ("q_proj", "k_proj", "v_proj")]
    assert set(qkv) <= set(report.ignored) and not set(qkv) & set(report.fp8_weights)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj"
    assert q in report.dequantized and torch.equal(tensors[f"{q}.weight"],
                                                   model.get_submodule(q).weight.dequantize(torch.float32))
    assert "model.layers.0.self_attn.o_proj" in report.fp8_weights  # not fused: still FP8


def test_tied_and_high_precision_layers_are_listed_as_ignored(tmp_path):
    model = tiny_llama(0, tied=True)
    model, _ = fp8.initialize(model, torch.optim.AdamW(model.parameters()), "O2",
                              module_filter_fn=lambda m, name: "down_proj" not in name)
    for fmt in FORMATS:
        report = export_fp8(model, tmp_path / fmt, fmt)
        qc = json.loads((tmp_path / fmt / "config.json").read_text())["quantization_config"]
        downs = [f"model.layers.{i}.mlp.down_proj" for i in range(LAYERS)]
        assert sorted(report.ignored) == sorted(downs + ["lm_head"])
        assert sorted(qc["ignore" if fmt == "compressed-tensors" else "modules_to_not_convert"]) == sorted(report.ignored)
        tensors = load_file(str(tmp_path / fmt / "model.safetensors"))
        assert "lm_head.weight" not in tensors  # tied: written once, as save_pretrained does
        assert all(tensors[f"{d}.weight"].dtype == torch.float32 for d in downs)
        served = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / fmt), dtype=torch.float32)
        assert torch.equal(served.lm_head.weight, model.model.embed_tokens.weight)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_import_round_trip_is_bit_exact_and_trains_on(models, tmp_path, level, fmt, gloo_world_of_one):
    source, _ = models["blockwise" if fmt == "fp8-block" else "tensorwise"]
    recipe = "blockwise" if fmt == "fp8-block" else "tensorwise"
    export_fp8(source, tmp_path / "a", fmt)
    model = tiny_llama(seed=3)  # other weights: everything must come from the file
    model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR), level, recipe=recipe)
    report = import_fp8(model, tmp_path / "a", optimizer)
    assert sorted(report.exact) == sorted(set(fp8_linears(source)) - {"lm_head"})
    assert report.requantized == {"lm_head": "high precision in the file"}  # the head is served in high precision
    assert report.masters >= len(fp8_linears(source))
    for name, module in fp8_linears(model).items():
        theirs = fp8_linears(source)[name].weight
        if name == "lm_head":  # its exact values, re-quantized with a current power-of-two scale
            assert torch.equal(module.weight.dequantize(torch.float32), theirs.dequantize(torch.float32))
            continue
        assert torch.equal(module.weight.payload.view(torch.uint8), theirs.payload.view(torch.uint8))
        assert torch.equal(module.weight.scale, theirs.scale)
    x = tokens(5)
    assert torch.equal(logits(model, x, True), logits(source, x, True))
    export_fp8(model, tmp_path / "b", fmt)  # and back out: the same bytes
    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
    # fine-tuning goes on from the imported weights: the masters hold them exactly, so the first step starts there
    before = {n: m.weight.dequantize(torch.float32) for n, m in fp8_linears(model).items()}
    model(input_ids=x, labels=x).loss.backward()
    optimizer.step()
    moved = [float((m.weight.dequantize(torch.float32) - before[n]).abs().max() / before[n].abs().max())
             for n, m in fp8_linears(model).items()]
    assert 0 < max(moved) < 0.1  # one AdamW step of lr 3e-3 from the imported values, not from the seed-3 weights


@pytest.fixture
def gloo_world_of_one(tmp_path):
    """A one-process gloo group (O3 shards over the default group; with one rank it is O2)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("fmt", FORMATS)
def test_import_into_a_high_precision_model_takes_the_exact_values(models, tmp_path, fmt):
    """A model not (yet) in FP8 (the none baseline, a reference to freeze) takes each FP8 weight's exact values."""
    source, _ = models["blockwise"]
    export_fp8(source, tmp_path, fmt)
    plain = tiny_llama(seed=8)
    report = import_fp8(plain, tmp_path)
    assert sorted(k.removesuffix(".weight") for k in report.dequantized) == sorted(set(fp8_linears(source)) - {"lm_head"})
    for name, module in fp8_linears(source).items():
        assert torch.equal(plain.get_submodule(name).weight, module.weight.dequantize(torch.float32)), name
    x = tokens(4)
    with torch.no_grad():
        assert torch.equal(plain(input_ids=x).logits, logits(source, x, high_precision_forward=True))


def test_import_keeps_another_tools_scales_and_requantizes_other_layouts(tmp_path):
    """A checkpoint as llmcompressor writes it (per-channel scales ``amax / 448``, not powers of two) into a
    tensorwise model (requantized: the recipe holds one scale) and a rowwise one (payloads kept, scales reciprocated)."""
    torch.manual_seed(11)
    source = tiny_llama(5)
    tensors, names = {}, []
    for name, module in source.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            w = module.weight.detach()
            scale = w.abs().amax(dim=1, keepdim=True) / 448.0
            tensors[f"{name}.weight"] = (w / scale).to(torch.float8_e4m3fn)
            tensors[f"{name}.weight_scale"] = scale
            names.append(name)
        elif name == "":
            pass
    for key, value in source.state_dict().items():
        if key.rsplit(".", 1)[0] not in names:
            tensors[key] = value
    (tmp_path / "ckpt").mkdir()
    from safetensors.torch import save_file

    save_file(tensors, str(tmp_path / "ckpt" / "model.safetensors"))
    qc = quantization_config("compressed-tensors", {n: "channel" for n in names}, ["lm_head"])
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"quantization_config": qc}))
    for recipe, kept in (("rowwise", True), ("tensorwise", False)):
        model = tiny_llama(9)
        model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters()), "O2", recipe=recipe,
                                          module_filter_fn=lambda m, n: n != "lm_head")
        report = import_fp8(model, tmp_path / "ckpt", optimizer)
        assert (sorted(report.exact) == sorted(names)) is kept and bool(report.requantized) is not kept
        for name in names:
            value = (tensors[f"{name}.weight"].double() * tensors[f"{name}.weight_scale"].double())
            ours = model.get_submodule(name).weight
            if kept:  # the stored payload, its scale as an fp32 reciprocal: each value within 3 fp32 roundings
                # (the scale's reciprocal, the dequantization's reciprocal and product; measured 1.3e-7)
                assert torch.equal(ours.payload.view(torch.uint8), tensors[f"{name}.weight"].view(torch.uint8))
                assert float(((ours.dequantize(torch.float64) - value).abs() / value.abs().clamp_min(1e-30)).max()) \
                    <= 3 * 2 ** -24
            else:  # one power-of-two scale for the tensor: E4M3 rounding of the exact values, 2^-4 relative at most
                assert rel(ours.dequantize(torch.float64), value) < 2 ** -4


def test_large_exports_are_sharded_with_an_index(models, tmp_path):
    model, _ = models["tensorwise"]
    report = export_fp8(model, tmp_path, "compressed-tensors", max_shard_bytes=100_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards == sorted(f for f in report.files if f.endswith(".safetensors"))
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for f in shards for t in load_file(str(tmp_path / f)).values())
    assert not (tmp_path / "model.safetensors").exists()
    served = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    x = tokens(2)
    with torch.no_grad():
        assert rel(served(input_ids=x).logits, logits(model, x)) < SERVED_VS_FP8_BOUND
    report = export_fp8(model, tmp_path, "compressed-tensors")  # again, unsharded: the shards are removed
    assert sorted(p.name for p in tmp_path.glob("*.safetensors*")) == ["model.safetensors"]


def test_serving_weight_strategies_on_exact_and_inexact_layouts():
    torch.manual_seed(0)
    w = torch.randn(256, 384)
    w[:128] *= 50  # rows with larger values: a power-of-two scale per row differs from its block's
    rowwise = fp8.to_float8(w, "e4m3", block=(1, 0))
    assert serving_weight(rowwise, "channel").exact
    tensorwise = fp8.to_float8(w, "e4m3")
    for strategy in ("tensor", "channel", "block"):
        served = serving_weight(tensorwise, strategy)
        assert served.exact and torch.equal(served.payload.view(torch.uint8), tensorwise.payload.view(torch.uint8))
    assert tuple(serving_weight(tensorwise, "block").scale_inv.shape) == (2, 3)
    inexact = serving_weight(rowwise, "tensor")  # 50x apart rows under one scale: the small rows lose bits
    assert not inexact.exact and 0 < inexact.error < 2 ** -4 and inexact.changed > 0
    with pytest.raises(ValueError, match="strategy must be"):
        serving_weight(rowwise, "group")


def test_bad_input_is_refused_naming_the_fix(tmp_path):
    plain = tiny_llama()
    with pytest.raises(ValueError, match="fp8.initialize"):
        export_fp8(plain, tmp_path / "x")
    model, _ = fp8.initialize(tiny_llama(), None, "O1")
    with pytest.raises(ValueError, match="format must be one of"):
        export_fp8(model, tmp_path / "x", "gguf")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        export_fp8(model, tmp_path / "file")
    with pytest.raises(ValueError, match="Conv1D"):
        export_fp8(model, tmp_path / "x", conv1d=["model.layers.0.mlp.up_proj"])
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=VOCAB))
    gpt2, _ = fp8.initialize(gpt2, None, "O1")  # its Conv1D layers became Float8Linear: refused without being named
    with pytest.raises(ValueError, match="were transformers Conv1D layers"):
        export_fp8(gpt2, tmp_path / "gpt2")
    with pytest.raises(ValueError, match="no config.json"):
        import_fp8(model, tmp_path)
    export_fp8(model, tmp_path / "ok")
    wider = fp8.initialize(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=2 * INTERMEDIATE, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB)), None, "O1")[0]
    with pytest.raises(ValueError, match="build the model with the checkpoint's config"):
        import_fp8(wider, tmp_path / "ok")
    deeper = fp8.initialize(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS + 1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB)), None, "O1")[0]
    with pytest.raises(ValueError, match="missing"):
        import_fp8(deeper, tmp_path / "ok")
    with pytest.raises(TypeError, match="fp8.initialize returned"):
        import_fp8(model, tmp_path / "ok", torch.optim.SGD(model.parameters(), lr=0.1))


def _moe(kind: str):
    common = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2, vocab_size=VOCAB)
    if kind == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=256, num_local_experts=4, **common)
    elif kind == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(intermediate_size=128, moe_intermediate_size=256, num_experts=4,
                                             shared_expert_intermediate_size=128, **common)
    else:  # experts 256 wide: several 128x128 blocks per projection
        config = transformers.Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=256, num_experts=4,
                                             head_dim=32, **common)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_experts_are_exported_per_expert_in_the_checkpoint_layout(tmp_path, kind, fmt):
    """FP8 experts (fp8.Float8Experts) written per expert under the names transformers' own save_pretrained writes
    (Mixtral: block_sparse_moe.experts.{e}.w1/w3/w2; Qwen: mlp.experts.{e}.gate_proj/up_proj/down_proj), each
    expert's E4M3 bytes as trained, routers listed as not quantized; transformers loads it with every expert's values."""
    pytest.importorskip("compressed_tensors", reason="pip install -e '.[test]' (compressed-tensors)")
    model = _moe(kind)
    model.save_pretrained(str(tmp_path / "hp"))
    layout = set(load_file(str(tmp_path / "hp" / "model.safetensors")))
    model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR), "O2")
    experts = {n: m for n, m in model.named_modules() if isinstance(m, fp8.Float8Experts)}
    assert len(experts) == LAYERS
    x = tokens(0)
    for _ in range(3):
        model(input_ids=x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    report = export_fp8(model, tmp_path / "fp8", fmt)
    tensors = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    suffix = "_scale_inv" if fmt == "fp8-block" else "_scale"
    assert {k for k in tensors if not k.endswith(suffix)} == layout and not report.requantized
    block, (gate, up, down) = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}.get(
        kind, ("mlp", ("gate_proj", "up_proj", "down_proj")))
    for name, module in experts.items():
        prefix = name.replace(".mlp.", f".{block}.")
        inter = module.intermediate_dim
        for e in range(module.num_experts):
            fused = module.gate_up[e].weight.payload.view(torch.uint8)
            assert torch.equal(tensors[f"{prefix}.{e}.{gate}.weight"].view(torch.uint8), fused[:inter])
            assert torch.equal(tensors[f"{prefix}.{e}.{up}.weight"].view(torch.uint8), fused[inter:])
            assert torch.equal(tensors[f"{prefix}.{e}.{down}.weight"].view(torch.uint8),
                               module.down[e].weight.payload.view(torch.uint8))
            value = served_value(tensors, f"{prefix}.{e}.{down}.weight", fmt)
            assert torch.equal(value, module.down[e].weight.dequantize(torch.float32))
        assert f"{prefix.rsplit('.', 1)[0]}.gate" in report.ignored  # the router: high precision, not a Linear
    served = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "fp8"), dtype=torch.float32).eval()
    with torch.no_grad():
        out = served(input_ids=x).logits.float()
    for name, module in experts.items():  # transformers fused the experts back: the trained values
        theirs = served.get_submodule(name)
        assert torch.equal(theirs.down_proj.detach().float(), module.fused_weights(dtype=torch.float32)["down_proj"])
        assert torch.equal(theirs.gate_up_proj.detach().float(), module.fused_weights(dtype=torch.float32)["gate_up_proj"])
    assert rel(out, logits(model, x)) < SERVED_VS_FP8_BOUND
    # and back into a fresh FP8 MoE model (O1: the masters per expert projection), exported again byte for byte
    torch.manual_seed(4)
    fresh = transformers.AutoModelForCausalLM.from_config(_moe(kind).config)
    fresh, fresh_optimizer = fp8.initialize(fresh, torch.optim.AdamW(fresh.parameters(), lr=LR), "O1")
    imported = import_fp8(fresh, tmp_path / "fp8", fresh_optimizer)
    assert report.dequantized == ["lm_head"] and set(imported.requantized) == {"lm_head"}  # served in high precision
    assert len(imported.exact) == len(report.fp8_weights) - 4 * LAYERS  # each expert's gate and up: one fused weight
    export_fp8(fresh, tmp_path / "again", fmt)
    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert again.keys() == tensors.keys()
    assert all(torch.equal(again[k].view(torch.uint8), tensors[k].view(torch.uint8)) for k in tensors)


def _measure(seeds=range(5)) -> None:  # pragma: no cover - run by hand: python tests/fp8/test_export.py
    import tempfile

    torch.set_num_threads(1)
    for recipe in RECIPES:
        for seed in seeds:
            model, _ = trained(recipe, seed=seed)
            for fmt in FORMATS:
                with tempfile.TemporaryDirectory() as d:
                    report = export_fp8(model, d, fmt)
                    served = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
                    x = tokens(7)
                    with torch.no_grad():
                        out = served(input_ids=x).logits.float()
                    errors = [e for e, _ in report.requantized.values()]
                    print(f"{recipe:10s} seed {seed} {fmt:18s} vs FP8 forward {rel(out, logits(model, x)):.4f}  vs "
                          f"high-precision forward {rel(out, logits(model, x, True)):.2e}  requantized "
                          f"{len(errors)} max error {max(errors, default=0):.2e}  {report.bytes_on_disk} B")


if __name__ == "__main__":
    _measure()
