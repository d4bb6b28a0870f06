"""``tools/convert_checkpoint.py --format hf``: pretrain_gpt.py checkpoints (tiny models on mock data, CPU)
exported to transformers directories, loaded with ``AutoModelForCausalLM`` and compared on fixed tokens
with the megatron-core model's logits (tests/hf_export_worker.py: pretrain_gpt.py's set-up with the
checkpoint loaded by ``load_checkpoint``).

Bounds: ``--fp8-opt-level none``: the same fp32 weights, the same operations: relative Frobenius error
< 1e-4 (measured: 0, bit-identical, for Llama with GQA, GPT-2 and the TP2 checkpoint). O2: the export holds
the FP8 weights dequantized exactly (``--source fp8``) while the megatron model also quantizes its GEMM
inputs to E4M3 (3 mantissa bits: <= 2^-4 relative per value): < 0.1 relative (measured 0.0167 Llama-GQA,
0.0146 GPT-2). O1 over two pipeline stages and O3 over two data-parallel ranks, exported from the masters
(the model computes with their E4M3 rounding): the same bound (measured 0.0191 GPT-2 PP2 O1, 0.0255 Llama DP2 O3).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.spawn import free_port

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data", "--no-progress", "--eval-iters", "1",
         "--train-iters", "3", "--save-interval", "3", "--lr", "3e-3"]
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
         "--num-query-groups", "2"]
TOKENS = [[1, 5, 9, 200, 3, 7, 11, 13, 42, 99, 128, 0, 17, 249, 64, 33],
          [7, 7, 7, 1, 2, 3, 4, 5, 6, 8, 100, 101, 102, 240, 9, 10]]
EXACT_BOUND = 1e-4
FP8_BOUND = 0.1
MEASURED: dict[str, float] = {}

CASES = {  # name: (flags, processes)
    "llama_none": (LLAMA + ["--vocab-size", "256", "--fp8-opt-level", "none"], 1),
    "gpt2_none": (["--vocab-size", "256", "--fp8-opt-level", "none"], 1),
    "llama_O2": (LLAMA + ["--vocab-size", "256", "--fp8-opt-level", "O2"], 1),
    "gpt2_O2": (["--vocab-size", "256", "--fp8-opt-level", "O2"], 1),
    # TP2, untied output layer, vocabulary 250 padded to 256 rows (the padding is cut)
    "llama_tp2": (LLAMA + ["--vocab-size", "250", "--fp8-opt-level", "none", "--tensor-model-parallel-size", "2",
                           "--untie-embeddings-and-output-weights"], 2),
    # the other levels and layouts: O1 over two pipeline stages (tied embeddings across stages), O3 over two
    # data-parallel ranks (the optimizer state sharded); exported from the masters (--source master, the default)
    "gpt2_pp2_O1": (["--vocab-size", "256", "--fp8-opt-level", "O1", "--pipeline-model-parallel-size", "2"], 2),
    "llama_dp2_O3": (LLAMA + ["--vocab-size", "256", "--fp8-opt-level", "O3"], 2),
    # FP8 weights merged from two tensor-parallel shards (column- and row-parallel), untied FP8-free output layer
    "llama_tp2_O2": (LLAMA + ["--vocab-size", "250", "--fp8-opt-level", "O2", "--tensor-model-parallel-size", "2",
                              "--untie-embeddings-and-output-weights"], 2),
}


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _train(flags: list[str], nproc: int, save: Path) -> None:
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port())]
    _check(subprocess.run([*launcher, "pretrain_gpt.py", *SMALL, *flags, "--save", str(save)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600))


def _megatron_logits(flags: list[str], save: Path, out: Path) -> torch.Tensor:
    """The megatron-core model's logits (padded vocabulary), the checkpoint loaded in one process."""
    for layout in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size"):  # resharded to one rank on load
        if layout in flags:
            i = flags.index(layout)
            flags = flags[:i] + flags[i + 2:]
    _check(subprocess.run([sys.executable, "tests/hf_export_worker.py", str(out), json.dumps(TOKENS), *SMALL, *flags,
                           "--load", str(save)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600))
    return torch.load(out)


def _convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/convert_checkpoint.py", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)


def _hf_logits(outdir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(outdir)).eval()
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.float()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    results = {}
    for name, (flags, nproc) in CASES.items():
        save, outdir = root / name, root / f"{name}_hf"
        _train(flags, nproc, save)
        source = ["--source", "fp8"] if "O2" in name else []
        proc = _check(_convert("--format", "hf", str(save), str(outdir), "--dtype", "float32", *source))
        results[name] = (proc.stdout, outdir, _megatron_logits(flags, save, root / f"{name}.pt"))
    results["root"] = root
    return results


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name,architecture", [("llama_none", "LlamaForCausalLM"), ("gpt2_none", "GPT2LMHeadModel"),
                                               ("llama_tp2_O2", "LlamaForCausalLM"),
                                               ("llama_tp2", "LlamaForCausalLM"), ("llama_O2", "LlamaForCausalLM"),
                                               ("gpt2_O2", "GPT2LMHeadModel"), ("gpt2_pp2_O1", "GPT2LMHeadModel"),
                                               ("llama_dp2_O3", "LlamaForCausalLM")])
def test_exported_model_reproduces_megatron_logits(exported, name, architecture):
    stdout, outdir, reference = exported[name]
    config = json.loads((outdir / "config.json").read_text())
    assert config["architectures"] == [architecture]
    vocab = 250 if name.startswith("llama_tp2") else 256
    assert config["vocab_size"] == vocab and reference.shape[-1] >= vocab
    assert config["tie_word_embeddings"] is not name.startswith("llama_tp2")
    logits = _hf_logits(outdir)
    assert logits.shape == (len(TOKENS), len(TOKENS[0]), vocab)
    reference = reference[..., :vocab]
    assert reference.std(dim=1).mean() > 1e-3  # position-dependent logits: the comparison is not vacuous
    rel = _rel(logits, reference)
    MEASURED[name] = rel
    print(f"{name}: relative Frobenius error of the logits {rel:.3g}")
    assert rel < (FP8_BOUND if "_O" in name else EXACT_BOUND), (name, rel)
    if architecture == "LlamaForCausalLM":
        assert config["num_key_value_heads"] == 2 and config["num_attention_heads"] == 4
    else:
        assert config["activation_function"] == "gelu"  # megatron's F.gelu is the exact GELU
    assert "no tokenizer" in stdout and not (outdir / "tokenizer.model").exists()  # mock data: none to write


def test_bfloat16_is_the_default_dtype(exported, tmp_path):
    from safetensors.torch import load_file

    save = exported["root"] / "llama_O2"
    _check(_convert("--format", "hf", str(save), str(tmp_path / "out")))
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert "lm_head.weight" not in tensors and tensors["model.embed_tokens.weight"].shape == (256, 64)


def test_unmappable_models_are_refused_naming_the_flags():
    from megatron.training.checkpointing.hf_export import HFExportError, architecture_of

    base = {"num_attention_heads": 4, "num_query_groups": None, "normalization": "LayerNorm", "swiglu": False,
            "position_embedding_type": "learned_absolute", "disable_bias_linear": False}
    assert architecture_of(base) == "gpt2"
    with pytest.raises(HFExportError, match="--normalization RMSNorm --swiglu --position-embedding-type rope "
                                            "--disable-bias-linear"):
        architecture_of({**base, "position_embedding_type": "rope"})
    with pytest.raises(HFExportError, match="LlamaForCausalLM needs"):
        architecture_of({**base, "normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope"})
    with pytest.raises(HFExportError, match="GPT-2 has no grouped-query attention"):
        architecture_of({**base, "num_query_groups": 2})
    with pytest.raises(HFExportError, match="--num-experts 4: MoE runs have no transformers mapping"):
        architecture_of({**base, "num_experts": 4})


def test_unmappable_checkpoint_is_a_one_line_error(exported, tmp_path):
    save = tmp_path / "rope_layernorm"
    _train(["--vocab-size", "256", "--position-embedding-type", "rope", "--train-iters", "1", "--save-interval", "1"],
           1, save)
    proc = _convert("--format", "hf", str(save), str(tmp_path / "out"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "no transformers architecture" in proc.stderr and "LlamaForCausalLM needs" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_sentencepiece_run_exports_a_fast_tokenizer_with_the_training_ids(tmp_path):
    """A ``--tokenizer-model`` run: ``AutoTokenizer`` loads ``tokenizer.json`` (no ``protobuf``) and encodes like
    the sentencepiece model the training used (no BOS/EOS added: documents end with ``</s>`` in the data)."""
    import sentencepiece
    from transformers import AutoTokenizer

    from megatron.training.data.preprocess_data import preprocess

    words = "the quick brown fox jumps over lazy dog while seven wizards quietly hex jolly boxing frogs".split()
    text = "\n\n".join(" ".join(words[(i * j + j * j) % len(words)] + ("s" if (i + j) % 3 == 0 else "")
                                for j in range(12)) + f" {i}." for i in range(400))
    (tmp_path / "in.txt").write_text(text)
    result = preprocess(tmp_path / "in.txt", tmp_path / "data", vocab_size=310, log=None)
    model = str(result.tokenizer_model)
    flags = [f for f in SMALL if f != "--mock-data"] + ["--data-path", str(result.data_prefixes["text"]),
                                                        "--tokenizer-model", model, "--split", "90,10,0"]
    _check(subprocess.run([sys.executable, "pretrain_gpt.py", *flags, "--save", str(tmp_path / "ckpt")], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=600))
    outdir = tmp_path / "hf"
    proc = _check(_convert("--format", "hf", str(tmp_path / "ckpt"), str(outdir)))
    assert "tokenizer.json" in proc.stdout and (outdir / "tokenizer.json").exists()
    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    tokenizer = AutoTokenizer.from_pretrained(str(outdir))
    assert tokenizer.eos_token_id == sp.eos_id() and tokenizer.bos_token_id == sp.bos_id()
    lines = ["the quick brown foxes jump over 12 lazy dogs.", "  leading spaces and  double  ", "tabs\tand\nnewlines\n\n",
             "héllo wörld — 日本語 ✓ 🙂 (byte fallback)", "12345 67890", "", " ", "ZZZ qqq xylophone", "</s> <s> literal"]
    for line in lines:
        ids = tokenizer.encode(line)
        assert ids == sp.encode(line), line
        assert tokenizer.decode(ids) == line


# -- --quantization fp8: the FP8 weights as trained, in a serving format (docs/serving.md) ----------------------------
@pytest.mark.parametrize("fmt", ["compressed-tensors", "fp8-block"])
@pytest.mark.parametrize("name", ["llama_O2", "llama_tp2_O2", "llama_dp2_O3"])
def test_fp8_export_holds_the_trained_payloads_and_serves_the_logits(exported, tmp_path, name, fmt):
    """The exported E4M3 weights times their multipliers are the values the megatron model computed with (the
    ``--source fp8`` high-precision export's, bit for bit, so nothing was re-quantized); transformers loads the
    directory (compressed-tensors: its per-token activation quantization) and reproduces the megatron logits within
    the O2 bound; the payload bytes of one weight equal the checkpoint's own."""
    pytest.importorskip("compressed_tensors", reason="pip install -e '.[test]' (compressed-tensors)")
    from safetensors.torch import load_file

    from fp8.blocks import expand_scales
    from megatron.training.checkpointing.checkpoint import read_checkpoint_fp8

    save = exported["root"] / name
    outdir = tmp_path / "fp8"
    proc = _check(_convert("--quantization", "fp8", "--fp8-format", fmt, str(save), str(outdir)))
    assert "every FP8 payload as trained" in proc.stdout, proc.stdout
    tensors = load_file(str(outdir / "model.safetensors"))
    values = load_file(str(exported[name][1] / "model.safetensors"))  # the --source fp8 / master export, float32
    if "O2" not in name:  # the fixture exported the masters: compare with a --source fp8 export of the checkpoint
        _check(_convert("--format", "hf", "--source", "fp8", "--dtype", "float32", str(save), str(tmp_path / "hp")))
        values = load_file(str(tmp_path / "hp" / "model.safetensors"))
    suffix = "_scale_inv" if fmt == "fp8-block" else "_scale"
    fp8_keys = [k for k, t in tensors.items() if t.dtype == torch.float8_e4m3fn]
    assert len(fp8_keys) == 2 * 7  # q, k, v, o, gate, up, down of each layer
    for key in fp8_keys:
        payload, inv = tensors[key].float(), tensors[key + suffix]
        grid = inv.reshape(()) if inv.numel() == 1 else (inv if inv.shape[1] == 1 and fmt != "fp8-block" else
                                                         expand_scales(inv, (128, 128), tuple(payload.shape)))
        assert torch.equal(payload * grid, values[key]), key
    for key, t in tensors.items():  # the rest in bf16 (the default --dtype), equal to the values rounded
        if t.dtype != torch.float8_e4m3fn and not key.endswith(suffix):
            assert t.dtype == torch.bfloat16 and torch.equal(t, values[key].to(torch.bfloat16)), key
    args, state, _ = read_checkpoint_fp8(save)  # o_proj is linear_proj unsplit: the checkpoint's bytes themselves
    assert torch.equal(tensors["model.layers.1.self_attn.o_proj.weight"].view(torch.uint8),
                       state["decoder.layers.1.self_attention.linear_proj.weight"].view(torch.uint8))
    config = json.loads((outdir / "config.json").read_text())
    qc = config["quantization_config"]
    if fmt == "fp8-block":
        assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    else:
        assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    expected_ignored = ["lm_head"]  # tied (O2, O3) or the untied output layer kept in high precision (TP2)
    assert qc["ignore" if fmt == "compressed-tensors" else "modules_to_not_convert"] == expected_ignored
    logits = _hf_logits(outdir)
    vocab = config["vocab_size"]
    rel = _rel(logits, exported[name][2][..., :vocab])
    MEASURED[f"{name}_fp8_{fmt}"] = rel
    print(f"{name} --quantization fp8 {fmt}: relative Frobenius error of the logits {rel:.3g}")
    assert rel < FP8_BOUND, rel


def test_fp8_export_is_refused_for_gpt2_and_high_precision_runs(exported, tmp_path):
    proc = _convert("--quantization", "fp8", str(exported["root"] / "gpt2_O2"), str(tmp_path / "a"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "Conv1D" in proc.stderr
    proc = _convert("--quantization", "fp8", str(exported["root"] / "llama_none"), str(tmp_path / "b"))
    assert proc.returncode == 2 and "no FP8 weight" in proc.stderr and "--format hf" in proc.stderr
    proc = _convert("--quantization", "fp8", "--format", "safetensors", str(exported["root"] / "llama_O2"),
                    str(tmp_path / "c"))
    assert proc.returncode == 2 and "drop --format safetensors" in proc.stderr
    proc = _convert("--fp8-format", "fp8-block", str(exported["root"] / "llama_O2"), str(tmp_path / "d.safetensors"))
    assert proc.returncode == 2 and "add --quantization fp8" in proc.stderr


def test_fp8_debug_ranks_the_layers_of_a_checkpoint(exported, tmp_path):
    """``tools/fp8_debug.py`` on a TP2 pretrain_gpt.py checkpoint (through the single-process conversion) and on its
    FP8 export: every FP8 linear ranked, none past the default threshold (exit 0); a threshold every layer passes names
    the first in forward order (exit 1); a missing checkpoint is one line (exit 2)."""
    save = exported["root"] / "llama_tp2_O2"
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "tools/fp8_debug.py", str(save), "--json", str(out)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert len(report["layers"]) == 2 * 7 and report["first_bad"] is None
    assert all(0 < layer["error"] < report["threshold"] for layer in report["layers"])
    _check(_convert("--quantization", "fp8", str(save), str(tmp_path / "fp8")))
    proc = subprocess.run([sys.executable, "tools/fp8_debug.py", str(tmp_path / "fp8"), "--threshold", "1e-6"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and "first bad layer (forward order): model.layers.0.self_attn.q_proj" in proc.stdout
    proc = subprocess.run([sys.executable, "tools/fp8_debug.py", str(tmp_path / "missing")], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "does not exist" in proc.stderr
