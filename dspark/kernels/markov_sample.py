"""The sequential Markov-head sampling loop of one DSpark draft step in one launch (docs/vllm-contract.md, "Markov
head").

Shapes: B rows, D draft positions, V vocab (K3: 163840), r Markov rank (64).
  U [B, D, V] fp32 base logits;  w1 [V, r] (markov_w1.weight);  w2 [V, r] (markov_w2.weight);  anchors [B]
  for j in 0..D-1:  m = w1[prev];  logits = U[:, j] + w2 @ m;  x = argmax(score);  prev = x      (prev_0 = anchor)
  score = logits (greedy, or temperature 0) or logits / tau + Gumbel(u): Gumbel-max, a sample of softmax(logits /
  tau). u [B, D, V] uniforms: given (noise), or counter-based from each row's seed and position [B] (the first
  draft's), drawn in the kernel: u[b] = counter_uniform(seed, draft_counter(position, V), D * V)[b] viewed [D, V]
  (dspark/kernels/counter_uniform.py). So a row's drafts depend on its own seed and position alone, and the counters
  (from 2^62 up) never meet those a request draws per position for its tokens (below 2^62).
  Outputs ids [B, D] int64 and the chosen token's logit [B, D] fp32.
Kernel: G persistent programs (<= #SMs, all co-resident) each own a V-slice; per step each computes
[B, slice] = m @ w2_slice^T (+U) chunk by chunk and folds its argmax into one int64 key per row,
key = (order-preserving uint32 of the score) << 31 | (2^31-1 - index)  (max key = max score, then smallest index,
torch.argmax's tie rule; every key > 0, so the keys start from zeros, in one buffer with the barrier's counter),
published with atomic_max; a grid barrier (atomic counter) ends the step and every program
reads the B winning keys as the next prev. one_launch=False replaces the barrier by D+1 launches (no co-residency
assumption; also what the interpreter runs with several programs, since it executes programs one after another).
"""
from __future__ import annotations

import torch

from dspark.kernels import interpreting, next_pow2, tl, triton, use_triton
from dspark.kernels.counter_uniform import _mix, counter_uniform_ref

DRAFT_COUNTERS = 1 << 62  # where the draft steps' counters start
MAX_DRAFTS = 32  # counters per position: MAX_DRAFTS * V (a step drafts at most this many)


def draft_counter(position: torch.Tensor, V: int) -> torch.Tensor:
    """The first counter of a draft step at position [B] int64: each position owns MAX_DRAFTS * V counters."""
    return DRAFT_COUNTERS + position * (MAX_DRAFTS * V)


def draft_noise_ref(seed: torch.Tensor, position: torch.Tensor, D: int, V: int) -> torch.Tensor:
    """The counter-based uniforms of a draft step: seed, position [B] int64 -> [B, D, V] fp32."""
    return counter_uniform_ref(seed, draft_counter(position, V), D * V).view(-1, D, V)


def markov_sample_ref(U, w1, w2, anchors, temperature=None, noise=None):
    """Direct loop in fp32 (w1, w2 upcast). -> (ids [B, D] int64, logit of the chosen token [B, D] fp32)."""
    B, D, V = U.shape
    prev, ids, lg = anchors.long(), [], []
    for j in range(D):
        logits = U[:, j].float() + w1.float()[prev] @ w2.float().t()  # [B, V]
        score = logits
        if temperature is not None and noise is not None:
            tau = temperature.float()[:, None]
            gum = -torch.log(-torch.log(noise[:, j].float()))
            score = torch.where(tau > 0, logits / tau.clamp(min=1e-30) + gum, logits)
        x = score.argmax(-1)
        ids.append(x)
        lg.append(logits.gather(1, x[:, None])[:, 0])
        prev = x
    return torch.stack(ids, 1), torch.stack(lg, 1)


@triton.jit
def _markov_kernel(u_ptr, w1_ptr, w2_ptr, anc_ptr, temp_ptr, noise_ptr, seed_ptr, pos_ptr, ids_ptr, lgt_ptr, key_ptr,
                   bar_ptr, B, D, V, R, G, s_ids, j_begin, j_end, CTR0: tl.constexpr, CTR_PER_POS: tl.constexpr,
                   BB: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr, SAMPLE: tl.constexpr,
                   NOISE: tl.constexpr, BARRIER: tl.constexpr, DOT_F32: tl.constexpr, WITH_ANCHOR: tl.constexpr):
    g = tl.program_id(0)
    rb = tl.arange(0, BB)
    bm = rb < B
    rr = tl.arange(0, BR)
    rm = rr < R
    per = tl.cdiv(tl.cdiv(V, BV), G) * BV
    v_lo = g * per
    v_hi = tl.minimum(v_lo + per, V)
    is_g0 = (rb * 0 + g) == 0
    low = 2147483647
    if SAMPLE:
        tau = tl.load(temp_ptr + rb, mask=bm, other=0.0).to(tl.float32)
        if NOISE == 2:  # counter-based: splitmix64 keyed by mix(seed[b]) at draft_counter(position[b]) + j * V + v
            rkey = _mix(tl.load(seed_ptr + rb, mask=bm, other=0).to(tl.uint64, bitcast=True))
            rctr = CTR0 + tl.load(pos_ptr + rb, mask=bm, other=0) * CTR_PER_POS
    for j in range(j_begin, j_end):
        # ---- phase A: prev for step j (the winners of step j-1), program 0 writes ids / logits of step j-1
        prev = tl.load(anc_ptr + rb, mask=bm, other=0).to(tl.int64)
        if WITH_ANCHOR and j == 0:  # the column before ids: [anchor | ids], the verify forward's tokens
            tl.store(ids_ptr + rb * s_ids - 1, prev, mask=bm & is_g0)
        if j > 0:
            key = tl.load(key_ptr + (j - 1) * B + rb, mask=bm, other=0, cache_modifier=".cg")
            x = low - (key & low)
            if j > 1:
                pkey = tl.load(key_ptr + (j - 2) * B + rb, mask=bm, other=0, cache_modifier=".cg")
                prev = low - (pkey & low)  # the prev of step j-1, to recompute its chosen logit
            mp = tl.load(w1_ptr + prev[:, None] * R + rr[None, :], mask=bm[:, None] & rm[None, :], other=0.0)
            wx = tl.load(w2_ptr + x[:, None] * R + rr[None, :], mask=bm[:, None] & rm[None, :], other=0.0)
            lg = tl.load(u_ptr + (rb * D + j - 1) * V + x, mask=bm, other=0.0) + tl.sum(
                mp.to(tl.float32) * wx.to(tl.float32), 1)
            tl.store(ids_ptr + rb * s_ids + j - 1, x, mask=bm & is_g0)
            tl.store(lgt_ptr + rb * D + j - 1, lg, mask=bm & is_g0)
            prev = x
        # ---- phase B: step j over this program's V-slice
        if j < D:
            m = tl.load(w1_ptr + prev[:, None] * R + rr[None, :], mask=bm[:, None] & rm[None, :], other=0.0)
            best = tl.full([BB], -1, tl.int64)
            for v0 in range(v_lo, v_hi, BV):
                vv = v0 + tl.arange(0, BV)
                vm = vv < v_hi
                w2t = tl.load(w2_ptr + vv[None, :] * R + rr[:, None], mask=rm[:, None] & vm[None, :], other=0.0)
                if DOT_F32:
                    bias = tl.dot(m.to(tl.float32), w2t.to(tl.float32), input_precision="ieee")
                else:
                    bias = tl.dot(m, w2t)  # [BB, BV] fp32
                off = (rb[:, None] * D + j) * V + vv[None, :]
                tm = bm[:, None] & vm[None, :]
                score = tl.load(u_ptr + off, mask=tm, other=0.0) + bias
                if SAMPLE:
                    if NOISE == 1:
                        un = tl.load(noise_ptr + off, mask=tm, other=0.5)
                    else:
                        c = rctr[:, None] + (j * V + vv[None, :]).to(tl.int64)
                        z = _mix(rkey[:, None] + c.to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15)
                        un = (z >> 40).to(tl.float32) * (2.0 ** -24)
                    gum = -tl.log(-tl.log(un))
                    score = tl.where(tau[:, None] > 0, score / tl.maximum(tau[:, None], 1e-30) + gum, score)
                bits = score.to(tl.int32, bitcast=True)
                sbits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) + 2147483648  # [0, 2^32)
                k = (sbits << 31) | (low - vv[None, :].to(tl.int64))
                k = tl.where(tm, k, -1)
                best = tl.maximum(best, tl.max(k, 1))
            tl.atomic_max(key_ptr + j * B + rb, best, mask=bm, sem="relaxed")
            if BARRIER:  # grid barrier: all programs are resident (G <= #SMs)
                tl.debug_barrier()
                tl.atomic_add(bar_ptr, 1, sem="release")
                cnt = tl.atomic_add(bar_ptr, 0, sem="acquire")
                while cnt < (j + 1 - j_begin) * G:
                    cnt = tl.atomic_add(bar_ptr, 0, sem="acquire")
                tl.debug_barrier()


@torch.compiler.disable  # a torch.compile'd caller launches the kernel as it is
def markov_sample_triton(U, w1, w2, anchors, temperature=None, noise=None, seed=None, position=None,
                         one_launch=True, programs=None, block_v=None, out=None):
    """-> (ids [B, D] int64, logits [B, D] fp32). seed, position [B] int64 without noise: the counter-based
    uniforms, drawn in the kernel. out: a [B, D + 1] int64 buffer that gets [anchor | ids] (ids is then its view)."""
    B, D, V = U.shape
    R = w1.shape[1]
    dev = U.device
    U = U.contiguous()
    sample = temperature is not None and (noise is not None or seed is not None)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
    # V-chunks of 64, one program each, where the SMs hold them all (V 4096: 24 us a step on an H100, 26 with 32
    # programs of 128); else chunks of 256 over every SM (V 163840: 109 us, 112 with chunks of 128, 125 of 512)
    BV = block_v or (64 if triton.cdiv(V, 64) <= sms else 256)
    if programs is None:
        programs = min(sms, triton.cdiv(V, BV))
    if interpreting() and one_launch and programs > 1:
        raise ValueError("markov_sample: the interpreter runs programs one after another: one_launch needs 1 program")
    ids = torch.empty(B, D, dtype=torch.int64, device=dev) if out is None else out[:, 1:]
    lgt = torch.empty(B, D, dtype=torch.float32, device=dev)
    scratch = torch.zeros(D * B + 1, dtype=torch.int64, device=dev)  # the keys [D, B], then the barrier's counter
    keys, bar = scratch[:-1], scratch[-1:]
    temp = temperature.float().contiguous() if sample else U
    nz = noise.contiguous() if noise is not None else U
    if D > MAX_DRAFTS:
        raise ValueError(f"markov_sample: at most {MAX_DRAFTS} drafts a step, got {D}")
    sd, pos = (seed.contiguous(), position.contiguous()) if seed is not None and noise is None else (ids, ids)
    common = dict(BB=max(16, next_pow2(B)), BV=BV, BR=max(16, next_pow2(R)), SAMPLE=sample,
                  NOISE=1 if noise is not None else 2, DOT_F32=w1.dtype == torch.float32 or interpreting(),
                  num_warps=8 if B > 16 else 4, WITH_ANCHOR=out is not None)
    args = (U, w1.contiguous(), w2.contiguous(), anchors.contiguous(), temp, nz, sd, pos, ids, lgt, keys, bar,
            B, D, V, R, programs, ids.stride(0))
    common.update(CTR0=DRAFT_COUNTERS, CTR_PER_POS=MAX_DRAFTS * V)
    if one_launch:
        _markov_kernel[(programs,)](*args, 0, D + 1, BARRIER=True, **common)
    else:
        for j in range(D + 1):
            _markov_kernel[(programs,)](*args, j, j + 1, BARRIER=False, **common)
    return ids, lgt


def markov_sample(U, w1, w2, anchors, temperature=None, noise=None, seed=None, position=None, out=None):
    """Greedy Markov drafting, or Gumbel-max sampling under temperature [B] with the given noise or the counter-based
    uniforms of (seed, position); Triton on CUDA, else the reference. out [B, D + 1] int64: filled with [anchor |
    ids] (the returned ids are its view), so no cat builds the verify forward's tokens."""
    if use_triton(U, w1):
        return markov_sample_triton(U, w1, w2, anchors, temperature, noise, seed, position,
                                    one_launch=not interpreting(), out=out)
    if temperature is not None and noise is None and seed is not None:
        noise = draft_noise_ref(seed, position, U.shape[1], U.shape[2])
    ids, lgt = markov_sample_ref(U, w1, w2, anchors, temperature, noise)
    if out is None:
        return ids, lgt
    out[:, 0], out[:, 1:] = anchors, ids
    return out[:, 1:], lgt
