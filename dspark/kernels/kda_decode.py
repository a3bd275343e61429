"""Fused KDA decode / verify step: T (1..17) new tokens per request, two launches (docs/k3-model.md, "KDA").

Shapes: B requests, T new tokens, H heads, D = K = V head dim, P = H*D, W conv width.
  qkv    [B, T, 3P]  raw q|k|v projections (pre-conv)          f     [B, T, P]  f_b_proj output (gate pre-activation)
  beta   [B, T, H]   beta logits                               gate  [B, T, P]  output-gate projection
  conv_w [3P, W]     depthwise causal conv weights (q|k|v)      window [B, W-1, 3P] previous raw inputs
  A_log [H], dt_bias [P], o_norm_w [D], state [B, H, K, V] fp32, lengths [B] (optional: new tokens per row <= T)
Per token t of head h (fp32):
  c = SiLU(conv(window|qkv));  q = l2norm(c_q) * D^-0.5;  k = l2norm(c_k);  v = c_v      (l2norm eps 1e-6)
  g = -exp(A_log) softplus(f + dt_bias)   or   lb * sigmoid(exp(A_log) (f + dt_bias))     (log decay, [K])
  S = S * exp(g)[:, None];  u = v - S^T k;  S = S + sigmoid(beta) k u^T;  o = S^T q
  out = RMSNorm_D(o; o_norm_w, eps) * sigmoid(gate)
Outputs: out [B, T, P] (qkv dtype), state_final [B, H, K, V] fp32 or all states [B, T, H, K, V] fp32, and
ext = cat(window, qkv) [B, W-1+T, 3P] (the extended conv window; the caller keeps its last W-1 valid rows).
Rows t >= lengths[b] are padding exactly as in the layer: raw input zeroed, g = beta = 0 (state untouched).
kda_decode_slots reads state and window in place from a cache's pools (row slots[b]) and, without all states,
writes the final state and the kept window back there: no gather or scatter launches around the step.
Kernels: one program per (request, head, slice of BV value columns) holds S[:, slice] [K, BV] in registers for all
T (the delta rule is column-wise in V); what does not depend on S is computed for all T tokens before the serial
loop (see _kda_decode_kernel). A second launch applies the gated per-head RMSNorm (it needs all columns).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from dspark.kernels import AUTOTUNE_CACHE, HAS_TRITON, interpreting, next_pow2, tl, triton, use_triton
from dspark.kernels.rms_norm import rms_norm


# ---------------------------------------------------------------------------------------------------------------
# the definitions (pure torch): the K3 KDA layer (dspark/models/k3/kda.py) is built from them, and kda_decode_ref,
# the kernel's reference, is that layer's cached step written with them
# ---------------------------------------------------------------------------------------------------------------
def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """Log-space per-channel decay. f: [B, T, H, D] raw f_b_proj output; A_log [H]; dt_bias [H*D] -> g [B,T,H,D] fp32.
    softplus form: g = -exp(A_log) * softplus(f + dt_bias);  safe gate: g = lb * sigmoid(exp(A_log) * (f + dt_bias))."""
    H, D = f.shape[-2:]
    z = f.float() + dt_bias.float().view(H, D)
    a = A_log.float().exp().view(H, 1)
    if lower_bound is None:
        return -a * F.softplus(z)  # threshold 20 as torch's default
    return lower_bound * torch.sigmoid(a * z)


def causal_conv_silu(window: torch.Tensor, raw: torch.Tensor, weight: torch.Tensor):
    """SiLU of the depthwise causal conv. window [B, W-1, C] previous raw inputs, raw [B, T, C], weight [C, W]
    -> (out [B, T, C], ext = cat(window, raw) [B, W-1+T, C])."""
    ext = torch.cat([window.to(raw.dtype), raw], 1)
    out = F.conv1d(ext.transpose(1, 2), weight.to(raw.dtype).unsqueeze(1), groups=weight.shape[0])  # [B, C, T]
    return F.silu(out.transpose(1, 2)), ext


def kept_conv_window(conv_ext: torch.Tensor, n_keep: torch.Tensor, W1: int) -> torch.Tensor:
    """The conv window after keeping n_keep [B] new tokens: rows n_keep .. n_keep+W1-1 of the extended window
    conv_ext [B, W1+T, C] (the old window, then the new raw inputs) -> [B, W1, C]."""
    n = n_keep.to(conv_ext.device)
    cols = n[:, None] + torch.arange(W1, device=n.device)  # [B, W1]
    return conv_ext.gather(1, cols[..., None].expand(-1, -1, conv_ext.shape[-1]))


def kda_recurrent(q, k, v, g, beta, initial_state=None, return_all_states: bool = False, scale: float | None = None):
    """The delta rule token by token (the definition). q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]
    (post-sigmoid); initial_state [B, H, K, V] or None.
    -> (o [B, T, H, V] in v.dtype, S_final [B, H, K, V] fp32, or all states [B, T, H, K, V] if return_all_states)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float().clone()
    outs, states = [], []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]  # decay along K
        u = v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t])  # prediction error on the decayed state
        S = S + beta[:, t, :, None, None] * k[:, t, :, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t] * scale))
        if return_all_states:
            states.append(S)
    o = torch.stack(outs, 1) if T else v.new_zeros(B, 0, H, V).float()
    if return_all_states:
        return o, (torch.stack(states, 1) if T else S.new_zeros(B, 0, H, K, V))
    return o, S


def kda_decode_ref(qkv, f, beta, gate, conv_w, window, A_log, dt_bias, o_norm_w, state=None, lower_bound=None,
                   eps=1e-5, return_all_states=False, lengths=None):
    B, T, P3 = qkv.shape
    P = P3 // 3
    D = o_norm_w.shape[0]
    H = P // D
    if lengths is not None:  # as KimiDeltaAttention.forward with batch.valid(T)
        valid = torch.arange(T, device=qkv.device)[None] < lengths.to(qkv.device)[:, None]  # [B, T]
        qkv = qkv * valid[..., None].to(qkv.dtype)
    c, ext = causal_conv_silu(window, qkv, conv_w)
    q, k, v = (t.reshape(B, T, H, D) for t in c.chunk(3, -1))
    q, k = l2norm(q.float()), l2norm(k.float())
    g = kda_gate(f.reshape(B, T, H, D), A_log, dt_bias, lower_bound)
    b = torch.sigmoid(beta.float())
    if lengths is not None:
        g, b = g * valid[..., None, None], b * valid[..., None]
    o, S = kda_recurrent(q, k, v, g, b, state, return_all_states=return_all_states)
    out = rms_norm(o.to(qkv.dtype), o_norm_w, eps) * torch.sigmoid(gate.reshape(B, T, H, D))
    return out.reshape(B, T, P).to(qkv.dtype), S, ext


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels: the delta rule on grid (B, H, D/BV), then the gated norm on grid (B*T, H)
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _raw_tile(qkv_ptr, win_ptr, b, wb, pos, ch, dm, T, n_valid, P3, SQ, W: tl.constexpr):
    """ext[b, pos, ch] as fp32 [len(pos), len(ch)]: the conv window (its row wb) for pos < W-1, else the (valid) new
    token pos-W+1 (zero past the valid length or past T). SQ: qkv's row stride."""
    tok = pos - (W - 1)
    m = dm[None, :]
    xw = tl.load(win_ptr + (wb * (W - 1) + pos[:, None]) * P3 + ch[None, :], mask=m & (pos < W - 1)[:, None],
                 other=0.0)
    xr = tl.load(qkv_ptr + (b * T + tok[:, None]) * SQ + ch[None, :],
                 mask=m & ((tok >= 0) & (tok < n_valid) & (tok < T))[:, None], other=0.0)
    return xw.to(tl.float32) + xr.to(tl.float32)


@triton.jit
def _conv_silu(qkv_ptr, win_ptr, convw_ptr, b, wb, tt, ch, dm, T, n_valid, P3, SQ, W: tl.constexpr,
               BT: tl.constexpr, BD: tl.constexpr):
    """SiLU(causal depthwise conv) of channels ch for tokens tt: sum_w ext[t + w] * conv_w[ch, w] -> [BT, BD]."""
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for w in tl.static_range(W):
        acc += _raw_tile(qkv_ptr, win_ptr, b, wb, tt + w, ch, dm, T, n_valid, P3, SQ, W) * tl.load(
            convw_ptr + ch * W + w, mask=dm, other=0.0).to(tl.float32)[None, :]
    return acc * tl.sigmoid(acc)


@triton.jit
def _kda_tiles(qkv_ptr, f_ptr, beta_ptr, convw_ptr, win_ptr, alog_ptr, dtb_ptr, ext_ptr, len_ptr,
               b, wb, h, j, T, H, P, SQ, SF, SB, lower_bound, scale,
               D: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr,
               W: tl.constexpr, USE_LB: tl.constexpr, HAS_LEN: tl.constexpr):
    """What does not depend on the state, for all T tokens of program (b, h, j) (value columns j*BV..): the extended
    conv window (the window's row wb) written by j == 0; Q, K [BT, BD] (conv + SiLU + L2 norm, q scaled), V [BT, BV]
    (conv + SiLU), the log decay G [BT, BD] and sigmoid(beta) [BT], both 0 on padding rows (t >= the row's valid
    length), which then leave the state untouched."""
    P3 = 3 * P
    offs = tl.arange(0, BD)
    dm = offs < D
    vo = j * BV + tl.arange(0, BV)
    vm = vo < D
    n_valid = T
    if HAS_LEN:
        n_valid = tl.load(len_ptr + b)
    cq = h * D + offs  # channel ids of this head in q | k | v
    tt = tl.arange(0, BT)
    if j == 0:  # extended window ext[b, pos] = window[b, pos] (pos < W-1) else qkv[b, pos-W+1] (zeroed past length)
        pe = tl.arange(0, BE)
        for part in tl.static_range(3):
            x = _raw_tile(qkv_ptr, win_ptr, b, wb, pe, cq + part * P, dm, T, n_valid, P3, SQ, W)
            tl.store(ext_ptr + (b * (T + W - 1) + pe[:, None]) * P3 + (cq + part * P)[None, :],
                     x.to(ext_ptr.dtype.element_ty), mask=(pe[:, None] < T + W - 1) & dm[None, :])
    Q = _conv_silu(qkv_ptr, win_ptr, convw_ptr, b, wb, tt, cq, dm, T, n_valid, P3, SQ, W, BT, BD)  # [BT, BD]
    K = _conv_silu(qkv_ptr, win_ptr, convw_ptr, b, wb, tt, P + cq, dm, T, n_valid, P3, SQ, W, BT, BD)
    V = _conv_silu(qkv_ptr, win_ptr, convw_ptr, b, wb, tt, 2 * P + h * D + vo, vm, T, n_valid, P3, SQ, W, BT, BV)
    Q = Q * (1.0 / tl.sqrt(tl.sum(Q * Q, 1) + 1e-6))[:, None] * scale
    K = K * (1.0 / tl.sqrt(tl.sum(K * K, 1) + 1e-6))[:, None]
    tm = (tt[:, None] < T) & dm[None, :]
    a = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dtb = tl.load(dtb_ptr + cq, mask=dm, other=0.0).to(tl.float32)
    z = tl.load(f_ptr + (b * T + tt[:, None]) * SF + cq[None, :], mask=tm, other=0.0).to(tl.float32) + dtb[None, :]
    if USE_LB:
        g = lower_bound * tl.sigmoid(a * z)
    else:
        g = -a * tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))
    live = tt < n_valid
    G = tl.where(live[:, None], g, 0.0)
    beta = tl.sigmoid(tl.load(beta_ptr + (b * T + tt) * SB + h, mask=tt < T, other=0.0).to(tl.float32))
    return Q, K, V, G, tl.where(live, beta, 0.0)


@triton.jit
def _state_slice(s_in_ptr, b, h, j, H, D: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, HAS_STATE: tl.constexpr):
    """Program (b, h, j)'s value columns j*BV.. of head h's state [K, V] (fp32; zeros without a state) -> (S [BD, BV],
    its offsets in a [D, D] state, its mask)."""
    offs = tl.arange(0, BD)
    vo = j * BV + tl.arange(0, BV)
    smask = (offs[:, None] < D) & (vo < D)[None, :]
    sidx = offs[:, None] * D + vo[None, :]
    if HAS_STATE:
        S = tl.load(s_in_ptr + (b * H + h) * D * D + sidx, mask=smask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BD, BV], dtype=tl.float32)
    return S, sidx, smask


@triton.jit
def _kda_decode_kernel(qkv_ptr, f_ptr, beta_ptr, convw_ptr, win_ptr, alog_ptr, dtb_ptr,
                       s_in_ptr, s_out_ptr, o_ptr, ext_ptr, len_ptr, slot_ptr,
                       T, H, P, NH, SQ, SF, SB, lower_bound, scale,
                       D: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr,
                       W: tl.constexpr, USE_LB: tl.constexpr, HAS_STATE: tl.constexpr, ALL_STATES: tl.constexpr,
                       HAS_LEN: tl.constexpr, SLOTS: tl.constexpr, MERGED: tl.constexpr):
    """Program (b, h, j) owns the value columns j*BV .. j*BV+BV-1 of S [K, V]: the delta rule is independent per
    value column (u = v - S^T k and o = S^T q are column-wise), so D/BV programs per head share the serial work.
    Everything that does not depend on the state is computed for all T tokens at once ([BT, BD] tiles, every load
    issued up front): conv + SiLU + L2 norm of q and k (full head dim, each program recomputes them), v and the
    gate, beta. The serial loop over tokens is then only the delta rule on the [K, BV] slice (row t of each tile
    picked by a masked sum). Writes the raw outputs o [B, T, P] fp32; _kda_out_norm_kernel applies the gated
    per-head RMSNorm, which needs all of a head's columns. NH = B*H is only the autotuning key (the grid size).
    SQ, SF, SB: the row strides of qkv, f and beta (row b*T + t; column slices of one wider projection).
    MERGED: both reductions over K of a token read the decayed state (o = S^T q + beta (k . q) u), so they are
    independent; else o is reduced from the updated state, a second reduction on the serial path (kda_config's pick).
    SLOTS: state and window are pools read at row slots[b]; the final state (without ALL_STATES) goes back to that
    row, which only this program reads (padding rows share the scratch slot and leave it as it was)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.program_id(2)
    sb = b
    if SLOTS:
        sb = tl.load(slot_ptr + b).to(tl.int32)
    Q, K, V, G, beta = _kda_tiles(qkv_ptr, f_ptr, beta_ptr, convw_ptr, win_ptr, alog_ptr, dtb_ptr, ext_ptr, len_ptr,
                                  b, sb, h, j, T, H, P, SQ, SF, SB, lower_bound, scale, D, BD, BV, BT, BE, W, USE_LB,
                                  HAS_LEN)
    decay = tl.exp(G)  # [BT, BD]
    S, sidx, smask = _state_slice(s_in_ptr, sb, h, j, H, D, BD, BV, HAS_STATE)  # [BD, BV]
    vo = j * BV + tl.arange(0, BV)  # this program's value columns
    vm = vo < D
    tt = tl.arange(0, BT)  # token index
    Ot = tl.zeros([BT, BV], dtype=tl.float32)
    KQ = tl.sum(K * Q, 1)  # [BT] k_t . q_t
    for t in range(0, T):  # the delta rule, token by token
        sel = tt[:, None] == t
        k = tl.sum(tl.where(sel, K, 0.0), 0)
        e = tl.sum(tl.where(sel, decay, 0.0), 0)
        bt = tl.sum(tl.where(tt == t, beta, 0.0), 0)
        S = S * e[:, None]
        q = tl.sum(tl.where(sel, Q, 0.0), 0)
        v = tl.sum(tl.where(sel, V, 0.0), 0)  # [BV]
        u = v - tl.sum(S * k[:, None], 0)  # [BV]
        if MERGED:  # o = (S + bt k u^T)^T q = S^T q + bt (k . q) u: this reduction is independent of u's
            o = tl.sum(S * q[:, None], 0) + bt * tl.sum(tl.where(tt == t, KQ, 0.0), 0) * u
            S = S + bt * k[:, None] * u[None, :]
        else:  # o after the update: a second reduction that waits for the first
            S = S + bt * k[:, None] * u[None, :]
            o = tl.sum(S * q[:, None], 0)
        Ot = tl.where(sel, o[None, :], Ot)
        if ALL_STATES:
            tl.store(s_out_ptr + ((b * T + t) * H + h) * D * D + sidx, S, mask=smask)
    if not ALL_STATES:
        tl.store(s_out_ptr + (sb * H + h) * D * D + sidx, S, mask=smask)
    tl.store(o_ptr + (b * T + tt[:, None]) * P + h * D + vo[None, :], Ot, mask=(tt[:, None] < T) & vm[None, :])


@triton.jit
def _store_kept_window(ext_ptr, win_ptr, b, slot, n, h, T, P, D: tl.constexpr, BD: tl.constexpr, W1: tl.constexpr):
    """Head h's channels of row b's conv window after keeping n new tokens (ext rows n .. n+W1-1 of ext [B, W1+T,
    3P]) into row slot of the window pool [N, W1, 3P] (kept_conv_window, written in place)."""
    offs = tl.arange(0, BD)
    dm = offs < D
    for part in tl.static_range(3):
        ch = part * P + h * D + offs
        for pos in tl.static_range(W1):
            x = tl.load(ext_ptr + (b * (T + W1) + n + pos) * 3 * P + ch, mask=dm, other=0.0)
            tl.store(win_ptr + (slot * W1 + pos) * 3 * P + ch, x.to(win_ptr.dtype.element_ty), mask=dm)


@triton.jit
def _kda_out_norm_kernel(o_ptr, gate_ptr, onw_ptr, out_ptr, ext_ptr, conv_ptr, slot_ptr, len_ptr, T, H, P, SG, eps,
                         D: tl.constexpr, BD: tl.constexpr, W: tl.constexpr, KEEP_WINDOW: tl.constexpr,
                         HAS_LEN: tl.constexpr):
    """out[n, h] = RMSNorm_D(o[n, h]) * o_norm_w * sigmoid(gate[n, h]); one program per (token row n, head h);
    SG: the row stride of gate. KEEP_WINDOW: program (b*T, h) also writes head h's channels of the kept conv window
    (ext rows n_valid .. n_valid+W-2) to row slots[b] of the window pool; after the delta rule's launch, which read
    the old window, has ended."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.arange(0, BD)
    dm = offs < D
    if KEEP_WINDOW:
        if n % T == 0:
            b = n // T
            n_valid = T
            if HAS_LEN:
                n_valid = tl.load(len_ptr + b)
            _store_kept_window(ext_ptr, conv_ptr, b, tl.load(slot_ptr + b).to(tl.int32), n_valid, h, T, P, D, BD,
                               W - 1)
    base = n * P + h * D + offs
    o = tl.load(o_ptr + base, mask=dm, other=0.0)
    og = tl.sigmoid(tl.load(gate_ptr + n * SG + h * D + offs, mask=dm, other=0.0).to(tl.float32))
    onw = tl.load(onw_ptr + offs, mask=dm, other=0.0).to(tl.float32)
    y = o * (1.0 / tl.sqrt(tl.sum(o * o, 0) / D + eps)) * onw * og
    tl.store(out_ptr + base, y.to(out_ptr.dtype.element_ty), mask=dm)


# (BV value columns per program, warps, MERGED). Small grids (bs=1: 6..96 heads) want narrow slices, so that the
# serial delta rule runs on many SMs (H200, T = 9 with all states, 6 heads: 28.9 us at BV 16 / 4 warps, against 87 us
# for one program per head); large grids want wide ones. kda_config picks one by a rule, so a server's first start on
# a machine compiles one config per specialisation and times none; with DSPARK_KDA_AUTOTUNE=1 Triton's autotuner
# picks among CONFIGS per (T, B*H, D, all states) instead, and bench/kda_configs.py scores the rule against its
# timings (H100: within 1.02x of the best at the median key, 1.14x at the 90th percentile).
# A chunk form of the verify (u and o by matmuls, then an element-wise state loop) was slower than this loop in the
# k3-mini DSpark step (41 against 28 us per launch) and was removed.
CONFIGS = ((8, 1, False), (8, 1, True), (8, 2, True), (16, 1, False), (16, 1, True), (32, 2, False), (32, 4, True),
           (64, 4, False))


def kda_config(T: int, NH: int, D: int) -> tuple[int, int, bool]:
    """(BV, warps, MERGED) for T new tokens per row over NH = B*H heads of dim D: narrow slices on one warp for small
    heads or short steps; for long verify blocks 8 columns on 2 warps over few heads (more programs), 32 over many;
    64 on 4 warps for wide single-token steps."""
    if D <= 32:
        return 8, 1, True
    if T >= 9:
        return (8, 2, True) if NH <= 12 else (32, 2, False)
    if T == 1 and NH >= 96:
        return 64, 4, False
    return 16, 1, True


def autotuning() -> bool:
    """Whether Triton's autotuner picks the config (DSPARK_KDA_AUTOTUNE=1, on a GPU) instead of kda_config."""
    return os.environ.get("DSPARK_KDA_AUTOTUNE", "0") == "1" and not interpreting()


if HAS_TRITON:
    _kda_tuned = triton.autotune([triton.Config({"BV": bv, "MERGED": m}, num_warps=w, num_stages=1)
                                  for bv, w, m in CONFIGS],
                                 key=["T", "NH", "D", "ALL_STATES"], restore_value=["s_out_ptr"],
                                 **AUTOTUNE_CACHE)(_kda_decode_kernel)


# the keys (T, B*H, the constants, the inputs' dtypes: the state and outputs' are fixed) of steps over pools already
# tuned on their rows' copies
_TUNED_ON_ROWS: set[tuple] = set()


def _tune_on_row_copies(grid, args: tuple, meta: dict, slots: torch.Tensor) -> None:
    """A step that writes its final state back into the pool: the autotuner times each config on the pool restored
    after every trial (restore_value), so that timing would be a copy of the whole pool and the pick noise. Its
    first launch of a key runs on copies of the step's rows instead (row b at b: the same key, so the launch on the
    pool then takes the pick), and leaves the pools as they were."""
    key = (args[13], args[16], *meta.values(), slots.dtype, *(args[i].dtype for i in (0, 1, 2, 3, 4, 5, 6, 11)))
    if key in _TUNED_ON_ROWS:
        return
    _TUNED_ON_ROWS.add(key)
    a = list(args)
    rows = a[7][slots]  # [B, H, D, D]: the state rows (s_in is s_out, the pool)
    a[4], a[7], a[8], a[12] = a[4][slots], rows, rows, torch.arange(len(slots), device=slots.device,
                                                                       dtype=slots.dtype)
    _kda_tuned[grid](*a, **meta)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """[B, T, C] -> (x, row stride) with row (b, t) at (b*T + t) * stride: x itself when its columns are contiguous
    and its rows evenly strided (a column slice of one wider [B, T, N] projection), else a contiguous copy."""
    B, T, C = x.shape
    s = x.stride(1) if T > 1 else x.stride(0)
    if x.stride(2) == 1 and (B == 1 or T == 1 or x.stride(0) == T * s):
        return x, s
    return x.contiguous(), C


@torch.compiler.disable  # a torch.compile'd caller launches the kernel as it is
def kda_decode_triton(qkv, f, beta, gate, conv_w, window, A_log, dt_bias, o_norm_w, state=None, lower_bound=None,
                      eps=1e-5, return_all_states=False, lengths=None, block_v=None, merged=True, num_warps=None,
                      slots=None):
    """slots [B]: state and window are pools (kda_decode_slots), read at those rows; without return_all_states the
    final state and the kept window go back there, in place (each program reads its state slice before writing it;
    the state returned is the pool).
    block_v: value columns per program (default: kda_config's, with its warps and reduction order, or the
    autotuner's: autotuning()); merged, num_warps: the reduction order (MERGED in _kda_decode_kernel) and warps when
    block_v is given. Two launches: the delta rule, then the gated norm."""
    B, T, P3 = qkv.shape
    P, W = P3 // 3, conv_w.shape[1]
    D = o_norm_w.shape[0]
    H = P // D
    (qkv, sq), (f, sf), (beta, sb), (gate, sg) = (_rows(x) for x in (qkv, f, beta, gate))
    conv_w = conv_w.contiguous()
    if slots is not None:  # the pools in place: any window dtype (the kernel reads it as fp32)
        if not (state.is_contiguous() and state.dtype == torch.float32 and window.is_contiguous()):
            raise ValueError("kda_decode_triton: slots need contiguous pools, the state pool in fp32")
    else:
        window = window.to(qkv.dtype).contiguous()
    o = torch.empty(B, T, P, dtype=torch.float32, device=qkv.device)
    out = torch.empty(B, T, P, dtype=qkv.dtype, device=qkv.device)
    ext = torch.empty(B, W - 1 + T, P3, dtype=qkv.dtype, device=qkv.device)
    if return_all_states:
        s_out = torch.empty(B, T, H, D, D, dtype=torch.float32, device=qkv.device)
    elif slots is not None:
        s_out = state  # the pool, in place
    else:
        s_out = torch.empty(B, H, D, D, dtype=torch.float32, device=qkv.device)
    s_in = state.contiguous() if state is not None else s_out
    lens = lengths.contiguous() if lengths is not None else qkv
    rows = slots.contiguous() if slots is not None else qkv
    BD = next_pow2(D)
    args = (qkv, f, beta, conv_w, window, A_log, dt_bias, s_in, s_out, o, ext, lens, rows,
            T, H, P, B * H, sq, sf, sb, float(lower_bound or 0.0), D ** -0.5)
    meta = dict(D=D, BD=BD, BT=next_pow2(T), BE=next_pow2(T + W - 1), W=W, USE_LB=lower_bound is not None,
                HAS_STATE=state is not None, ALL_STATES=return_all_states, HAS_LEN=lengths is not None,
                SLOTS=slots is not None)
    if block_v is None and autotuning():
        grid = lambda a: (B, H, triton.cdiv(D, a["BV"]))  # noqa: E731
        if s_out is state and slots is not None:  # the state pool written in place: tune on the rows' copies first
            _tune_on_row_copies(grid, args, meta, slots)
        _kda_tuned[grid](*args, **meta)
    else:
        if block_v is None:
            block_v, num_warps, merged = kda_config(T, B * H, D)
        BV = min(block_v, BD)
        _kda_decode_kernel[(B, H, triton.cdiv(D, BV))](*args, **meta, BV=BV, MERGED=merged, num_stages=1,
                                                       num_warps=num_warps or (4 if BV <= 32 else 8))
    keep = slots is not None and not return_all_states
    _kda_out_norm_kernel[(B * T, H)](o, gate, o_norm_w, out, ext, window if keep else o, rows, lens, T, H, P, sg, eps,
                                     D=D, BD=BD, W=W, KEEP_WINDOW=keep, HAS_LEN=lengths is not None,
                                     num_warps=1 if BD <= 128 else 4)
    return out, s_out, ext


def kda_decode(qkv, f, beta, gate, conv_w, window, A_log, dt_bias, o_norm_w, state=None, lower_bound=None,
               eps=1e-5, return_all_states=False, lengths=None):
    """-> (out [B,T,P], state_final [B,H,K,V] fp32 | all states [B,T,H,K,V], ext [B,W-1+T,3P]). See module doc."""
    fn = kda_decode_triton if use_triton(qkv, state if state is not None else qkv) else kda_decode_ref
    return fn(qkv, f, beta, gate, conv_w, window, A_log, dt_bias, o_norm_w, state, lower_bound, eps,
              return_all_states, lengths)


def kda_decode_slots_ref(qkv, f, beta, gate, conv_w, window_pool, A_log, dt_bias, o_norm_w, state_pool,
                         lower_bound=None, eps=1e-5, return_all_states=False, lengths=None, slots=None):
    """kda_decode_slots by its definition: the rows gathered from the pools, kda_decode_ref, and (without all
    states) the final state and the window of the last W-1 valid raw inputs written back."""
    B, T = qkv.shape[:2]
    W1 = window_pool.shape[1]
    out, S, ext = kda_decode_ref(qkv, f, beta, gate, conv_w, window_pool[slots], A_log, dt_bias, o_norm_w,
                                 state_pool[slots], lower_bound, eps, return_all_states, lengths)
    if not return_all_states:
        n = lengths.to(qkv.device) if lengths is not None else torch.full((B,), T, device=qkv.device)
        state_pool[slots] = S
        window_pool[slots] = kept_conv_window(ext, n, W1).to(window_pool.dtype)
        S = state_pool
    return out, S, ext


def kda_decode_slots(qkv, f, beta, gate, conv_w, window_pool, A_log, dt_bias, o_norm_w, state_pool, slots,
                     lower_bound=None, eps=1e-5, return_all_states=False, lengths=None):
    """kda_decode over a cache's pools: state_pool [N, H, K, V] fp32 and window_pool [N, W-1, 3P], row slots[b] [B]
    for request b. Without return_all_states the step's final state and kept window are written there (-> (out,
    state_pool, ext)); with it they are read only (-> (out, all states [B,T,H,K,V], ext), as kda_decode)."""
    fn = kda_decode_triton if use_triton(qkv, state_pool, slots) else kda_decode_slots_ref
    return fn(qkv, f, beta, gate, conv_w, window_pool, A_log, dt_bias, o_norm_w, state_pool, lower_bound, eps,
              return_all_states, lengths, slots=slots)

