"""FP8 export for serving, per format and recipe: bytes on disk, payload bit-equality, logit error of the served model
against the FP8 model, and the import round trip (docs/serving.md).

    python benchmarks/serving_export.py [--steps 20] [--json benchmarks/results/serving_export.json]

The model: a transformers Llama in bf16 (4 layers, hidden 512, 8 heads, 4 KV heads, MLP 1536, vocabulary 4096,
untied embeddings: every width a multiple of 128, so the ``blockwise`` recipe runs on every linear, the LM head
included; it is exported in bf16, as serving engines hold it), trained ``--steps`` AdamW steps (lr 1e-3) at O2 on a
synthetic language (each token's successor a fixed random permutation) per recipe, then:

- exported with :func:`fp8.export.export_fp8` in each format; ``bytes on disk`` (the safetensors file) beside the
  bf16 export of the same model (``save_pretrained`` of :func:`high_precision_state_dict`);
- payload bit-equality: the FP8 weights whose exported E4M3 bytes are the model's own, and those re-quantized (with the
  largest change of a value over its weight's amax);
- the logit error: ``AutoModelForCausalLM.from_pretrained`` of the export (on CPU transformers dequantizes both
  formats; compressed-tensors also quantizes activations per token, as a serving engine does; fp8-block leaves them
  unquantized) against the FP8 model's own forward and against its forward with the FP8 weights in high precision,
  relative Frobenius norm over 4 sequences of 64 tokens;
- the import round trip: :func:`fp8.export.import_fp8` into a freshly initialized O1 and O2 model, exported again:
  whether every byte of every tensor is equal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

RECIPES = ("tensorwise", "rowwise", "blockwise")
FORMATS = ("compressed-tensors", "fp8-block")
VOCAB, SEQ = 4096, 64


def _model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).to(torch.bfloat16)


def _batch(generator: torch.Generator, perm: torch.Tensor, n: int = 8) -> torch.Tensor:
    x = torch.empty(n, SEQ, dtype=torch.long)
    x[:, 0] = torch.randint(0, VOCAB, (n,), generator=generator)
    for i in range(1, SEQ):
        x[:, i] = perm[x[:, i - 1]]
    return x


def _logits(model, x, high_precision_forward=False):
    from contextlib import nullcontext

    from fp8.convert import high_precision_forward as high_precision

    with torch.no_grad(), (high_precision(model) if high_precision_forward else nullcontext()):
        return model(input_ids=x).logits.float()


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _same_files(a: str, b: str) -> bool:
    from safetensors.torch import load_file

    x, y = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    return x.keys() == y.keys() and all(torch.equal(x[k].view(torch.uint8).flatten(), y[k].view(torch.uint8).flatten())
                                        for k in x)


def run(steps: int) -> list[dict]:
    import fp8
    from fp8.export import export_fp8, import_fp8
    from fp8.integrations.transformers import high_precision_state_dict
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(VOCAB, generator=g)
    rows = []
    for recipe in RECIPES:
        model = _model()
        model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O2", recipe=recipe)
        data = torch.Generator().manual_seed(2)
        for _ in range(steps):
            x = _batch(data, perm)
            model(input_ids=x, labels=x).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        x = _batch(torch.Generator().manual_seed(3), perm, 4)
        fp8_logits, hp_logits = _logits(model, x), _logits(model, x, True)
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(os.path.join(tmp, "bf16"), state_dict=high_precision_state_dict(model, optimizer))
            bf16_bytes = os.path.getsize(os.path.join(tmp, "bf16", "model.safetensors"))
            for fmt in FORMATS:
                out = os.path.join(tmp, fmt)
                report = export_fp8(model, out, fmt)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    served = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
                with torch.no_grad():
                    served_logits = served(input_ids=x).logits.float()
                trips = {}
                for level in ("O1", "O2"):
                    fresh = _model(seed=5)
                    fresh, opt = fp8.initialize(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3), level,
                                                recipe=recipe)
                    imported = import_fp8(fresh, out, opt)
                    again = os.path.join(tmp, f"{fmt}-{level}")
                    export_fp8(fresh, again, fmt)
                    trips[level] = {"exact": len(imported.exact), "requantized": len(imported.requantized),
                                    "re-export bit-equal": _same_files(out, again)}
                n_fp8 = len(report.fp8_weights)
                errors = [e for e, _ in report.requantized.values()]
                rows.append({
                    "recipe": recipe, "format": fmt, "strategies": sorted(set(report.fp8_weights.values())),
                    "parameters": report.parameters, "bytes_on_disk": report.bytes_on_disk,
                    "bytes_per_parameter": round(report.bytes_per_parameter, 4),
                    "bf16_export_bytes": bf16_bytes, "vs_bf16": round(report.bytes_on_disk / bf16_bytes, 4),
                    "payload_bytes": report.payload_bytes, "scale_bytes": report.scale_bytes,
                    "high_precision_bytes": report.high_precision_bytes,
                    "fp8_weights": n_fp8, "payload_bit_equal": n_fp8 - len(report.requantized),
                    "dequantized": report.dequantized,
                    "requantized": len(report.requantized),
                    "requantized_values_changed": sum(c for _, c in report.requantized.values()),
                    "requantized_max_error": max(errors, default=0.0),
                    "logits_vs_fp8_forward": _rel(served_logits, fp8_logits),
                    "logits_vs_high_precision_forward": _rel(served_logits, hp_logits),
                    "import_round_trip": trips,
                })
                print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| recipe | format | scales | bytes on disk | B/param | vs bf16 export | payload bit-equal | re-quantized "
             "(values changed, max error) | logits vs FP8 model | vs its weights in high precision | import O1/O2 -> "
             "re-export |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- |"]
    for r in rows:
        trip = " / ".join("bit-equal" if t["re-export bit-equal"] else "differs" for t in r["import_round_trip"].values())
        requant = (f"{r['requantized']} ({r['requantized_values_changed']}, {r['requantized_max_error']:.2e})"
                   if r["requantized"] else "0")
        lines.append(f"| {r['recipe']} | {r['format']} | {', '.join(r['strategies'])} | {r['bytes_on_disk']:,} | "
                     f"{r['bytes_per_parameter']:.3f} | {r['vs_bf16']:.3f}x | {r['payload_bit_equal']}/{r['fp8_weights']} "
                     f"| {requant} | {r['logits_vs_fp8_forward']:.4f} | {r['logits_vs_high_precision_forward']:.2e} | "
                     f"{trip} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", default=None, help="write the rows here (e.g. benchmarks/results/serving_export.json)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    rows = run(args.steps)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": f"python benchmarks/serving_export.py --steps {args.steps}", "device": "cpu",
                       "torch": torch.__version__, "rows": rows}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
