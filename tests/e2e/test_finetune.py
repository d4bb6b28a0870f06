"""examples/finetune: SFT and DPO scripts (none and O2), loss masking, truncation, bad input, BF16 export, torchrun."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron.training.finetune import data as finetune_data
from megatron.training.finetune import demo, export, runtime
from tests.spawn import run_worker

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str) -> SimpleNamespace:
    """The functions of ``examples/finetune/<name>.py`` (the script run as a module of its own, not imported from an
    ``examples`` package: the examples sit on the library, nothing imports them)."""
    return SimpleNamespace(**runpy.run_path(str(ROOT / "examples" / "finetune" / f"{name}.py"), run_name=f"{name}_script"))

# |final loss O2 - none| / none on the tiny task below (12 steps, random tiny Llama), measured over seeds 0-4:
# 0.00038 to 0.00076; the bound leaves 2x headroom over the largest.
SFT_O2_REL_TOL = 0.0016


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny Llama (random weights) with the demo corpus tokenizer (2048 BPE pieces)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from megatron.training.data.datasets import prepare_default_corpus
    from megatron.training.checkpointing.hf_export import write_tokenizer

    out = tmp_path_factory.mktemp("tiny-llama")
    _, spm = prepare_default_corpus(log=None)
    assert write_tokenizer(spm, out) is None
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.eos_token_id == 2
    return out


def _sft_rows(n=24):
    names = ["ROMEO", "JULIET", "HAMLET", "OPHELIA", "LEAR", "CORDELIA"]
    return [{"prompt": f"{names[i % 6]}\nWhat say you, {names[(i + 1) % 6].lower()}?\n\n{names[(i + 1) % 6]}\n",
             "response": f"I say the {['moon', 'sun', 'sea', 'night'][i % 4]} is {['fair', 'dark', 'cold'][i % 3]}."}
            for i in range(n)]


def _write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return finetune_data.prepare_tokenizer(AutoTokenizer.from_pretrained(str(tiny_model)))


def test_collate_masks_prompt_and_padding(tiny_model):
    tok = _tokenizer(tiny_model)
    a = finetune_data.encode(tok, "ROMEO\nHow now?\n\nJULIET\n", "Good night.", 64)
    b = finetune_data.encode(tok, "LEAR\nNothing will come of nothing.\n\nCORDELIA\n", "Nothing, my lord, nothing at all.", 64)
    n_prompt_a = len(tok("ROMEO\nHow now?\n\nJULIET\n")["input_ids"])
    batch = finetune_data.collate([a, b], tok.pad_token_id)
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    assert ids.shape == labels.shape == mask.shape and ids.shape[0] == 2
    # Row a: prompt masked, response + EOS labelled with its own ids, padding masked and not attended.
    la = len(a.input_ids)
    assert (labels[0, :n_prompt_a] == -100).all()
    assert labels[0, n_prompt_a:la].tolist() == ids[0, n_prompt_a:la].tolist()
    assert labels[0, la - 1].item() == tok.eos_token_id
    assert tok.decode(labels[0, n_prompt_a:la - 1]) == "Good night."
    assert (labels[0, la:] == -100).all() and (mask[0, la:] == 0).all() and (mask[0, :la] == 1).all()
    assert (ids[0, la:] == tok.pad_token_id).all()
    # The summed log-probs see exactly the response tokens (+ EOS).
    logits = torch.randn(2, ids.shape[1], 2048)
    _, counts = finetune_data.response_logprobs(logits, labels)
    assert counts.tolist() == [(labels[i] != -100).sum().item() for i in range(2)]
    assert counts[0].item() == la - n_prompt_a


def test_truncation_keeps_response_tokens(tiny_model):
    tok = _tokenizer(tiny_model)
    long_prompt = "ROMEO\n" + "But soft, what light through yonder window breaks? " * 20 + "\n\nJULIET\n"
    e = finetune_data.encode(tok, long_prompt, "Ay me.", 32)
    assert e.truncated and len(e.input_ids) == 32
    assert sum(x != -100 for x in e.labels) == len(tok("Ay me.", add_special_tokens=False)["input_ids"]) + 1
    e = finetune_data.encode(tok, "A\n", "word " * 100, 32)
    assert e.truncated and len(e.input_ids) == 32 and e.labels[0] == -100 and e.labels[-1] != -100
    assert not finetune_data.encode(tok, "A\n", "short", 32).truncated


def test_pad_token_defaults_to_eos(tiny_model):
    tok = _tokenizer(tiny_model)
    tok.pad_token = None
    assert finetune_data.prepare_tokenizer(tok).pad_token_id == tok.eos_token_id


@pytest.mark.parametrize("script,line,expect", [
    ("sft.py", '{"prompt": "a"}', "missing key 'response'"),
    ("sft.py", '{"prompt": "a", "response": 3}', "key 'response' must be a string"),
    ("sft.py", "not json", "not valid JSON"),
    ("dpo.py", '{"prompt": "a", "chosen": "b"}', "missing key 'rejected'"),
])
def test_bad_jsonl_exits_2_naming_line_and_key(tiny_model, tmp_path, script, line, expect):
    good = {"prompt": "a", "response": "b", "chosen": "b", "rejected": "c"}
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(good) + "\n\n" + line + "\n")
    proc = subprocess.run([sys.executable, str(ROOT / "examples/finetune" / script), "--model", str(tiny_model),
                           "--data", str(data), "--max-steps", "1"], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "bad.jsonl:3:" in last and expect in last, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def _run_sft(tiny_model, tmp_path, level, seed=0, steps=12, extra=()):
    data = _write_jsonl(tmp_path / "sft.jsonl", _sft_rows())
    log = tmp_path / f"sft-{level}-{seed}.jsonl"
    rc = _script("sft").main(["--model", str(tiny_model), "--data", str(data), "--fp8-opt-level", level, "--max-steps",
                   str(steps), "--lr", "3e-3", "--batch-size", "8", "--eval-examples", "4", "--seed", str(seed),
                   "--log-json", str(log), "--warmup-steps", "2", *extra])
    assert rc == 0
    return _log(log)


def test_sft_none_and_o2(tiny_model, tmp_path):
    out = tmp_path / "sft-o2-out"
    logs = {level: _run_sft(tiny_model, tmp_path, level, extra=["--output", str(out)] if level == "O2" else [])
            for level in ("none", "O2")}
    finals = {}
    for level, records in logs.items():
        steps = [r for r in records if "step" in r]
        assert len(steps) == 12 and all("loss" in r for r in steps)
        final = records[-1]["final"] if "final" in records[-1] else [r for r in records if "final" in r][-1]["final"]
        assert final["heldout_loss"] < final["heldout_loss_before"], (level, final)
        assert sum(r["loss"] for r in steps[-3:]) < sum(r["loss"] for r in steps[:3]), level
        finals[level] = steps[-1]["loss"]
    rel = abs(finals["O2"] - finals["none"]) / finals["none"]
    assert rel < SFT_O2_REL_TOL, finals
    # --output: a BF16 transformers directory that loads with the Auto classes and reproduces the masters.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(out))
    assert next(model.parameters()).dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"
    ids = tok("ROMEO\nWhat say you?\n\nJULIET\n", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()


@pytest.mark.parametrize("fmt", ["compressed-tensors", "fp8-block"])
def test_sft_from_and_back_to_an_fp8_serving_checkpoint(tiny_model, tmp_path, fmt):
    """``--output-format``: the FP8 weights as trained, for serving (docs/serving.md); ``--model`` of such a checkpoint:
    the fine-tuning starts from its bytes (no round trip: exported straight back, every tensor is bit-equal), and
    fine-tunes on (SFT from it, written in FP8 again, loaded by transformers)."""
    pytest.importorskip("compressed_tensors", reason="pip install -e '.[test]' (compressed-tensors)")
    import fp8
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    first = tmp_path / "first"
    _run_sft(tiny_model, tmp_path, "O2", steps=3, extra=["--output", str(first), "--output-format", fmt])
    assert runtime.serving_checkpoint(first) and not runtime.serving_checkpoint(tiny_model)
    args = SimpleNamespace(fp8_grad_accumulation="fp16", fp8_opt_level="O2", recipe="tensorwise", fp8_embeddings=True,
                           fp8_min_dim=None)
    rt = runtime.Runtime(0, 1, torch.device("cpu"), False)
    model, _ = runtime.load_model(first, rt.device)
    _, model, optimizer = runtime.fp8_setup(model, torch.optim.AdamW(model.parameters()), args, rt, first)
    fp8.export_fp8(model, tmp_path / "again", fmt, dtype=torch.bfloat16)  # as --output-format writes
    a, b = load_file(str(first / "model.safetensors")), load_file(str(tmp_path / "again" / "model.safetensors"))
    assert a.keys() == b.keys() and any(t.dtype == torch.float8_e4m3fn for t in a.values())
    assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
    (tmp_path / "second").mkdir()
    records = _run_sft(first, tmp_path / "second", "O2", steps=2,
                       extra=["--output", str(tmp_path / "second" / "out"), "--output-format", fmt])
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records if "step" in r)
    served = AutoModelForCausalLM.from_pretrained(str(tmp_path / "second" / "out"), dtype=torch.float32)
    with torch.no_grad():
        assert torch.isfinite(served(input_ids=torch.randint(0, 2048, (1, 8))).logits).all()
    # DPO from it too: policy (its bytes) and FP8 reference (frozen from its exact values) agree at the start
    data, log = _write_jsonl(tmp_path / "dpo.jsonl", _dpo_rows()), tmp_path / "dpo.jsonl.log"
    assert _script("dpo").main(["--model", str(first), "--data", str(data), "--fp8-opt-level", "O2", "--max-steps",
                                "2", "--batch-size", "4", "--eval-examples", "4", "--log-json", str(log), "--output",
                                str(tmp_path / "dpo-out"), "--output-format", fmt]) == 0
    steps = [r for r in _log(log) if "step" in r]
    assert len(steps) == 2 and steps[0]["loss"] == pytest.approx(0.6931, abs=5e-3)
    assert runtime.serving_checkpoint(tmp_path / "dpo-out")
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))  # refused before training
    with pytest.raises(finetune_data.DataError, match="Conv1D"):
        runtime.fp8_setup(gpt2, torch.optim.AdamW(gpt2.parameters()),
                          SimpleNamespace(**vars(args), output_format=fmt), rt)
    with pytest.raises(SystemExit):  # FP8 output at none is refused by the flags' check
        _script("sft").main(["--model", str(tiny_model), "--fp8-opt-level", "none", "--output", str(tmp_path / "x"),
                             "--output-format", fmt])


def _dpo_rows(n=24):
    rows = []
    for r in _sft_rows(n):
        rows.append({"prompt": r["prompt"], "chosen": r["response"], "rejected": "Exeunt, pursued by a bear."})
    return rows


def test_dpo_none_and_o2(tiny_model, tmp_path):
    import fp8

    data = _write_jsonl(tmp_path / "dpo.jsonl", _dpo_rows())
    for level in ("none", "O2"):
        log = tmp_path / f"dpo-{level}.jsonl"
        rc = _script("dpo").main(["--model", str(tiny_model), "--data", str(data), "--fp8-opt-level", level, "--max-steps", "6",
                       "--lr", "3e-3", "--batch-size", "4", "--eval-examples", "4", "--log-json", str(log)])
        assert rc == 0
        records = _log(log)
        steps = [r for r in records if "step" in r]
        assert len(steps) == 6
        for r in steps:
            assert {"loss", "reward_accuracy", "reward_margin"} <= r.keys()
            assert 0.0 <= r["reward_accuracy"] <= 1.0
        assert steps[0]["loss"] == pytest.approx(0.6931, abs=5e-3)  # policy == reference (up to its BF16/FP8 rounding)
        assert steps[-1]["reward_margin"] > 0
        final = [r for r in records if "final" in r][-1]["final"]
        assert final["reference"] == ("bf16" if level == "none" else "fp8")
        assert final["reference_trainable_parameters"] == 0
        table = [r for r in records if "memory" in r][-1]["memory"]
        for row in ("policy", "reference", "total"):
            assert table[row]["bytes"] > 0 and table[row]["ratio_vs_bf16"] > 0
        ref = table["reference"]["by_category"]
        assert ref["weight gradients"] == 0 and ref["optimizer states"] == 0 and ref["master weights"] == 0
        if level == "O2":
            # FP8 reference: 1 byte per parameter plus scales.
            assert ref["total"] < 1.1 * table["parameters"], ref
            # FP8 weights, embedding table and E4M3 gradients: 7 B per parameter against the BF16 pair's 16 (+ 1 vs 2
            # for the reference); measured 0.446 (policy) and 0.456 (total) on this tiny model (scales and norms)
            assert table["total"]["bytes"] == table["policy"]["bytes"] + table["reference"]["bytes"]
            assert table["policy"]["ratio_vs_bf16"] < 0.5 and table["total"]["ratio_vs_bf16"] < 0.5, table
    # The reference built for O2 is fp8.freeze's: FP8 weights, nothing trainable.
    args = type("A", (), {"reference": "fp8", "recipe": "tensorwise", "fp8_min_dim": None, "fp8_embeddings": True})()
    rt = runtime.Runtime(0, 1, torch.device("cpu"), False)
    reference = _script("dpo").build_reference(tiny_model, args, rt)
    assert any(isinstance(p, fp8.Float8Tensor) for p in reference.parameters())
    assert not any(p.requires_grad for p in reference.parameters())


def test_sft_torchrun_two_ranks_o2(tiny_model, tmp_path):
    data = _write_jsonl(tmp_path / "sft.jsonl", _sft_rows())
    log = tmp_path / "ddp.jsonl"
    run_worker(ROOT / "examples/finetune/sft.py", 2,
               ["--model", str(tiny_model), "--data", str(data), "--fp8-opt-level", "O2", "--max-steps", "4",
                "--batch-size", "8", "--eval-examples", "4", "--lr", "3e-3", "--log-json", str(log)], seed=0)
    records = _log(log)
    final = [r for r in records if "final" in r][-1]["final"]
    assert final["world_size"] == 2
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records if "step" in r)
    sums = final["weights_checksum_per_rank"]
    assert len(sums) == 2 and sums[0] == sums[1]


def test_sft_loss_is_the_global_token_mean_at_any_number_of_ranks(tiny_model, tmp_path):
    """Two ranks whose halves of each batch hold different numbers of response tokens train like one rank: each rank
    divides its token sum by the whole batch's count (not its own), so the objective does not depend on the split."""
    rows = [{"prompt": f"LEAR\nSpeak {i}.\n\nCORDELIA\n", "response": " ".join(["Nothing, my lord."] * (1 + 5 * (i % 2)))}
            for i in range(24)]  # even rows (rank 0's half of a batch in order) short, odd rows long
    data = _write_jsonl(tmp_path / "sft.jsonl", rows)
    flags = ["--model", str(tiny_model), "--data", str(data), "--fp8-opt-level", "none", "--max-steps", "4",
             "--batch-size", "8", "--eval-examples", "4", "--lr", "3e-3"]
    losses = {}
    for world in (1, 2):
        log = tmp_path / f"world{world}.jsonl"
        if world == 1:
            assert _script("sft").main([*flags, "--log-json", str(log)]) == 0
        else:
            run_worker(ROOT / "examples/finetune/sft.py", 2, [*flags, "--log-json", str(log)], seed=0)
        losses[world] = [r["loss"] for r in _log(log) if "step" in r]
    # fp32 sums in another order: measured 1.6e-7 relative. Each rank's own token mean, averaged over the ranks,
    # is measured 8e-4 away on these rows.
    assert losses[1] == pytest.approx(losses[2], rel=1e-4), losses


def test_demo_tasks_hold_out_plays():
    plays = demo.demo_plays()
    held_plays = plays[-demo.DEMO_HELDOUT_PLAYS:]
    held_prompts = {prompt for prompt, _, _ in demo.demo_pairs(held_plays)}
    train, held = demo.demo_rows("sft", 50, 10, seed=0)
    assert len(train) == 50 and len(held) == 10
    assert all(r.keys() == {"prompt", "response"} and r["response"] for r in train + held)
    assert all(r["prompt"] in held_prompts for r in held)
    assert not any(r["prompt"] in held_prompts for r in train)
    # Prompt: previous speaker and lines, blank line, next speaker's name (the corpus's own layout).
    assert all(r["prompt"].endswith("\n") and "\n\n" in r["prompt"] for r in train)
    train, held = demo.demo_rows("dpo", 50, 10, seed=0)
    assert all(r.keys() == {"prompt", "chosen", "rejected"} for r in train + held)
    assert all(r["chosen"] != r["rejected"] and r["chosen"].count("\n") == r["rejected"].count("\n")
               for r in train + held)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_export_takes_master_weights(tiny_model, level):
    """The exported values are the optimizer's masters, not the FP8-rounded weights the model holds."""
    import fp8

    rt = runtime.Runtime(0, 1, torch.device("cpu"), False)
    model, _ = runtime.load_model(tiny_model, rt.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = fp8.initialize(model, opt, level)
    ids = torch.randint(0, 2048, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    state = runtime.master_state(model, opt, level, rt)
    fp8_names = [n for n, p in model.named_parameters() if isinstance(p, fp8.Float8Tensor)]
    assert fp8_names and set(state) == {n for n, _ in model.named_parameters()}
    params = dict(model.named_parameters())
    masters = {id(w): m for m, w in opt.pairs} if level == "O1" else None
    for name in fp8_names:
        p = params[name]
        expect = masters[id(p)] if level == "O1" else opt.master_value(p)
        assert torch.equal(state[name], expect.detach().float())
        assert not torch.equal(state[name], p.dequantize(torch.float32))  # FP8 rounding differs from the master


def test_export_transposes_every_converted_conv1d_back(tmp_path):
    """GPT-2's Conv1D weights are stored (in, out): the exported value of each converted one is its (out, in) master
    transposed, square ones included (c_proj: their shape alone cannot tell)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import fp8

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=256, n_positions=32,
                                       bos_token_id=0, eos_token_id=0))
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = fp8.initialize(model, optimizer, "O2")

    class NoTokenizer:
        def save_pretrained(self, path):
            pass

    export.save_bf16(model, optimizer, NoTokenizer(), tmp_path, "O2", runtime.Runtime(0, 1, torch.device("cpu"), False))
    loaded = GPT2LMHeadModel.from_pretrained(str(tmp_path)).state_dict()
    for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
        layer = model.transformer.h[0].get_submodule(name)
        master = optimizer.master_value(layer.weight).t().to(torch.bfloat16)
        assert torch.equal(loaded[f"transformer.h.0.{name}.weight"], master), name


@pytest.mark.parametrize("script", ["sft", "dpo"])
def test_missing_corpus_names_the_finetune_fix(script, tmp_path, monkeypatch, capsys):
    """Without the corpus package the demo task cannot be built: the error names the install and sft/dpo's own
    flags (--data, --model), not pretrain_gpt.py's."""
    from megatron.training.data import corpus

    monkeypatch.setenv("FP8LM_CACHE", str(tmp_path))
    monkeypatch.setattr(corpus, "_find_installed_plays", lambda: None)
    with pytest.raises(SystemExit) as exit_info:
        _script(script).main(["--max-steps", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and "requirements-corpus.txt" in err
    assert "--data FILE.jsonl" in err and "--model DIR" in err and "--data-path" not in err and "--mock-data" not in err
