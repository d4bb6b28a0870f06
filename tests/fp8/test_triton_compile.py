"""Every Triton kernel the library launches, compiled for an H100 (sm_90) on this GPU-less machine: Triton's front end,
its type checks (the interpreter the other kernel tests run under does not type the kernels) and ptxas, with no
launch. A kernel that only runs interpreted could otherwise fail at its first GPU launch: the optimizer's stores once
did ("Mismatched type for encoded between then block (fp16) and else block (uint8)").

Each case is one kernel with the argument types its ``launch_*`` function passes (payloads as
:func:`fp8.kernels.triton_formats.payload_view` addresses them, int64 address tables, int32 block tables) and one of
the constexpr combinations the library launches it with: each format family it reads or writes (fp32, bf16, fp16,
FP8) and each flag that selects other code. Helper jit functions are compiled through the kernels that call them."""

from __future__ import annotations

import importlib
import inspect
import os

import pytest

P64, P32, PI32, PU8, F, I = "*i64", "*fp32", "*i32", "*u8", "fp32", "i32"
PAYLOAD = {0: "*fp32", 1: "*i16", 2: "*fp16", 3: PU8, 4: PU8}
"""The pointer a payload of each format code is passed as (payload_view: bf16 as int16, FP8 as uint8)."""
FMAX = {3: 448.0, 4: 57344.0}
H100 = ("cuda", 90, 32)


def _case(kernel: str, types: dict, constexprs: dict, num_warps: int = 4, ones: tuple = ()) -> tuple:
    """``kernel``: ``module.name`` in :mod:`fp8.kernels` (``name()``: a function that returns the kernel). ``ones``:
    integer arguments that are 1 at that launch (a contiguous tensor's last stride, one segment), which Triton's
    launcher passes as constants: the kernel is then compiled with a constexpr there."""
    types = {k: v for k, v in types.items() if k not in ones}
    return kernel, types, {**constexprs, **dict.fromkeys(ones, 1)}, num_warps


# -- fp8.kernels.triton_cast -------------------------------------------------------------------------------------------
def _cast_transpose_amax(in_fmt, out_fmt, transpose, ones=()):
    return _case("triton_cast._cast_transpose_amax_kernel",
                 dict(x_ptr=PAYLOAD[in_fmt], scale_ptr=P32, data_ptr=PU8, data_t_ptr=PU8, amax_ptr=P32,
                      nonfinite_ptr=PI32, M=I, N=I, stride_m=I, stride_n=I),
                 dict(IN_FMT=in_fmt, OUT_FMT=out_fmt, FMAX=FMAX[out_fmt], TRANSPOSE=transpose, BLOCK_M=64, BLOCK_N=64),
                 ones=ones)


def _amax_unless(in_fmt):
    return _case("triton_cast._amax_unless_kernel", dict(x_ptr=PAYLOAD[in_fmt], skip_ptr=PI32, amax_ptr=P32, numel=I),
                 dict(IN_FMT=in_fmt, BLOCK=1024))


# -- fp8.kernels.triton_quantize (fp8.ops) -----------------------------------------------------------------------------
def _amax(in_fmt, has_row, has_col, ones=()):
    return _case("triton_quantize._amax_kernel",
                 dict(x_ptr=PAYLOAD[in_fmt], row_ptr=P32, col_ptr=P32, scratch_ptr=PI32, out_ptr=P32, M=I, N=I,
                      stride_m=I, stride_n=I, n_programs=I),
                 dict(IN_FMT=in_fmt, HAS_ROW=has_row, HAS_COL=has_col, BLOCK_M=64, BLOCK_N=128), ones=ones)


def _cast_t(in_fmt, out_fmt, from_amax, transpose, record, has_dst, margin=0, ones=()):
    return _case("triton_quantize._cast_t_kernel",
                 dict(x_ptr=PAYLOAD[in_fmt], scale_ptr=P32, amax2_ptr=P32, prev_ptr=P32, slot_ptr=P32, data_ptr=PU8,
                      t_ptr=PU8, dst_ptr=PI32, inv_ptr=P32, M=I, N=I, stride_m=I, stride_n=I, t_width=I),
                 dict(IN_FMT=in_fmt, OUT_FMT=out_fmt, FMAX=FMAX[out_fmt], MARGIN=margin, FROM_AMAX=from_amax,
                      TRANSPOSE=transpose, RECORD=record, HAS_DST=has_dst, BLOCK_M=64, BLOCK_N=64), ones=ones)


def _rows_or_cols(kernel, in_fmt, out_fmt, has_xs, xs_per_row, ones=()):
    rows = kernel == "_rows_kernel"
    types = dict(x_ptr=PAYLOAD[in_fmt], xs_ptr=P32, inv_ptr=P32, M=I, N=I, stride_m=I, stride_n=I)
    types.update(dict(data_ptr=PU8) if rows else dict(t_ptr=PU8, width=I))
    return _case(f"triton_quantize.{kernel}", types,
                 dict(IN_FMT=in_fmt, OUT_FMT=out_fmt, FMAX=FMAX[out_fmt], HAS_XS=has_xs, XS_PER_ROW=xs_per_row,
                      BLOCK_M=16 if rows else 128, BLOCK_N=128 if rows else 16), ones=ones)


def _tiles(in_fmt, out_fmt, columnwise, has_xs, tile, transpose_c, swizzle, ones=()):
    return _case("triton_quantize._tiles_kernel",
                 dict(x_ptr=PAYLOAD[in_fmt], xs_ptr=P32, data_ptr=PU8, inv_ptr=P32, data_c_ptr=PU8, inv_c_ptr=P32,
                      hw_ptr=PU8 if swizzle else P32, hw_c_ptr=PU8 if swizzle and columnwise else P32, M=I, N=I,
                      stride_m=I, stride_n=I, rows_c=I, n_tiles=I, m_tiles=I),
                 dict(IN_FMT=in_fmt, OUT_FMT=out_fmt, FMAX=FMAX[out_fmt], COLUMNWISE=columnwise, HAS_XS=has_xs,
                      TILE=tile, TRANSPOSE_C=transpose_c, SWIZZLE=swizzle),
                 num_warps=8 if tile >= 128 else 4, ones=ones)


def _elementwise(in_fmt, out_fmt, has_row, has_col, to_fp16, ones=()):
    return _case("triton_quantize._scale_elementwise_kernel",
                 dict(x_ptr=PAYLOAD[in_fmt], row_ptr=P32, col_ptr=P32, amax2_ptr=P32, out_ptr=PAYLOAD[out_fmt],
                      scale_out_ptr=P32, M=I, N=I, stride_m=I, stride_n=I),
                 dict(IN_FMT=in_fmt, OUT_FMT=out_fmt, HAS_ROW=has_row, HAS_COL=has_col, TO_FP16=to_fp16, BLOCK_M=64,
                      BLOCK_N=64), ones=ones)


def _update_scales(has_enabled, block):
    return _case("triton_quantize._update_scales_kernel",
                 dict(table_ptr=P64, fmax_ptr=P32, enabled_ptr="*i8" if has_enabled else P32),
                 dict(HAS_ENABLED=has_enabled, BLOCK=block))


def _sum_chunks(chunks, in_fmt, out_fmt):
    return _case("triton_quantize._sum_chunks_kernel",
                 dict(src_ptr=PAYLOAD[in_fmt], inv_ptr=P32, out_ptr=PAYLOAD[out_fmt], n=I),
                 dict(CHUNKS=chunks, IN_FMT=in_fmt, OUT_FMT=out_fmt, BLOCK=1024))


def _segment(kernel, in_fmt, out_fmt=None, ones=()):
    types = {
        "_segment_amax_kernel": dict(x_ptr=PAYLOAD[in_fmt], off_ptr=P64, out_ptr=P32, R=I, C=I, stride_r=I, N_SEG=I),
        "_segment_cast_kernel": dict(x_ptr=PAYLOAD[in_fmt], off_ptr=P64, amax_ptr=P32, data_ptr=PU8, inv_ptr=P32,
                                     R=I, C=I, stride_r=I, N_SEG=I),
        "_segment_sum_kernel": dict(src_ptr=PAYLOAD[in_fmt], off_ptr=P64, inv_ptr=P32, amax_ptr=P32, out_ptr=P32,
                                    R=I, C=I, N_SEG=I, divisor=F),
        "_row_chunk_sum_kernel": dict(src_ptr=PAYLOAD[in_fmt], inv_ptr=P32, out_ptr=P32, C=I, N=I, R=I, width=I,
                                      src_stride=I, divisor=F),
    }[kernel]
    constexprs = dict(IN_FMT=in_fmt, BLOCK=512 if kernel == "_segment_amax_kernel" else 1024)
    if out_fmt is not None:
        constexprs.update(OUT_FMT=out_fmt, FMAX=FMAX[out_fmt])
    return _case(f"triton_quantize.{kernel}", types, constexprs, ones=ones)


# -- fp8.kernels.triton_fp4 --------------------------------------------------------------------------------------------
def _nvfp4_amax(in_fmt, signs, has_scale, ones=()):
    return _case("triton_fp4._amax_kernel",
                 dict(x_ptr=PAYLOAD[in_fmt], s_ptr=P32, scratch_ptr=PI32, out_ptr=P32, R=I, K=I, stride_r=I,
                      stride_k=I, ss_r=I, ss_k=I, n_programs=I),
                 dict(IN_FMT=in_fmt, SIGNS=signs, HAS_SCALE=has_scale, BLOCK_R=128), ones=ones)


def _nvfp4(in_fmt, block_rows, signs, has_scale, stochastic, ones=()):
    return _case("triton_fp4._nvfp4_kernel",
                 dict(x_ptr=PAYLOAD[in_fmt], s_ptr=P32, amax_ptr=P32, data_ptr=PU8, inv_ptr=P32, hw_ptr=PU8,
                      ginv_ptr=P32, R=I, K=I, KB=I, stride_r=I, stride_k=I, ss_r=I, ss_k=I, k_tiles=I, seed=I),
                 dict(IN_FMT=in_fmt, BLOCK_ROWS=block_rows, SIGNS=signs, HAS_SCALE=has_scale, STOCHASTIC=stochastic,
                      BLOCK_R=128), ones=ones)


# -- fp8.kernels.triton_grad_accumulate --------------------------------------------------------------------------------
def _accumulate(kernel, acc_fmt, new_fmt):
    types = dict(acc_ptr=PU8 if acc_fmt in FMAX else "*fp16", acc_scale_ptr=P32, new_ptr=PAYLOAD[new_fmt],
                 new_scale_ptr=P32, numel=I)
    types.update({"_amax_kernel": dict(amax_ptr=P32, nan_ptr=PI32), "_fp16_amax_kernel": dict(sum_amax_ptr=P32,
                  acc_amax_ptr=P32)}.get(kernel, dict(out_scale_ptr=P32)))
    constexprs = dict(NEW_FMT=new_fmt, BLOCK=1024)
    if acc_fmt in FMAX:
        constexprs.update(ACC_FMT=acc_fmt, **(dict(FMAX=FMAX[acc_fmt]) if kernel == "_cast_kernel" else {}))
    return _case(f"triton_grad_accumulate.{kernel}", types, constexprs)


# -- fp8.kernels.triton_block_gemm -------------------------------------------------------------------------------------
def _block_mm(a, b, out, b_cols, inverse, ones=()):
    strides = "stride_am stride_ak stride_bk stride_bn stride_sam stride_sak stride_sbk stride_sbn".split()
    return _case("triton_block_gemm._kernel()",
                 dict(a_ptr=a, b_ptr=b, sa_ptr=P32, sb_ptr=P32, out_ptr=out, M=I, N=I, K=I,
                      **dict.fromkeys(strides, I)),
                 dict(B_COLS=b_cols, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, INVERSE=inverse), ones=ones)


# -- fp8.kernels.triton_multi_tensor and triton_adam: the optimizer step's multi-tensor kernels -----------------------
BLOCKS = dict(blocks_ptr=PI32, table_ptr=P64)
"""The elementwise multi-tensor kernels' first arguments: the int32 (row, block) table, the int64 tensor table."""


def _multi(kernel, **types_and_flags):
    """An elementwise multi-tensor kernel: its arguments' types, and its flags (upper-case names)."""
    types = {k: v for k, v in types_and_flags.items() if not k.isupper()}
    flags = {k: v for k, v in types_and_flags.items() if k.isupper()}
    return _case(f"triton_multi_tensor.{kernel}", {**BLOCKS, **types}, dict(flags, BLOCK_SIZE=1024))


def _stage(kernel, **flags):
    """An update pass (Adam's in triton_adam, SGD's in triton_multi_tensor) with the launchers' arguments: the state
    table's blocks, the gradients' table, the fp32 old scales, bias corrections (SGD: step counts) and amaxes or fmaxes
    and new scales, the int32 skip flag, fp32 hyperparameters; stage 2's ``steps_ptr`` (fp32; None when it rounds to
    nearest) and ``row0``."""
    module, name = kernel.split(".")
    adam = module == "triton_adam"
    stage1 = "stage1" in name
    types = dict(BLOCKS, grads_ptr=P64, old_ptr=P32, bc_ptr=P32, bad_ptr=PI32, lr=F, weight_decay=F)
    types.update(dict(omb1=F, beta2=F, omb2=F, eps=F, decay_factor=F) if adam else dict(momentum=F, omd=F))
    if stage1:
        types.update(amax_ptr=P32)
    elif "delayed_kernel" in name:
        types.update(fmax_ptr=P32, delayed_ptr=P32, amax_ptr=P32)
    elif "fixup" in name:
        types.update(fmax_ptr=P32, final_ptr=P32, redo_ptr=PI32, hist_ptr=P32)
    else:
        types.update(fmax_ptr=P32, new_ptr=P32, row0=I)
        if flags["STOCHASTIC"]:
            types.update(steps_ptr=P32)
        else:
            flags.update(steps_ptr=None)
    return _case(kernel, types, dict(flags, **{"BLOCK" if adam else "BLOCK_SIZE": 1024}))


def _prepare_states(has_agreed, bias_correction):
    return _case("triton_multi_tensor.prepare_states_kernel",
                 dict(table_ptr=P64, gscale_ptr=P64, hyper_ptr="*fp64", agreed_ptr=PU8 if has_agreed else PI32,
                      old_ptr=P32, bc_ptr=P32, amax_ptr=P32, bad_ptr=PI32, n_rows=I),
                 dict(HAS_AGREED=has_agreed, BIAS_CORRECTION=bias_correction, ROWS_PER_PROGRAM=128))


def _state_scales(w_fmt):
    return _case("triton_multi_tensor.state_scales_kernel",
                 dict(table_ptr=P64, fmax_ptr=P32, amax_ptr=P32, old_ptr=P32, new_ptr=P32, n_rows=I),
                 dict(W_FMT=w_fmt, ROWS_PER_PROGRAM=128))


ADAMW = dict(MAXIMIZE=False, DECOUPLED=True, HAS_DECAY=True)
ADAM_L2 = dict(MAXIMIZE=True, DECOUPLED=False, HAS_DECAY=True)
NESTEROV = dict(MAXIMIZE=False, HAS_DECAY=True, MOMENTUM=True, NESTEROV=True)
PLAIN_SGD = dict(MAXIMIZE=True, HAS_DECAY=False, MOMENTUM=False, NESTEROV=False)

_CASES = {
    "cast_transpose_amax bf16 -> e4m3, transposed": _cast_transpose_amax(1, 3, True, ones=("stride_n",)),
    "cast_transpose_amax fp32 -> e5m2": _cast_transpose_amax(0, 4, False),
    "cast_transpose_amax fp16 -> e4m3, transposed": _cast_transpose_amax(2, 3, True),
    "amax_unless bf16": _amax_unless(1),
    "amax_unless fp32": _amax_unless(0),
    "amax bf16": _amax(1, False, False, ones=("stride_n",)),
    "amax fp32": _amax(0, False, False),
    "amax fp16": _amax(2, False, False),
    "amax e4m3 by row and column scales": _amax(3, True, True),
    "amax e5m2 by row scales": _amax(4, True, False),
    "cast_transpose delayed bf16 -> e4m3, transposed, recorded": _cast_t(1, 3, False, True, True, False,
                                                                         ones=("stride_n",)),
    "cast_transpose delayed fp32 -> e5m2": _cast_t(0, 4, False, False, False, False),
    "cast_transpose from amax fp16 -> e4m3, transposed into columns, recorded": _cast_t(2, 3, True, True, True, True),
    "cast_transpose from amax bf16 -> e5m2, transposed, margin 1": _cast_t(1, 4, True, True, False, False, margin=1),
    "quantize_rows bf16 -> e4m3": _rows_or_cols("_rows_kernel", 1, 3, False, True, ones=("stride_n",)),
    "quantize_rows fp16 -> e5m2": _rows_or_cols("_rows_kernel", 2, 4, False, True),
    "quantize_rows fp32 -> e4m3": _rows_or_cols("_rows_kernel", 0, 3, False, True),
    "quantize_rows e4m3 by row scales": _rows_or_cols("_rows_kernel", 3, 3, True, True),
    "quantize_rows e5m2 by column scales": _rows_or_cols("_rows_kernel", 4, 3, True, False),
    "quantize_cols_t bf16 -> e4m3": _rows_or_cols("_cols_t_kernel", 1, 3, False, True, ones=("stride_n",)),
    "quantize_cols_t fp16 -> e5m2": _rows_or_cols("_cols_t_kernel", 2, 4, False, True),
    "quantize_cols_t fp32 -> e4m3": _rows_or_cols("_cols_t_kernel", 0, 3, False, True),
    "quantize_cols_t e4m3 by row scales": _rows_or_cols("_cols_t_kernel", 3, 3, True, True),
    "quantize_cols_t e5m2 by column scales": _rows_or_cols("_cols_t_kernel", 4, 3, True, False),
    "quantize_tiles bf16 -> e4m3": _tiles(1, 3, False, False, 128, False, False, ones=("stride_n",)),
    "quantize_tiles fp32 -> e4m3, columnwise": _tiles(0, 3, True, False, 128, False, False),
    "quantize_tiles e4m3 by tile scales, columnwise transposed": _tiles(3, 3, True, True, 128, True, False),
    "quantize_mx bf16 -> e4m3, columnwise": _tiles(1, 3, True, False, 32, True, True, ones=("stride_n",)),
    "quantize_mx fp16 -> e5m2": _tiles(2, 4, False, False, 32, True, True),
    "transpose_fp8": _case("triton_quantize._transpose_kernel",
                           dict(src_ptr=PU8, scale_ptr=P32, dst_ptr=PU8, inv_ptr=P32, M=I, N=I, stride_m=I,
                                stride_n=I, width=I), dict(BLOCK=64), ones=("stride_n",)),
    "scaled_fp16 bf16": _elementwise(1, 2, False, False, True, ones=("stride_n",)),
    "scaled_fp16 e4m3 by row and column scales": _elementwise(3, 2, True, True, True),
    "apply_scales e4m3 by row and column scales -> bf16": _elementwise(3, 1, True, True, False),
    "apply_scales e5m2 by row scales -> fp32": _elementwise(4, 0, True, False, False),
    "update_scales_": _update_scales(False, 16),
    "update_scales_ unless disabled": _update_scales(True, 1024),
    "transpose_fp8_into_": _case("triton_quantize._transpose_multi_kernel", dict(table_ptr=P64), dict(BLOCK=64)),
    "sum_chunks e4m3 x 8 -> bf16": _sum_chunks(8, 3, 1),
    "sum_chunks e5m2 x 2 -> fp32": _sum_chunks(2, 4, 0),
    "sum_chunks e4m3 x 4 -> fp16": _sum_chunks(4, 3, 2),
    "mx_scales": _case("triton_quantize._mx_scales_kernel",
                       dict(grid_ptr=P32, out_ptr=PU8, rows=I, kb=I, stride_r=I, stride_k=I, repeat=I, k_tiles=I,
                            total=I), dict(BLOCK=1024), ones=("stride_k", "repeat")),
    "segment_amax fp32": _segment("_segment_amax_kernel", 0, ones=("N_SEG",)),
    "segment_amax bf16": _segment("_segment_amax_kernel", 1),
    "segment_cast fp32 -> e4m3": _segment("_segment_cast_kernel", 0, 3, ones=("N_SEG",)),
    "segment_cast bf16 -> e4m3": _segment("_segment_cast_kernel", 1, 3),
    "segment_sum e4m3": _segment("_segment_sum_kernel", 3),
    "row_chunk_sum e4m3": _segment("_row_chunk_sum_kernel", 3),
    "nvfp4_amax bf16": _nvfp4_amax(1, -1, False, ones=("stride_k",)),
    "nvfp4_amax fp32, Hadamard": _nvfp4_amax(0, 0x5A3C, False),
    "nvfp4_amax e4m3 by block scales, Hadamard": _nvfp4_amax(3, 0x5A3C, True),
    "nvfp4_quantize bf16 1x16 blocks": _nvfp4(1, 1, -1, False, False, ones=("stride_k",)),
    "nvfp4_quantize fp32 16x16 blocks": _nvfp4(0, 16, -1, False, False),
    "nvfp4_quantize fp16, Hadamard, stochastic": _nvfp4(2, 1, 0x5A3C, False, True),
    "nvfp4_quantize e4m3 by block scales, Hadamard": _nvfp4(3, 1, 0x5A3C, True, False),
    "accumulate amax e4m3 += bf16": _accumulate("_amax_kernel", 3, 1),
    "accumulate amax e5m2 += e5m2": _accumulate("_amax_kernel", 4, 4),
    "accumulate amax e4m3 += fp32": _accumulate("_amax_kernel", 3, 0),
    "accumulate cast e4m3 += bf16": _accumulate("_cast_kernel", 3, 1),
    "accumulate cast e5m2 += e5m2": _accumulate("_cast_kernel", 4, 4),
    "accumulate cast e4m3 += fp16": _accumulate("_cast_kernel", 3, 2),
    "accumulate fp16 amax += bf16": _accumulate("_fp16_amax_kernel", 2, 1),
    "accumulate fp16 amax += fp32": _accumulate("_fp16_amax_kernel", 2, 0),
    "accumulate fp16 write += bf16": _accumulate("_fp16_write_kernel", 2, 1),
    "accumulate fp16 write += fp16": _accumulate("_fp16_write_kernel", 2, 2),
    "block_mm e4m3 x e4m3 by 128x128 blocks -> bf16, scale_inv": _block_mm(
        "*fp8e4nv", "*fp8e4nv", "*bf16", 128, True, ones=("stride_ak", "stride_bn", "stride_sak")),
    "block_mm e5m2 x e4m3 by 128x1 tiles -> fp32": _block_mm("*fp8e5", "*fp8e4nv", P32, 1, False),
    "block_mm e4m3 x e5m2 by 128x128 blocks -> fp16": _block_mm("*fp8e4nv", "*fp8e5", "*fp16", 128, False),
    "mark_nonfinite": _multi("nonfinite_kernel", flag_ptr=PI32),
    "multi-tensor amax": _multi("amax_kernel", out_ptr=PI32),
    "multi-tensor quantize": _multi("quantize_kernel", amax_ptr=P32, fmax_ptr=P32),
    "multi-tensor dequantize": _multi("dequantize_kernel"),
    "multi-tensor copy": _multi("copy_kernel", ok_ptr=PU8, UNLESS_OK=False),
    "multi-tensor copy unless ok": _multi("copy_kernel", ok_ptr=PU8, UNLESS_OK=True),
    "sq_sums": _multi("sq_sum_kernel", out_ptr="i64", INF_NORM=False),
    "sq_sums inf norm": _multi("sq_sum_kernel", out_ptr="i64", INF_NORM=True),
    "block_quantize 128x128 blocks": _case("triton_multi_tensor.block_quantize_kernel",
                                           dict(table_ptr=P64, bad_ptr=PI32), dict(ROWS_PER_TILE=16, CHUNK=128)),
    "block_quantize rows": _case("triton_multi_tensor.block_quantize_kernel", dict(table_ptr=P64, bad_ptr=PI32),
                                 dict(ROWS_PER_TILE=1, CHUNK=128)),
    "prepare_states Adam, agreed": _prepare_states(True, True),
    "prepare_states SGD": _prepare_states(False, False),
    "state_scales fp32 masters": _state_scales(0),
    "state_scales bf16 masters": _state_scales(1),
    "state_scales fp16 masters": _state_scales(2),
    "state_scales e4m3 masters": _state_scales(3),
    "sgd stage 1, Nesterov": _stage("triton_multi_tensor.sgd_stage1_kernel", **NESTEROV),
    "sgd stage 1, no momentum": _stage("triton_multi_tensor.sgd_stage1_kernel", **PLAIN_SGD),
    "sgd stage 2, Nesterov, round to nearest": _stage("triton_multi_tensor.sgd_stage2_kernel", **NESTEROV,
                                                      STOCHASTIC=False),
    "sgd stage 2, Nesterov, stochastic": _stage("triton_multi_tensor.sgd_stage2_kernel", **NESTEROV, STOCHASTIC=True),
    "sgd stage 2, no momentum": _stage("triton_multi_tensor.sgd_stage2_kernel", **PLAIN_SGD, STOCHASTIC=False),
    "adam stage 1, AdamW": _stage("triton_adam.adam_stage1_kernel", **ADAMW),
    "adam stage 1, L2 decay, maximize": _stage("triton_adam.adam_stage1_kernel", **ADAM_L2),
    "adam stage 2, round to nearest": _stage("triton_adam.adam_stage2_kernel", **ADAMW, STOCHASTIC=False),
    "adam stage 2, stochastic": _stage("triton_adam.adam_stage2_kernel", **ADAM_L2, STOCHASTIC=True),
    "adam delayed": _stage("triton_adam.adam_delayed_kernel", **ADAMW),
    "adam delayed fix-up": _stage("triton_adam.adam_delayed_fixup_kernel", **ADAMW),
}
CASES = list(_CASES)


def _kernel(path: str):
    module, name = path.split(".")
    kernel = getattr(importlib.import_module(f"fp8.kernels.{module}"), name.removesuffix("()"))
    return kernel() if name.endswith("()") else kernel


def _compile(path: str, types: dict, constexprs: dict, num_warps: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = _kernel(path)
    params = list(inspect.signature(kernel.fn).parameters)
    missing = [p for p in params if p not in types and p not in constexprs]
    unknown = [p for p in (*types, *constexprs) if p not in params]
    assert not missing and not unknown, f"give a type or a constant for {missing}; {unknown} are no parameters"
    signature = {p: "constexpr" if p in constexprs else types[p] for p in params}
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=GPUTarget(*H100),
                          options=dict(num_warps=num_warps))


def _compile_all() -> dict:
    """Every case compiled in this process: ``{case: None or the error}`` (run in a child process without
    ``TRITON_INTERPRET``, under which ``@triton.jit`` makes interpreted functions that do not compile)."""
    results = {}
    for case in CASES:
        try:
            compiled = _compile(*_CASES[case])
            results[case] = None if compiled.asm.get("cubin") else "no cubin"
        except Exception as error:  # noqa: BLE001 - reported by the test of that case
            results[case] = f"{type(error).__name__}: {error}"[-3000:]
    return results


@pytest.fixture(scope="module")
def compiled():
    pytest.importorskip("triton")
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json, sys; sys.path.insert(0, '.'); from tests.fp8.test_triton_compile import _compile_all; "
            "print('RESULTS' + json.dumps(_compile_all()))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULTS"):])


@pytest.mark.parametrize("case", CASES)
def test_the_kernel_compiles_for_an_h100(compiled, case):
    assert compiled[case] is None, compiled[case]  # through ptxas: machine code for sm_90
