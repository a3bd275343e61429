"""Triton kernels for the K3 / DSpark hot paths, each beside its torch reference (as flash-linear-attention keeps
`naive.py` beside each op's kernels).

Every kernel module holds `<op>_ref` (pure torch), `_<op>_kernel` (Triton), `<op>_triton` (the launcher) and `<op>`
(the dispatcher: Triton for CUDA tensors, or for any tensor under TRITON_INTERPRET=1; else the reference). The torch
definitions the models are built from live here too, beside the kernel that reproduces them, so imports run one way:
models import kernels, kernels never import models. Modules:
  kda_decode     fused KDA decode / verify step (conv + SiLU + L2 norm + gate + delta rule; then the gated RMSNorm);
                 also the KDA definitions: l2norm, kda_gate, causal_conv_silu, kda_recurrent (the token loop)
  attn_res       Attention-Residuals depth mix (+ optional output RMSNorm)
  mxfp4_matmul   y = x @ dequant(W)^T with MXFP4 weights dequantised in registers (single or grouped experts);
                 also the MXFP4 codec: quantize_mxfp4, dequantize_mxfp4
  markov_sample  the sequential Markov-head drafting loop of one draft step (argmax, or Gumbel-max from counter-based
                 uniforms), one launch
  decode_gemv    bs=1 decode matvec with the RMSNorm / silu*mul prologue and the residual add fused in (Qwen3)
  rope           norm_rope: per-head RMSNorm + NeoX RoPE of Qwen3's q / k, angles from the positions; qk_norm_rope_:
                 the same for q and k at once, in place in their merged projection's output; rope_interleaved: MLA's
                 RoPE (GPT-J pairs); one kernel for all three; also the RoPE definitions (rope_cos_sin,
                 apply_rope_neox, apply_rope_interleaved, Rope)
  greedy_verify  greedy verification + the step's packed output [a, n, tokens] from the target's argmax (or, for a
                 sampled step, from its verifier's a and next token)
  glu            the gated MLP's activation (SwiGLU, K3's SiTU-GLU) in one pass; also its torch definition
  moe_route      LatentMoE routing (scores, biased top-k, weights) per token; also the router's torch definition
  moe_combine    LatentMoE's weighted sum of its experts' outputs (every expert's, or one per token and slot)
  inverse_cdf    one sampled index per row from unnormalised weights (the sampled tokens, drafts and resamples)
  counter_uniform  the counter-based uniforms of dspark.spec.sampling (splitmix64), one launch; also their definition
  rejection_verify  Leviathan rejection verification of a sampled step, one launch (rows under a temperature alone)
  rms_norm       torch definitions several kernels fuse (no kernel of its own)
  add_rms_norm   a residual add and the RMSNorm after it in one pass
  temperature_softmax  softmax(logits / T) per row, one launch
  view_indices   a decode step's cache indices (positions, valid flags, pool rows, gather rows) and its additive key
                 mask; also key_visible, pool_rows
  paged_attention  attention over the paged pool in place (no gathered context, no mask tensor; the drafter's
                 block as extra rows); also Pages, where a layer's rows lie
  draft_block    a draft step's block embeddings, positions and key mask in one launch; also block_embeddings
  chain_inputs   a step's inputs from the step before it on the device (async scheduling)
  publish        a captured step's output kept for the next step and posted for the host (a two-turn ring and a count)
  argmax         torch.argmax over the last dim for a decode step's few rows (the target's greedy pick)
  project_rows   a plain step's context stash: the projection of the aux hidden states, written at their cache rows
Where they run, on CUDA without autograd: the K3 layers dispatch kda_decode (cached steps of <= 17 tokens), attn_res
(inference), moe_route, moe_combine and the MoE's grouped_gemv (decode_gemv.py); the Qwen3 target and drafter layers
qk_norm_rope_ on cached forwards (norm_rope elsewhere; in a decode step it also writes the cache rows) and
paged_attention in a decode step, every residual add before a norm add_rms_norm, MLA with RoPE (the K3 drafter)
rope_interleaved; every gated MLP glu; every decode step view_indices, every captured one publish, its draft steps
draft_block, its plain steps (a drafter loaded, k = 0) project_rows; the engine's draft step runs markov_sample for
greedy drafts and for rows under a temperature alone, its greedy steps argmax (the target's picks; a greedy prefill's
first tokens too) and greedy_verify and its sampled steps counter_uniform, rejection_verify and greedy_verify's pack,
every other sampled draw (dspark.spec.sampling.sample_from) inverse_cdf.
decode_gemv's Qwen3 matvecs are not used by the engine's paged step; they are tested against their references and
timed by bench/gpu_kernels.py. DSPARK_KERNELS=0 turns all of them off (the torch modules run instead).

TRITON_INTERPRET=1 is read by `triton.jit` when a kernel is *decorated* (triton 3.9: knobs.runtime.interpret), so it
must be in the environment before these modules are imported; tests/test_kernels.py runs the interpreter checks in a
subprocess for that reason.
"""
from __future__ import annotations

import inspect
import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # noqa: BLE001 - no triton: every op runs its torch reference
    HAS_TRITON = False

    class _Stub:  # lets the kernel modules define (never call) their kernels
        constexpr = None

        @staticmethod
        def jit(fn=None, **_):
            return fn if fn is not None else (lambda f: f)

    triton = tl = _Stub()


# autotune picks persist in Triton's cache dir where this triton can (as fla's do): a carried cache (bench/run_gpu.sh
# restores .cache/triton-autotune.tgz and saves a new one) spares a fresh machine the timing of every config
AUTOTUNE_CACHE = ({"cache_results": True} if HAS_TRITON and "cache_results" in
                  inspect.signature(triton.autotune).parameters else {})


def interpreting() -> bool:
    return HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(*tensors: torch.Tensor) -> bool:
    """Dispatch rule: Triton when every tensor is on CUDA (or the interpreter is on), DSPARK_KERNELS != 0."""
    if not HAS_TRITON or os.environ.get("DSPARK_KERNELS", "1") == "0":
        return False
    return interpreting() or all(t.is_cuda for t in tensors)


def as_rows(x: torch.Tensor) -> tuple[torch.Size, torch.Tensor]:
    """x [..., V] -> (its leading shape, x as rows [R, V] with unit column stride: a view where it can be)."""
    rows = x.reshape(-1, x.shape[-1])
    return x.shape[:-1], rows if rows.stride(-1) == 1 else rows.contiguous()


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
