"""Export a ``pretrain_gpt.py`` checkpoint as a Hugging Face ``transformers`` model directory.

:func:`export_hf` reads the checkpoint with :func:`megatron.training.checkpointing.checkpoint.read_checkpoint` (any
opt level, any TP/PP/DP layout: shards merged, FP8 weights dequantized to fp32), maps megatron-core
``GPTModel`` names onto a ``transformers`` architecture and writes ``config.json``, ``model.safetensors``
(in ``dtype``) and, when the run had one, its sentencepiece tokenizer (loadable with ``AutoTokenizer``).

Architectures (decided from the saved run's arguments):

- ``--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear`` ->
  ``LlamaForCausalLM`` (grouped-query attention included). megatron-core's fused ``linear_qkv`` rows are
  interleaved per query group (``[q heads of group g; k of g; v of g]`` for each ``g``): split into
  ``q_proj``/``k_proj``/``v_proj``. ``linear_fc1`` is ``[gate; up]``: split into ``gate_proj``/``up_proj``.
  megatron-core's rotary embedding (``rotary_interleaved=False``) rotates halves as Llama's
  ``rotate_half`` does, with base 10000 over the whole head dimension: no row permutation is needed.
- ``--normalization LayerNorm``, GELU, ``--position-embedding-type learned_absolute`` (the defaults) ->
  ``GPT2LMHeadModel`` (``activation_function="gelu"``: megatron uses ``F.gelu``, the exact erf GELU, not
  GPT-2's tanh ``gelu_new``). ``c_attn`` is a Conv1D (weight ``(in, 3 * hidden)``, ``[q | k | v]``);
  grouped-query attention is refused (GPT-2 has none); ``--disable-bias-linear`` runs get zero biases.

Both: layer-norm epsilon 1e-5 (megatron-core's default), tied embeddings unless
``--untie-embeddings-and-output-weights``, vocabulary padding rows cut to the real vocabulary.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

__all__ = ["HFExportError", "architecture_of", "hf_state_dict", "hf_config", "export_hf", "export_hf_fp8", "write_tokenizer"]

LAYERNORM_EPS = 1e-5  # megatron-core TransformerConfig.layernorm_epsilon (the trainer does not change it)
ROPE_THETA = 10000.0  # megatron-core GPTModel(rotary_base=10000), rotary_percent 1.0, not interleaved

_LLAMA_FLAGS = "--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear"
_GPT2_FLAGS = ("--normalization LayerNorm, no --swiglu, --position-embedding-type learned_absolute "
               "(pretrain_gpt.py's defaults; with or without --disable-bias-linear)")


class HFExportError(ValueError):
    """The checkpoint's model has no transformers counterpart; the message names the flags that would map."""


def architecture_of(args: dict) -> str:
    """``"llama"`` or ``"gpt2"`` for the saved run's arguments; :class:`HFExportError` otherwise."""
    if args.get("num_experts"):
        raise HFExportError(f"--num-experts {args['num_experts']}: MoE runs have no transformers mapping in this "
                            "exporter yet (dense Llama and GPT-2 runs only); read the weights with "
                            "tools/convert_checkpoint.py CKPT OUT.safetensors (megatron-core names)")
    norm, swiglu = args.get("normalization", "LayerNorm"), bool(args.get("swiglu"))
    pos, nobias = args.get("position_embedding_type", "learned_absolute"), bool(args.get("disable_bias_linear"))
    if norm == "RMSNorm" and swiglu and pos == "rope" and nobias:
        return "llama"
    if norm == "LayerNorm" and not swiglu and pos == "learned_absolute":
        heads, groups = args["num_attention_heads"], args.get("num_query_groups") or args["num_attention_heads"]
        if groups != heads:
            raise HFExportError(f"--num-query-groups {groups} (grouped-query attention, {heads} heads): GPT-2 has "
                                f"no grouped-query attention; train with {_LLAMA_FLAGS} for LlamaForCausalLM, "
                                "which has")
        return "gpt2"
    raise HFExportError(
        f"no transformers architecture for --normalization {norm}, {'--swiglu' if swiglu else 'no --swiglu'}, "
        f"--position-embedding-type {pos}, {'--disable-bias-linear' if nobias else 'with linear biases'}: "
        f"LlamaForCausalLM needs {_LLAMA_FLAGS}; GPT2LMHeadModel needs {_GPT2_FLAGS}")


def _dims(args: dict) -> tuple[int, int, int, int]:
    hidden, heads = args["hidden_size"], args["num_attention_heads"]
    groups = args.get("num_query_groups") or heads
    return hidden, heads, groups, hidden // heads


def _split_qkv(w: torch.Tensor, heads: int, groups: int, head_dim: int):
    """megatron-core's fused QKV (rows ``[q of g; k of g; v of g]`` per group ``g``; weight or bias) ->
    ``(q, k, v)`` with heads in order."""
    per = heads // groups
    grouped = w.reshape(groups, (per + 2) * head_dim, *w.shape[1:])
    q, k, v = torch.split(grouped, [per * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(heads * head_dim, *w.shape[1:]), k.reshape(groups * head_dim, *w.shape[1:]),
            v.reshape(groups * head_dim, *w.shape[1:]))


def real_vocab_size(args: dict) -> int:
    """The unpadded vocabulary: the tokenizer's when the run had one, else ``--vocab-size``."""
    if args.get("tokenizer_model"):
        from ..data.tokenizer import load_sentencepiece_model

        return load_sentencepiece_model(args["tokenizer_model"]).GetPieceSize()
    return int(args["vocab_size"])


def hf_state_dict(args: dict, state: dict[str, torch.Tensor], vocab: int) -> dict[str, torch.Tensor]:
    """``state`` (``read_checkpoint``'s: megatron-core names, merged, fp32) in the transformers
    architecture's names (:func:`architecture_of`)."""
    arch = architecture_of(args)
    hidden, heads, groups, head_dim = _dims(args)
    tied = not args.get("untie_embeddings_and_output_weights")
    out: dict[str, torch.Tensor] = {}
    embed = state["embedding.word_embeddings.weight"][:vocab]
    for i in range(args["num_layers"]):
        m = f"decoder.layers.{i}."
        q, k, v = _split_qkv(state[m + "self_attention.linear_qkv.weight"], heads, groups, head_dim)
        if arch == "llama":
            h = f"model.layers.{i}."
            out[h + "input_layernorm.weight"] = state[m + "input_layernorm.weight"]
            out[h + "post_attention_layernorm.weight"] = state[m + "pre_mlp_layernorm.weight"]
            out[h + "self_attn.q_proj.weight"], out[h + "self_attn.k_proj.weight"] = q, k
            out[h + "self_attn.v_proj.weight"] = v
            out[h + "self_attn.o_proj.weight"] = state[m + "self_attention.linear_proj.weight"]
            gate, up = state[m + "mlp.linear_fc1.weight"].chunk(2, dim=0)
            out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
            out[h + "mlp.down_proj.weight"] = state[m + "mlp.linear_fc2.weight"]
        else:
            h = f"transformer.h.{i}."

            def bias(name: str, size: int) -> torch.Tensor:
                return state.get(m + name, torch.zeros(size))

            for ours, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
                out[h + theirs + ".weight"] = state[m + ours + ".weight"]
                out[h + theirs + ".bias"] = state[m + ours + ".bias"]
            out[h + "attn.c_attn.weight"] = torch.cat([q, k, v]).t()  # Conv1D: (in, out)
            out[h + "attn.c_attn.bias"] = torch.cat(_split_qkv(bias("self_attention.linear_qkv.bias", 3 * hidden),
                                                               heads, groups, head_dim))
            out[h + "attn.c_proj.weight"] = state[m + "self_attention.linear_proj.weight"].t()
            out[h + "attn.c_proj.bias"] = bias("self_attention.linear_proj.bias", hidden)
            fc1 = state[m + "mlp.linear_fc1.weight"]
            out[h + "mlp.c_fc.weight"] = fc1.t()
            out[h + "mlp.c_fc.bias"] = bias("mlp.linear_fc1.bias", fc1.shape[0])
            out[h + "mlp.c_proj.weight"] = state[m + "mlp.linear_fc2.weight"].t()
            out[h + "mlp.c_proj.bias"] = bias("mlp.linear_fc2.bias", hidden)
    if arch == "llama":
        out["model.embed_tokens.weight"] = embed
        out["model.norm.weight"] = state["decoder.final_layernorm.weight"]
        if not tied:
            out["lm_head.weight"] = state["output_layer.weight"][:vocab]
    else:
        out["transformer.wte.weight"] = embed
        out["transformer.wpe.weight"] = state["embedding.position_embeddings.weight"]
        out["transformer.ln_f.weight"] = state["decoder.final_layernorm.weight"]
        out["transformer.ln_f.bias"] = state["decoder.final_layernorm.bias"]
        if not tied:
            out["lm_head.weight"] = state["output_layer.weight"][:vocab]
    return out


def hf_config(args: dict, vocab: int, dtype: torch.dtype):
    """The transformers ``PretrainedConfig`` of the saved run's model."""
    hidden, heads, groups, head_dim = _dims(args)
    ffn = args.get("ffn_hidden_size") or 4 * hidden
    tied = not args.get("untie_embeddings_and_output_weights")
    if architecture_of(args) == "llama":
        from transformers import LlamaConfig

        config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                             num_hidden_layers=args["num_layers"], num_attention_heads=heads,
                             num_key_value_heads=groups, head_dim=head_dim, hidden_act="silu",
                             max_position_embeddings=args["max_position_embeddings"], rms_norm_eps=LAYERNORM_EPS,
                             rope_theta=ROPE_THETA, attention_bias=False, mlp_bias=False, attention_dropout=0.0,
                             tie_word_embeddings=tied, bos_token_id=None, eos_token_id=None, pad_token_id=None)
        config.architectures = ["LlamaForCausalLM"]
    else:
        from transformers import GPT2Config

        config = GPT2Config(vocab_size=vocab, n_positions=args["max_position_embeddings"], n_embd=hidden,
                            n_layer=args["num_layers"], n_head=heads, n_inner=ffn, activation_function="gelu",
                            layer_norm_epsilon=LAYERNORM_EPS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            tie_word_embeddings=tied, bos_token_id=None, eos_token_id=None)
        config.architectures = ["GPT2LMHeadModel"]
    config.dtype = dtype
    return config


def _varints(data: bytes):
    """(field number, wire type, value) of a protobuf message's fields: values are ints (varint, fixed) or bytes."""
    i = 0

    def varint() -> int:
        nonlocal i
        value = shift = 0
        while True:
            byte = data[i]
            i += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    while i < len(data):
        key = varint()
        field, wire = key >> 3, key & 7
        if wire == 0:
            yield field, wire, varint()
        elif wire == 1:
            yield field, wire, int.from_bytes(data[i:i + 8], "little")
            i += 8
        elif wire == 2:
            size = varint()
            yield field, wire, data[i:i + size]
            i += size
        elif wire == 5:
            yield field, wire, int.from_bytes(data[i:i + 4], "little")
            i += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")


def _sentencepiece_specs(model_bytes: bytes) -> tuple[dict[int, object], dict[int, object]]:
    """The model's TrainerSpec and NormalizerSpec as {field number: value} (read without ``protobuf``)."""
    trainer: dict[int, object] = {}
    normalizer: dict[int, object] = {}
    for field, _, value in _varints(model_bytes):
        if field in (2, 3):
            (trainer if field == 2 else normalizer).update((f, v) for f, _, v in _varints(value))
    return trainer, normalizer


def _tokenizer_json(sp, model_bytes: bytes):
    """A ``tokenizers.Tokenizer`` encoding exactly like the sentencepiece processor ``sp`` (no BOS/EOS added),
    or a reason string when the model uses settings it cannot reproduce."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    trainer, normalizer = _sentencepiece_specs(model_bytes)
    model_type = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}.get(int(trainer.get(3, 1)), "?")
    name = bytes(normalizer.get(1, b"nmt_nfkc")).decode()
    add_dummy_prefix = bool(normalizer.get(3, 1))
    remove_extra_ws = bool(normalizer.get(4, 1))
    escape_ws = bool(normalizer.get(5, 1))
    ws_suffix = bool(trainer.get(24, 0))
    byte_fallback = bool(trainer.get(35, 0))
    if model_type not in ("bpe", "unigram"):
        return f"model type {model_type}"
    if name != "identity" or remove_extra_ws or not escape_ws or ws_suffix:
        return (f"normalization {name!r} (remove_extra_whitespaces={remove_extra_ws}, "
                f"escape_whitespaces={escape_ws}, treat_whitespace_as_suffix={ws_suffix})")
    n = sp.get_piece_size()
    pieces = [sp.id_to_piece(i) for i in range(n)]
    special = [i for i in range(n) if sp.is_control(i) or sp.is_unknown(i)]
    unk = sp.unk_id()
    if model_type == "unigram":
        floor = min(sp.get_score(i) for i in range(n)) - 1e4  # control pieces never match text in sentencepiece
        model = models.Unigram([(pieces[i], floor if i in special else sp.get_score(i)) for i in range(n)],
                               unk_id=unk, byte_fallback=byte_fallback)
    else:  # BPE: sentencepiece merges the adjacent pair whose merged piece ranks first (id order)
        skip = set(special) | {i for i in range(n) if sp.is_byte(i)}
        vocab = {p: i for i, p in enumerate(pieces)}
        merges = []
        for i, merged in enumerate(pieces):
            if i in skip or len(merged) < 2:
                continue
            splits = [(merged[:k], merged[k:]) for k in range(1, len(merged))
                      if vocab.get(merged[:k], -1) not in (-1, *skip) and vocab.get(merged[k:], -1) not in (-1, *skip)]
            merges.extend(sorted(splits, key=lambda lr: (vocab[lr[0]], vocab[lr[1]])))
        model = models.BPE(vocab, merges, unk_token=pieces[unk] if unk >= 0 else None, byte_fallback=byte_fallback,
                           fuse_unk=True)
    tokenizer = Tokenizer(model)
    steps = ([normalizers.Prepend("\u2581")] if add_dummy_prefix else []) + [normalizers.Replace(" ", "\u2581")]
    tokenizer.normalizer = normalizers.Sequence(steps)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_dummy_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    tokenizer.encode_special_tokens = True  # sentencepiece never matches control pieces in text
    return tokenizer


def write_tokenizer(model_path: str, outdir: Path) -> str | None:
    """The run's sentencepiece model as ``tokenizer.json`` (a fast tokenizer: no ``protobuf`` needed) plus
    ``tokenizer.model``, with a ``tokenizer_config.json`` adding no BOS/EOS (the trainer's tokenizer adds
    none: documents end with ``</s>`` in the data). Returns why ``tokenizer.json`` was not written, or None."""
    from ..data.tokenizer import load_sentencepiece_model

    sp = load_sentencepiece_model(model_path)
    shutil.copyfile(model_path, outdir / "tokenizer.model")

    def piece(i: int) -> str | None:
        return sp.IdToPiece(i) if 0 <= i < sp.GetPieceSize() else None

    fast = _tokenizer_json(sp, Path(model_path).read_bytes())
    config = {"add_bos_token": False, "add_eos_token": False, "bos_token": piece(sp.bos_id()),
              "eos_token": piece(sp.eos_id()), "unk_token": piece(sp.unk_id()), "pad_token": piece(sp.pad_id()),
              "clean_up_tokenization_spaces": False,
              "split_special_tokens": True}
    if isinstance(fast, str):
        config.update({"tokenizer_class": "LlamaTokenizer", "legacy": False})
    else:
        fast.save(str(outdir / "tokenizer.json"))
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (outdir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return fast if isinstance(fast, str) else None


def export_hf(checkpoint: str | os.PathLike, outdir: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
              iteration: int | None = None, source: str = "master") -> dict:
    """Write the transformers directory ``outdir`` for the checkpoint; returns a summary (``architecture``,
    ``tensors``, ``elements``, ``tokenizer``: the tokenizer file written or ``None``)."""
    from safetensors.torch import save_file

    from .checkpoint import read_checkpoint

    outdir = Path(outdir)
    if outdir.exists() and not outdir.is_dir():
        raise ValueError(f"output {str(outdir)!r} is a file: --format hf writes a directory")
    args, state = read_checkpoint(checkpoint, iteration, source=source)
    arch = architecture_of(args)
    vocab = real_vocab_size(args)
    tensors = {k: v.to(dtype).contiguous() for k, v in hf_state_dict(args, state, vocab).items()}
    config = hf_config(args, vocab, dtype)
    outdir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(outdir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(outdir))
    tokenizer = None
    if args.get("tokenizer_model"):
        skipped = write_tokenizer(args["tokenizer_model"], outdir)
        tokenizer = str(outdir / ("tokenizer.model" if skipped else "tokenizer.json"))
    return {"architecture": config.architectures[0], "arch": arch, "tensors": len(tensors),
            "elements": sum(t.numel() for t in tensors.values()), "vocab": vocab, "tokenizer": tokenizer}


def _serving_strategy(weights: dict[str, "torch.Tensor"], format: str) -> str:
    """The one strategy every FP8 linear of a compressed-tensors export takes (serving engines fuse q/k/v and
    gate/up, which must share one): the first of tensor, channel, block that holds every weight exactly, else the one
    that re-quantizes the fewest (channel on a tie)."""
    from fp8.export import serving_weight

    if format == "fp8-block":
        return "block"
    inexact = {}
    for strategy in ("tensor", "channel", "block"):
        inexact[strategy] = sum(serving_weight(w, strategy).requantized for w in weights.values())
        if inexact[strategy] == 0:
            return strategy
    return min(("channel", "tensor", "block"), key=lambda s: inexact[s])


def export_hf_fp8(checkpoint: str | os.PathLike, outdir: str | os.PathLike, format: str = "compressed-tensors",
                  dtype: torch.dtype = torch.bfloat16, iteration: int | None = None):
    """Write the transformers directory ``outdir`` for the checkpoint with its FP8 weights as trained, in the serving
    ``format`` (:data:`fp8.export.FORMATS`): each FP8 linear's E4M3 payload (tensor-parallel shards merged, q/k/v and
    gate/up split as :func:`hf_state_dict` splits values) and its scales in one strategy for the whole model
    (:func:`_serving_strategy`: per tensor when every weight has one scale, e.g. tensorwise at TP1; per output channel
    when each row has one, e.g. tensorwise column-parallel shards or rowwise; 128x128 blocks for ``fp8-block``),
    re-quantized only where that strategy cannot hold the trained scales (listed in the report, with the error);
    embeddings, norms and high-precision linears in ``dtype``. ``LlamaForCausalLM`` only (GPT-2's Conv1D layers have no
    FP8 serving layout). Returns the :class:`fp8.export.ExportReport` and the summary of :func:`export_hf`."""
    from fp8.export import serving_weight, write_fp8_checkpoint
    from fp8.tensor import Float8Tensor

    from .checkpoint import read_checkpoint_fp8

    outdir = Path(outdir)
    if outdir.exists() and not outdir.is_dir():
        raise ValueError(f"output {str(outdir)!r} is a file: --quantization fp8 writes a directory")
    args, state, scales = read_checkpoint_fp8(checkpoint, iteration)
    arch = architecture_of(args)
    if arch != "llama":
        raise HFExportError(f"--quantization fp8 writes LlamaForCausalLM ({_LLAMA_FLAGS}); this run maps to GPT-2, "
                            "whose Conv1D layers no FP8 serving format loads: export it in high precision (--format "
                            "hf without --quantization)")
    if not scales:
        raise HFExportError("the checkpoint holds no FP8 weight (--fp8-opt-level none): export it with --format hf")
    vocab = real_vocab_size(args)
    payloads = {k: (v.view(torch.uint8) if k in scales else v) for k, v in state.items()}
    spread = {k: scales.get(k, torch.zeros(v.shape)) for k, v in state.items()}
    hf_values, hf_scales = hf_state_dict(args, payloads, vocab), hf_state_dict(args, spread, vocab)
    fp8_dtype = {state[k].dtype for k in scales}.pop()
    fp8_weights, high = {}, {}
    for key, value in hf_values.items():
        scale = hf_scales[key]
        if key == "lm_head.weight" and value.dtype == torch.uint8:  # serving engines hold the LM head unquantized
            high[key] = (value.view(fp8_dtype).to(torch.float32) / scale).to(dtype).contiguous()
            continue
        if key.endswith(".weight") and value.dtype == torch.uint8 and scale.numel() and bool((scale > 0).all()):
            fp8_weights[key.removesuffix(".weight")] = Float8Tensor(value.contiguous().view(fp8_dtype),
                                                                    scale.contiguous(), torch.float32, block=(1, 1))
        else:
            high[key] = value.to(dtype).contiguous()
    strategy = _serving_strategy(fp8_weights, format)
    served = {name: serving_weight(w, strategy) for name, w in fp8_weights.items()}
    linears = [k.removesuffix(".weight") for k in hf_values if k.endswith(("_proj.weight", "lm_head.weight"))]
    tied = not args.get("untie_embeddings_and_output_weights")
    ignored = [n for n in linears if n not in served] + (["lm_head"] if tied else [])
    config = hf_config(args, vocab, dtype)
    report = write_fp8_checkpoint(outdir, format, served, high, ignored, config.to_dict())
    tokenizer = None
    if args.get("tokenizer_model"):
        skipped = write_tokenizer(args["tokenizer_model"], outdir)
        tokenizer = str(outdir / ("tokenizer.model" if skipped else "tokenizer.json"))
    summary = {"architecture": config.architectures[0], "arch": arch, "tensors": len(served) * 2 + len(high),
               "elements": report.parameters, "vocab": vocab, "tokenizer": tokenizer, "strategy": strategy,
               "requantized": report.requantized}
    return report, summary
