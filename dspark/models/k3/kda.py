"""Kimi Delta Attention (KDA): the gated delta rule with per-channel decay (docs/k3-model.md, "KDA").

Shapes: B batch, T tokens, H heads, K = V = D head dim, P = H*D, W conv width.
State layout inside this module: S [B, H, K, V] fp32 (fla's `state_v_first=True` is [.., V, K]; transposed at the
boundary). Per token (g = log decay, [K]):   S <- S * exp(g)[:, None];  u = v - S^T k;  S <- S + beta k u^T;
o = S^T (q * scale).
The definitions the layer is built from (l2norm, kda_gate, causal_conv_silu, the token loop kda_recurrent) live beside
the fused decode kernel that reproduces them, dspark/kernels/kda_decode.py; here are the layer, the chunkwise form
for long inputs and fla's kernels for the GPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark.kernels import use_triton
from dspark.kernels.kda_decode import (
    causal_conv_silu,
    kda_decode,
    kda_decode_slots,
    kda_gate,
    kda_recurrent,
    kept_conv_window,
    l2norm,
)
from dspark.models.layers import MergedConv1d, MergedLinear, RMSNorm

try:  # GPU fast path; never used on CPU
    from fla.ops.kda import chunk_kda as _fla_chunk_kda
    from fla.ops.kda import fused_recurrent_kda as _fla_fused_recurrent_kda
except Exception:  # noqa: BLE001 - fla missing or broken: the torch reference is the path
    _fla_chunk_kda = _fla_fused_recurrent_kda = None

RECURRENT_MAX_T = 16  # new-token counts up to this run the token loop (decode / verify)
FUSED_MAX_T = 17  # cached inference steps up to this (decode, verify of k+1 <= 17) use dspark.kernels.kda_decode on CUDA


# ---------------------------------------------------------------------------------------------------------------
# the delta rule in chunkwise WY/UT form (fast pure torch; the token loop, kda_recurrent, is the definition)
# ---------------------------------------------------------------------------------------------------------------
def unit_lower_inverse(A: torch.Tensor, eye: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 for strictly lower-triangular A [..., C, C]: A is nilpotent (A^C = 0), so
    (I + A)^-1 = (I - A)(I + A^2)(I + A^4)... with log2(C) factors. Exact in exact arithmetic and, unlike batched
    triangular solves, a handful of small matmuls (the CPU training path's hot spot)."""
    inv, power, p = eye - A, A @ A, 2
    while p < A.shape[-1]:
        inv = inv @ (eye + power)
        power, p = power @ power, p * 2
    return inv


def kda_chunked(q, k, v, g, beta, initial_state=None, chunk_size: int = 16, scale: float | None = None):
    """Same contract as kda_recurrent (final state only). WY/UT chunkwise form, fp32, T padded to the chunk size:
    per chunk with G = in-chunk cumsum of g (log Gamma) and state S at the chunk start,
      A_kk[i,j] = beta_i sum_d k_id k_jd exp(G_id - G_jd)  (j < i),   A_qk[i,j] = sum_d q_id k_jd exp(G_id - G_jd) (j <= i)
      W = (I + A_kk)^-1 diag(beta) (Gamma*K),   U = (I + A_kk)^-1 diag(beta) V,   U' = U - W S
      O = (Gamma*Q) S + A_qk U',   S <- exp(G_C) * S + (exp(G_C - G) * K)^T U'.
    Pairwise exp(G_i - G_j) with j <= i is <= 1, so nothing overflows (no 1/Gamma). The pairwise tensor costs
    T*C*K per head, so C = 16 is ~8x faster than 64 on CPU (measured, fwd+bwd, T=255, K=64)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    scale = K ** -0.5 if scale is None else scale
    pad = (-T) % C
    # [B, H, N, C, *] fp32; padding has k = q = v = 0, g = 0, beta = 0: it leaves S unchanged
    def prep(x):
        x = x.float()
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) if pad else x
        return x.transpose(1, 2).reshape(B, H, -1, C, *x.shape[3:])
    q, k, v, g, beta = prep(q) * scale, prep(k), prep(v), prep(g), prep(beta)
    N = q.shape[2]
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float().clone()
    idx = torch.arange(C, device=q.device)
    incl = idx[:, None] >= idx[None, :]  # [C(i), C(j)] j <= i
    strict = idx[:, None] > idx[None, :]
    eye = torch.eye(C, device=q.device)
    outs = []
    for n in range(N):
        qn, kn, vn, gn, bn = q[:, :, n], k[:, :, n], v[:, :, n], g[:, :, n], beta[:, :, n]  # [B,H,C,*]
        G = gn.cumsum(-2)  # [B,H,C,K]
        diff = (G[:, :, :, None, :] - G[:, :, None, :, :]).masked_fill(~incl[..., None], float("-inf"))
        k_decayed = kn[:, :, None, :, :] * diff.exp()  # [B,H,C(i),C(j),K]: k_j * exp(G_i - G_j)
        A_kk = torch.einsum("bhik,bhijk->bhij", kn, k_decayed) * bn[..., None] * strict
        A_qk = torch.einsum("bhik,bhijk->bhij", qn, k_decayed) * incl
        L_inv = unit_lower_inverse(A_kk, eye)  # (I + A_kk)^-1
        kg = kn * G.exp()  # Gamma * K
        W = L_inv @ (bn[..., None] * kg)
        U = L_inv @ (bn[..., None] * vn)
        U = U - W @ S  # [B,H,C,V]
        outs.append((qn * G.exp()) @ S + A_qk @ U)
        G_last = G[:, :, -1:, :]  # [B,H,1,K]
        S = G_last.transpose(-1, -2).exp() * S + (kn * (G_last - G).exp()).transpose(-1, -2) @ U
    o = torch.stack(outs, 2).reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2)
    return o, S


def fla_available(v: torch.Tensor) -> bool:
    """fla for half-precision inputs (bf16 models, autocast) on CUDA. fla's chunk form keeps its per-chunk states in
    bf16, so an fp32 model takes the torch forms and keeps fp32 accuracy."""
    return v.is_cuda and v.dtype != torch.float32 and _fla_chunk_kda is not None


@torch.compiler.disable  # a torch.compile'd caller (the trainer's compile=true) runs fla's kernels as they are
def kda_fla(q, k, v, g, beta, initial_state=None, decode: bool = False):
    """fla kernels with pre-activated g / beta and L2-normalised q, k (so padded positions can carry g = beta = 0).
    initial_state [B,H,K,V] fp32 -> fla's V-first [B,H,V,K]; returns (o, S_final [B,H,K,V] fp32)."""
    init = None if initial_state is None else initial_state.float().transpose(-1, -2).contiguous()
    fn = _fla_fused_recurrent_kda if decode else _fla_chunk_kda
    o, S = fn(q, k, v, g, beta, initial_state=init, output_final_state=True, state_v_first=True)
    return o, S.float().transpose(-1, -2)


# ---------------------------------------------------------------------------------------------------------------
# the layer
# ---------------------------------------------------------------------------------------------------------------
class KimiDeltaAttention(nn.Module):
    """K3 KDA layer (`self_attn.` of a KDA layer). Checkpoint names as in docs/k3-model.md, "Checkpoint names"; in
    memory q/k/v/gate/f_a/b_proj are one weight (in_proj) and the q/k/v convs one (qkv_conv1d)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, conv_size: int = 4,
                 gate_lower_bound: float | None = None, use_full_rank_gate: bool = True, layer_idx: int = 0):
        super().__init__()
        H, D, P = num_heads, head_dim, num_heads * head_dim
        self.num_heads, self.head_dim, self.conv_size, self.layer_idx = H, D, conv_size, layer_idx
        self.gate_lower_bound = gate_lower_bound
        self.use_full_rank_gate = use_full_rank_gate
        # q, k, v, the output gate (K3: full-rank g_proj; Kimi Linear: low-rank g_a_proj, then g_b_proj with fla's
        # bias), f_a and b as one weight, initialised in the separate modules' order (a seeded model is unchanged).
        # Zero rows pad it to a multiple of 8: b_proj's H outputs otherwise leave the width unaligned (k3-mini:
        # 4*768 + 128 + 6), and cuBLAS falls back to an alignment-2 kernel (50 us of the k3-mini verify step)
        gate = {"g_proj": P} if use_full_rank_gate else {"g_a_proj": D}
        self.in_proj = MergedLinear(hidden_size, {"q_proj": P, "k_proj": P, "v_proj": P, **gate, "f_a_proj": D,
                                                  "b_proj": H}, init=False, align=8)
        self.in_proj.reset_parts("q_proj", "k_proj", "v_proj", *gate)
        if not use_full_rank_gate:
            self.g_b_proj = nn.Linear(D, P, bias=True)
        self.in_proj.reset_parts("f_a_proj")
        self.f_b_proj = nn.Linear(D, P, bias=False)
        self.in_proj.reset_parts("b_proj")
        self.qkv_conv1d = MergedConv1d({"q_conv1d": P, "k_conv1d": P, "v_conv1d": P}, conv_size)  # [3P, 1, W]
        self.A_log = nn.Parameter(torch.log(torch.empty(H).uniform_(1, 16)) if gate_lower_bound is None
                                  else torch.zeros(H))
        dt = torch.exp(torch.empty(P).uniform_(0, 1) * (torch.log(torch.tensor(0.1)) - torch.log(torch.tensor(1e-3)))
                       + torch.log(torch.tensor(1e-3))).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        self.o_norm = RMSNorm(D, eps=1e-5)
        self.o_proj = nn.Linear(P, hidden_size, bias=False)

    def conv_weight(self) -> torch.Tensor:
        """The q | k | v depthwise convs as [3P, W] (a view of the merged weight)."""
        return self.qkv_conv1d.weight.squeeze(1)

    def split_in_proj(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """in_proj(x) [B, T, N] -> (raw q|k|v conv inputs [B, T, 3P], output gate [B, T, P], f_a [B, T, D],
        beta logits [B, T, H]): column views (padding dropped); the low-rank gate goes through g_b_proj."""
        _, _, _, gate, f_a, beta = self.in_proj.split(y)
        qkv = y[..., self.in_proj.part_rows("q_proj", "k_proj", "v_proj")]
        return qkv, (gate if self.use_full_rank_gate else self.g_b_proj(gate)), f_a, beta

    def short_conv(self, window: torch.Tensor, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """window [B, W-1, 3P] previous raw inputs, raw [B, T, 3P] -> (SiLU(conv) [B, T, 3P], ext [B, W-1+T, 3P])."""
        return causal_conv_silu(window, raw, self.conv_weight())

    def forward(self, x: torch.Tensor, batch=None) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]. With a ForwardBatch, state and conv window go through batch.cache."""
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        cache = batch.cache if batch is not None else None
        record = cache is not None and batch.record
        if cache is not None and T <= FUSED_MAX_T and not torch.is_grad_enabled() and use_triton(x):
            return self._fused_step(x, batch, record)  # masks the padding rows itself
        S0, window = self._read_cache(cache, x)
        raw, gate, f_a, beta = self.split_in_proj(self.in_proj(x))  # raw: [B,T,3P] conv inputs
        valid = batch.valid(T) if batch is not None else None  # [B,T] bool
        if valid is not None:
            raw = raw * valid[..., None].to(raw.dtype)
        qkv, ext = self.short_conv(window, raw)
        q, k, v = (t.reshape(B, T, H, D) for t in qkv.chunk(3, -1))
        q, k = l2norm(q.float()), l2norm(k.float())
        g = kda_gate(self.f_b_proj(f_a).view(B, T, H, D), self.A_log, self.dt_bias, self.gate_lower_bound)
        beta = torch.sigmoid(beta.float())  # [B,T,H]
        if valid is not None:  # padding must leave the state untouched
            g = g * valid[..., None, None]
            beta = beta * valid[..., None]
        if record:
            o, S = kda_recurrent(q, k, v, g, beta, S0, return_all_states=True)  # S: [B,T,H,K,V]
        elif fla_available(v):
            dt = v.dtype  # fla wants q, k, v, beta in one dtype (bf16 under autocast); g stays fp32
            o, S = kda_fla(q.to(dt), k.to(dt), v, g, beta.to(dt), S0, decode=T <= RECURRENT_MAX_T)
        elif T <= RECURRENT_MAX_T:
            o, S = kda_recurrent(q, k, v, g, beta, S0)
        else:
            o, S = kda_chunked(q, k, v, g, beta, S0)
        if cache is not None:
            self._write_cache(cache, batch, S, ext, record)
        o = self.o_norm(o.to(x.dtype)) * torch.sigmoid(gate.reshape(B, T, H, D))
        return self.o_proj(o.reshape(B, T, H * D))

    def _write_cache(self, cache, batch, S, ext, record: bool) -> None:
        """record: every position's state [B,T,H,K,V] + the whole extended window; else the final state and the last
        W-1 raw inputs of each row's valid tokens."""
        if record:
            cache.kda_write(self.layer_idx, S, ext)
            return
        cache.kda_write(self.layer_idx, S, kept_conv_window(ext, batch.num_new, self.conv_size - 1))

    def _read_cache(self, cache, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """-> (the rows' state [B, H, K, V] or None, their conv window [B, W-1, 3P]; zeros without a cache)."""
        S0, window = cache.kda_read(self.layer_idx) if cache is not None else (None, None)
        if window is None:
            window = x.new_zeros(x.shape[0], self.conv_size - 1, 3 * self.num_heads * self.head_dim)
        return S0, window

    def _fused_step(self, x, batch, record: bool) -> torch.Tensor:
        """A cached inference step of T <= FUSED_MAX_T tokens: the input projections in one GEMM (in_proj), whose
        column slices go to the two kernel launches as they are (conv + SiLU + L2 norm + gate + delta rule, then
        output norm and gate; dspark/kernels/kda_decode.py, tested against this layer's math). Padding rows
        (t >= num_new) leave the state untouched, as in forward. Where the cache hands over its pools (a decode
        step's view), state and window are read there in place, and a step without recording writes them back
        in place too."""
        qkv, gate, f_a, beta = self.split_in_proj(self.in_proj(x))
        args = (qkv, self.f_b_proj(f_a), beta, gate, self.conv_weight())
        norm = (self.A_log, self.dt_bias, self.o_norm.weight)
        lengths, cache = batch.num_new.to(x.device), batch.cache
        pools = cache.kda_pools(self.layer_idx)
        if pools is None:
            S0, window = self._read_cache(cache, x)
            o, S, ext = kda_decode(*args, window, *norm, S0, self.gate_lower_bound, self.o_norm.eps,
                                   return_all_states=record, lengths=lengths)
            self._write_cache(cache, batch, S, ext, record)
        else:
            S_pool, window_pool, slots = pools
            o, S, ext = kda_decode_slots(*args, window_pool, *norm, S_pool, slots, self.gate_lower_bound,
                                         self.o_norm.eps, return_all_states=record, lengths=lengths)
            if record:  # every position's state, kept until the commit
                cache.kda_write(self.layer_idx, S, ext)
        return self.o_proj(o)
