"""y = x @ dequant(W)^T with MXFP4 weights dequantised in registers (LatentMoE expert GEMMs; docs/k3-model.md, "MXFP4").

MXFP4 (OCP Microscaling v1.0): FP4 E2M1 elements, one E8M0 scale per 32 values along the input dim. Storage as in K3 /
compressed-tensors "mxfp4-pack-quantized" (`weight_packed`, `weight_scale` of dspark.models.k3.mxfp4.MXFP4Linear):
packed uint8 [N, K/2] (low nibble = even k, high nibble = odd k, nibble bit 3 = sign), scale uint8 E8M0 [N, K/32]
(w = e2m1(code) * 2^(s-127)); grouped: packed [E, N, K/2], scale [E, N, K/32], x [M, K] sorted by expert with
offsets [E+1] (rows offsets[e]:offsets[e+1] use expert e). x bf16/fp16/fp32, fp32 accumulate, y [M, N] in x's dtype.
Quantisation (OCP): shared_exp = floor(log2(amax_block)) - 2, P_i = RNE_saturate(x_i / 2^shared_exp) to +-6.
K3 expert shapes: w1/w3 N x K = 3072 x 3584, w2 3584 x 3072.
Kernel ("swap AB" for decode): a program owns BN weight rows x BM tokens; per BK step it loads BN x BK/2 packed bytes
and BN x BK/32 scales, builds the fp32 E2M1 values from the nibble bits (the 16-entry LUT
[0, .5, 1, 1.5, 2, 3, 4, 6, -0, ..., -6] as bit arithmetic: sign = bit 3, exp = bits 1-2, mantissa = bit 0),
multiplies by 2^(s-127) (built as the fp32 bit pattern s << 23; s = 0, i.e. 2^-127, flushes to 0), casts to x's
dtype (exact: e2m1 * 2^k is a bf16 value) and accumulates dot(W_tile, x_tile^T) into fp32 [BN, BM].
fp32 x (and every dtype under TRITON_INTERPRET=1, whose tl.dot mis-handles bf16 operands in triton 3.9) takes an
fp32 "ieee" dot; bf16/fp16 x a tensor-core dot. Grouped: offsets[0] = 0 and offsets[E] = M (rows outside: undefined).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark.kernels import interpreting, next_pow2, tl, triton, use_triton

# ---------------------------------------------------------------------------------------------------------------
# the format and its codec (pure torch): what the kernel decodes in registers, and what MXFP4Linear stores
# ---------------------------------------------------------------------------------------------------------------
BLOCK = 32
E2M1_EMAX = 2
# code -> value; codes 0..7 positive magnitudes, 8..15 the same negated
FP4_E2M1_LUT = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                             -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """x fp32 (already divided by the block scale) -> uint8 codes 0..15, round-to-nearest-even, saturating at 6."""
    grid = FP4_E2M1_LUT[:8].to(x.device)  # [8]
    mag = x.abs().clamp(max=6.0)
    dist = (mag[..., None] - grid).abs()  # [..., 8]
    is_min = dist == dist.min(-1, keepdim=True).values
    even = (torch.arange(8, device=x.device) % 2 == 0)
    # ties go to the even code (mantissa bit 0): rank 0 = even nearest, 1 = odd nearest, 2 = not nearest
    rank = torch.where(is_min & even, 0, torch.where(is_min, 1, 2))
    code = rank.argmin(-1).to(torch.uint8)
    sign = ((x < 0) & (code > 0)).to(torch.uint8) << 3  # no -0 codes
    return code | sign


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] (in % 32 == 0) -> (packed uint8 [out, in/2], scale uint8 [out, in/32])."""
    out_f, in_f = w.shape
    if in_f % BLOCK:
        raise ValueError(f"quantize_mxfp4: input dim {in_f} is not a multiple of {BLOCK}")
    blocks = w.detach().float().reshape(out_f, in_f // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1)  # [out, G]
    shared_exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - E2M1_EMAX, torch.full_like(amax, -127.0))
    shared_exp = shared_exp.clamp(-127, 127)
    codes = round_to_e2m1(blocks / torch.exp2(shared_exp)[..., None]).reshape(out_f, in_f)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale = (shared_exp + 127).to(torch.uint8)
    return packed.contiguous(), scale.contiguous()


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """(packed uint8 [out, in/2], scale uint8 [out, in/32]) -> w [out, in] in dtype."""
    lut = FP4_E2M1_LUT.to(packed.device)
    out_f, half = packed.shape
    vals = torch.empty(out_f, half * 2, device=packed.device)
    vals[:, 0::2] = lut[(packed & 0x0F).long()]
    vals[:, 1::2] = lut[(packed >> 4).long()]
    exp = scale.long() - 127  # [out, G]
    vals = torch.ldexp(vals.view(out_f, -1, BLOCK), exp[..., None].float()).reshape(out_f, half * 2)
    return vals.to(dtype)


def mxfp4_matmul_ref(x, packed, scale):
    """x [M, K] @ dequant(packed [N, K/2], scale [N, K/32])^T -> [M, N] (MXFP4Linear.forward's math)."""
    return F.linear(x, dequantize_mxfp4(packed, scale, x.dtype))


def mxfp4_grouped_matmul_ref(x, packed, scale, offsets):
    """x [M, K] sorted by expert, packed [E, N, K/2], scale [E, N, K/32], offsets [E+1] -> [M, N]."""
    y = x.new_zeros(x.shape[0], packed.shape[1])
    offs = offsets.tolist()
    for e in range(packed.shape[0]):
        if offs[e + 1] > offs[e]:
            y[offs[e]:offs[e + 1]] = mxfp4_matmul_ref(x[offs[e]:offs[e + 1]], packed[e], scale[e])
    return y


@triton.jit
def _mxfp4_matmul_kernel(x_ptr, wp_ptr, ws_ptr, y_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr,
                         M, N, K, stride_xm, stride_ym,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUPED: tl.constexpr,
                         FP32: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GROUPED:  # tile -> (expert, row range); empty tiles get r1 == r0 and skip the K loop
        e = tl.load(tile_e_ptr + pid_m).to(tl.int64)
        r0 = tl.load(tile_r0_ptr + pid_m)
        r1 = tl.load(tile_r1_ptr + pid_m)
    else:
        e = 0
        r0 = pid_m * BM
        r1 = M
    k_end = tl.where(r1 > r0, K, 0)
    rm = r0 + tl.arange(0, BM)  # token rows
    rn = pid_n * BN + tl.arange(0, BN)  # weight rows (output columns)
    mm = rm < r1
    nm = rn < N
    K2 = K // 2
    KG = K // 32
    wp_base = wp_ptr + e * N * K2 + rn[:, None] * K2  # [BN, 1]
    ws_base = ws_ptr + e * N * KG + rn[:, None] * KG
    kh = tl.arange(0, BK // 2)
    kg = tl.arange(0, BK // 32)
    kx = tl.arange(0, BK)
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in range(0, k_end, BK):
        p = tl.load(wp_base + (k0 // 2 + kh)[None, :], mask=nm[:, None] & ((k0 // 2 + kh) < K2)[None, :], other=0)
        s = tl.load(ws_base + (k0 // 32 + kg)[None, :], mask=nm[:, None] & ((k0 // 32 + kg) < KG)[None, :], other=0)
        c = tl.join(p & 0xF, p >> 4).reshape(BN, BK).to(tl.int32)  # [BN, BK], even k = low nibble
        ex = (c >> 1) & 3
        mag = tl.where(ex == 0, (c & 1) * 0x3F000000, ((ex + 126) << 23) | ((c & 1) << 22))
        val = (((c & 8) << 28) | mag).to(tl.float32, bitcast=True)
        sc = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(s-127)
        w = (val.reshape(BN, BK // 32, 32) * sc[:, :, None]).reshape(BN, BK)
        xt = tl.load(x_ptr + rm[None, :] * stride_xm + (k0 + kx)[:, None],
                     mask=mm[None, :] & ((k0 + kx) < K)[:, None], other=0.0)  # [BK, BM]
        if FP32:
            acc += tl.dot(w, xt.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(w.to(xt.dtype), xt)
    tl.store(y_ptr + rm[None, :] * stride_ym + rn[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=mm[None, :] & nm[:, None])


def _blocks(M_rows: int, N: int, device: torch.device) -> tuple[int, int, int]:
    BM = min(64, max(16, next_pow2(M_rows)))
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    BN = 64 if triton.cdiv(N, 64) >= 2 * sms else 32 if triton.cdiv(N, 32) >= sms else 16
    return BM, BN, 128


def _launch(x, packed, scale, y, tiles, n_tiles, M, BM, BN, BK):
    N, K = packed.shape[-2], x.shape[1]
    te, r0, r1 = tiles if tiles is not None else (x, x, x)
    _mxfp4_matmul_kernel[(n_tiles, triton.cdiv(N, BN))](
        x, packed, scale, y, te, r0, r1, M, N, K, x.stride(0), y.stride(0),
        BM=BM, BN=BN, BK=BK, GROUPED=tiles is not None, FP32=x.dtype == torch.float32 or interpreting(), num_warps=4, num_stages=4)
    return y


@torch.compiler.disable  # a torch.compile'd caller launches the kernel as it is
def mxfp4_matmul_triton(x, packed, scale, block=None):
    M, K = x.shape
    if K % 32 or packed.shape[1] * 2 != K:
        raise ValueError(f"mxfp4_matmul: K={K} must be a multiple of 32 and match packed {tuple(packed.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    BM, BN, BK = block or _blocks(M, packed.shape[0], x.device)
    y = torch.empty(M, packed.shape[0], dtype=x.dtype, device=x.device)
    return _launch(x, packed.contiguous(), scale.contiguous(), y, None, triton.cdiv(M, BM), M, BM, BN, BK)


@torch.compiler.disable  # a torch.compile'd caller launches the kernel as it is
def mxfp4_grouped_matmul_triton(x, packed, scale, offsets, block=None):
    """Tile list built with torch ops only (no host sync): at most cdiv(M, BM) + min(E, M) tiles."""
    M, K = x.shape
    E, N = packed.shape[:2]
    x = x if x.stride(1) == 1 else x.contiguous()
    BM, BN, BK = block or _blocks(max(1, M // max(1, min(E, M))), N, x.device)
    offsets = offsets.to(device=x.device, dtype=torch.int64)
    counts = offsets[1:] - offsets[:-1]
    tiles = (counts + BM - 1) // BM
    tile_end = tiles.cumsum(0)
    n_ub = triton.cdiv(M, BM) + min(E, M)
    i = torch.arange(n_ub, device=x.device)
    e = torch.searchsorted(tile_end, i, right=True)
    valid = e < E
    ec = e.clamp(max=E - 1)
    r0 = offsets[ec] + (i - (tile_end[ec] - tiles[ec])) * BM
    r1 = torch.where(valid, offsets[ec + 1], r0)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    t = (ec.to(torch.int32), r0.to(torch.int32), r1.to(torch.int32))
    return _launch(x, packed.contiguous(), scale.contiguous(), y, t, n_ub, M, BM, BN, BK)


def mxfp4_matmul(x, packed, scale):
    """x [M, K] -> [M, N]; Triton on CUDA, else the reference."""
    return (mxfp4_matmul_triton if use_triton(x, packed) else mxfp4_matmul_ref)(x, packed, scale)


def mxfp4_grouped_matmul(x, packed, scale, offsets):
    """x [M, K] sorted by expert, offsets [E+1] -> [M, N]; Triton on CUDA, else the reference."""
    return (mxfp4_grouped_matmul_triton if use_triton(x, packed) else mxfp4_grouped_matmul_ref)(
        x, packed, scale, offsets)
