"""Compare fla's KDA kernels (chunk_kda, fused_recurrent_kda) with DSpark's torch reference on one GPU.

Usage (H200 with fla-core installed):  python bench/gpu_k3_kernels.py [--B 2 --T 2048 --H 16 --D 128 --iters 20]
Prints one table row per case: max abs / max rel error of the output and the final state against the fp32 torch
reference (kda_chunked / kda_recurrent from bf16 inputs), and median times. Exits with code 2 and a message when
CUDA or fla is missing.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import median_ms  # noqa: E402  (bench/timing.py)

from dspark.models.k3.kda import kda_chunked, kda_gate, kda_recurrent, l2norm  # noqa: E402


def _err(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = (x.float() - ref.float()).abs()
    return diff.max().item(), (diff.max() / ref.float().abs().max().clamp(min=1e-12)).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--decode-T", type=int, default=4, help="tokens per fused_recurrent_kda call (verify window)")
    ap.add_argument("--lower-bound", type=float, default=-5.0, help="K3 safe gate; pass nan for the softplus gate")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_k3_kernels: no CUDA device; this benchmark needs a GPU with fla-core installed", file=sys.stderr)
        return 2
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except Exception as e:  # noqa: BLE001
        print(f"gpu_k3_kernels: cannot import fla.ops.kda ({e!r}); pip install fla-core", file=sys.stderr)
        return 2
    import fla
    B, T, H, D = args.B, args.T, args.H, args.D
    lb = None if args.lower_bound != args.lower_bound else args.lower_bound  # nan -> softplus gate
    dev, bf = "cuda", torch.bfloat16
    torch.manual_seed(0)
    # raw layer-level inputs in bf16 (post-conv q, k, v; raw gate pre-activation f; beta logits)
    q_raw = torch.randn(B, T, H, D, device=dev, dtype=bf)
    k_raw = torch.randn(B, T, H, D, device=dev, dtype=bf)
    v = torch.randn(B, T, H, D, device=dev, dtype=bf)
    f = torch.randn(B, T, H, D, device=dev, dtype=bf)
    b_logit = torch.randn(B, T, H, device=dev, dtype=bf)
    A_log = (torch.zeros(H, device=dev) if lb is not None else torch.empty(H, device=dev).uniform_(1, 16).log())
    dt_bias = torch.randn(H * D, device=dev) * 0.5
    S0 = torch.randn(B, H, D, D, device=dev) * 0.1  # [B,H,K,V] fp32
    # pre-activated inputs, shared by the reference and the "pre-activated" fla calls
    q, k = l2norm(q_raw.float()), l2norm(k_raw.float())
    g = kda_gate(f, A_log, dt_bias, lb)  # fp32 [B,T,H,D]
    beta = torch.sigmoid(b_logit.float())
    with torch.no_grad():
        o_ref, S_ref = kda_chunked(q, k, v, g, beta, S0)
    rows = []
    print(f"fla {getattr(fla, '__version__', '?')}, torch {torch.__version__}, {torch.cuda.get_device_name()}; "
          f"B={B} T={T} H={H} D={D} gate={f'lower_bound={lb:g}' if lb is not None else 'softplus'}")

    def case(name, fn, ref_o, ref_S, ref_ms):
        try:
            with torch.no_grad():
                o, S = fn()
                ms = median_ms(fn, 3, args.iters)
        except Exception as e:  # noqa: BLE001 - keep going: report which call failed and why
            rows.append((name, f"FAILED: {type(e).__name__}: {str(e)[:120]}"))
            return
        S = S.float().transpose(-1, -2)  # fla V-first -> [B,H,K,V]
        oa, orel = _err(o, ref_o)
        sa, srel = _err(S, ref_S)
        rows.append((name, f"{oa:10.2e} {orel:10.2e} {sa:10.2e} {srel:10.2e} {ms:10.3f} {ref_ms:10.3f}"))

    init_vfirst = S0.transpose(-1, -2).contiguous()
    ref_ms = median_ms(lambda: kda_chunked(q, k, v, g, beta, S0), 3, max(3, args.iters // 4))
    case("chunk_kda pre-activated g/beta, l2-normed q/k",
         lambda: chunk_kda(q.to(bf), k.to(bf), v, g, beta.to(bf), initial_state=init_vfirst,
                           output_final_state=True, state_v_first=True), o_ref, S_ref, ref_ms)
    case("chunk_kda in-kernel l2norm/gate/beta-sigmoid",
         lambda: chunk_kda(q_raw, k_raw, v, f, b_logit, initial_state=init_vfirst, output_final_state=True,
                           use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                           A_log=A_log, dt_bias=dt_bias, safe_gate=lb is not None, lower_bound=lb,
                           state_v_first=True), o_ref, S_ref, ref_ms)
    # decode / verify window: fused_recurrent_kda over the first decode-T tokens from S0
    n = args.decode_T
    with torch.no_grad():
        o_dec, S_dec = kda_recurrent(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], S0)
    dec_ms = median_ms(lambda: kda_recurrent(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], S0), 3, args.iters)
    case(f"fused_recurrent_kda T={n} pre-activated",
         lambda: fused_recurrent_kda(q[:, :n].to(bf), k[:, :n].to(bf), v[:, :n], g[:, :n], beta[:, :n].to(bf),
                                     initial_state=init_vfirst, output_final_state=True, state_v_first=True),
         o_dec, S_dec, dec_ms)
    case(f"fused_recurrent_kda T={n} in-kernel",
         lambda: fused_recurrent_kda(q_raw[:, :n], k_raw[:, :n], v[:, :n], f[:, :n], b_logit[:, :n],
                                     A_log=A_log, dt_bias=dt_bias, initial_state=init_vfirst,
                                     output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                     use_beta_sigmoid_in_kernel=True, lower_bound=lb, state_v_first=True),
         o_dec, S_dec, dec_ms)
    # the recurrent reference itself over the full length (a second, independent oracle for the chunked one)
    with torch.no_grad():
        o_rec, S_rec = kda_recurrent(q, k, v, g, beta, S0)
    oa, _ = _err(o_rec, o_ref)
    sa, _ = _err(S_rec, S_ref)
    print(f"torch reference: recurrent vs chunked over T={T}: out max abs {oa:.2e}, state max abs {sa:.2e}")
    print(f"{'case':52s} {'out_abs':>10s} {'out_rel':>10s} {'state_abs':>10s} {'state_rel':>10s} "
          f"{'fla_ms':>10s} {'ref_ms':>10s}")
    for name, text in rows:
        print(f"{name:52s} {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
