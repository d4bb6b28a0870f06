"""The fine-tuned model written as BF16 transformers weights, from the master weights."""

from __future__ import annotations

from pathlib import Path

import torch

from .runtime import Runtime, master_state

__all__ = ['save_bf16']


def save_bf16(model, optimizer, tokenizer, out: Path, level: str, rt: Runtime) -> None:
    """Write ``out``: a transformers directory of ``model``'s architecture in BF16 holding the trained values
    (:func:`master_state`; transformers ``Conv1D`` weights transposed back), plus the tokenizer."""
    from transformers import AutoModelForCausalLM

    state = master_state(model, optimizer, level, rt)
    if not rt.main:
        return
    import fp8
    from fp8.convert import is_conv1d

    fresh = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    target = dict(fresh.named_parameters())
    # transformers Conv1D weights are stored (in, out); the masters of the ones converted to FP8 are (out, in)
    trained = dict(model.named_modules())
    conv1d = {f"{name}.weight" for name, module in fresh.named_modules()
              if is_conv1d(module) and isinstance(trained.get(name), fp8.Float8Linear)}
    load = {}
    for name, v in state.items():
        if name not in target:
            raise RuntimeError(f"export: parameter {name!r} of the trained model is not in a fresh "
                               f"{type(fresh).__name__}; the model's structure changed")
        load[name] = v.t() if name in conv1d else v
    fresh.load_state_dict(load, strict=False)
    # Parameters not loaded must be tied to loaded ones (e.g. lm_head.weight sharing the embedding table).
    loaded_storage = {target[n].data_ptr() for n in load}
    untouched = [n for n, t in target.items() if n not in load and t.data_ptr() not in loaded_storage]
    if untouched:
        raise RuntimeError(f"export: no trained value for {untouched[:4]}")
    fresh = fresh.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
