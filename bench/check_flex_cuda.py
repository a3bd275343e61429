"""On a GPU: the drafter's block-sparse training pass with flex attention (compiled) == the dense SDPA mask, values
and gradients, for both backbones, in fp32 and under bf16 autocast (what training uses), at test size and at the
k3-mini drafter's shape (6 heads, qk 192 / v 128, T=384 + 48 blocks of 8).  python3 bench/check_flex_cuda.py
`--diagnose`: the fp32 K3 gradient mismatch (MLA: qk head dim != v head dim), re-run with V zero-padded to the qk
head dim inside the flex call (same math: the output's extra columns are sliced off), then with the scale folded
into q (scale=None), to tell which of the two the flex backward gets wrong."""
import os
import sys
import time

import torch

sys.path.insert(0, ".")
os.environ["DSPARK_TEST_DEVICE"] = "cuda"
from tests.targets import make_target  # noqa: E402
from tests.test_drafter_k3 import make_k3_drafter  # noqa: E402
from tests.test_engine import make_drafter  # noqa: E402

if not torch.cuda.is_available():
    print("needs CUDA")
    sys.exit(2)


def check(kind: str, dtype: torch.dtype, T: int, A: int, vocab: int = 300) -> bool:
    torch.manual_seed(0)
    target = make_target(kind, vocab=vocab) if kind == "qwen3" else None
    if kind == "qwen3":
        d = make_drafter(target, block_size=4)
    else:  # k3-wide: the k3-mini drafter's attention shape (MLA qk 192 / v 128, 6 heads, block 8)
        wide = dict(num_attention_heads=6, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    kv_lora_rank=256, q_lora_rank=384, block_size=8) if kind == "k3-wide" else {}
        target = make_target("k3", vocab=vocab)
        d = make_k3_drafter(target, **wide).cuda()
    x = torch.randint(2, vocab, (4, T), device="cuda")
    with torch.no_grad():
        _, aux = target(x, aux_layer_ids=d.config.target_layer_ids)
    anchors = torch.sort(torch.randperm(T - 10, device="cuda")[: 4 * A].view(4, A) + 1, dim=1).values
    res = {}
    try:
        for flex in (False, True):
            d.zero_grad()
            t0 = time.time()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                h = d.train_forward(aux, x, anchors, flex=flex)
            h.float().pow(2).mean().backward()
            torch.cuda.synchronize()
            res[flex] = (h.detach().float(), {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None},
                         time.time() - t0)
    except Exception as e:  # report and go on: the table says which combinations lower
        print(f"{kind} {str(dtype)[6:]} T={T} A={A}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return False
    out_err = (res[True][0] - res[False][0]).abs().max().item()
    grad_err = max((res[True][1][n] - g).abs().max().item() / (g.abs().max().item() + 1e-12)
                   for n, g in res[False][1].items())
    tol = (1e-4, 1e-3) if dtype == torch.float32 else (5e-2, 5e-2)
    ok = out_err < tol[0] and grad_err < tol[1]
    print(f"{kind} {str(dtype)[6:]} T={T} A={A}: flex vs dense out max abs {out_err:.2e}, grads max rel "
          f"{grad_err:.2e} (first call incl. compile {res[True][2]:.1f} s) {'ok' if ok else 'MISMATCH'}")
    return ok


def diagnose() -> None:
    from torch.nn.attention.flex_attention import BlockMask

    import dspark.models.layers as layers

    plain = layers.attention

    def pad_v(q, k, v, mask=None, scale=None, **kw):
        if isinstance(mask, BlockMask) and v.shape[-1] < q.shape[-1]:
            dv = v.shape[-1]
            return plain(q, k, torch.nn.functional.pad(v, (0, q.shape[-1] - dv)), mask, scale, **kw)[..., :dv]
        return plain(q, k, v, mask, scale, **kw)

    def fold_scale(q, k, v, mask=None, scale=None, **kw):
        if isinstance(mask, BlockMask) and scale is not None:
            return plain(q * (scale * q.shape[-1] ** 0.5), k, v, mask, None, **kw)
        return plain(q, k, v, mask, scale, **kw)

    for name, fn in (("as is", plain), ("V padded to the qk head dim", pad_v), ("scale folded into q", fold_scale)):
        layers.attention = fn
        for mod in list(sys.modules.values()):  # the drafter modules import `attention` by name
            if getattr(mod, "attention", None) is plain and mod is not layers:
                mod.attention = fn
        print(f"-- {name}")
        for kind in ("k3", "k3-wide"):
            check(kind, torch.float32, 256, 24)
        for mod in list(sys.modules.values()):
            if getattr(mod, "attention", None) is fn and mod is not layers:
                mod.attention = plain
    layers.attention = plain


if "--diagnose" in sys.argv:
    diagnose()
    sys.exit(0)
results = [check(kind, dt, T, A) for kind in (sys.argv[1:] or ["qwen3", "k3", "k3-wide"])
           for dt in (torch.bfloat16, torch.float32) for T, A in ((256, 24),)]
print("ok" if all(results) else "some combinations failed")
