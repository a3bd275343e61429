"""On a GPU: the drafter's block-sparse training pass with flex attention (compiled) == the dense SDPA mask, values
and gradients, for both backbones.  python3 bench/check_flex_cuda.py"""
import sys

import torch

sys.path.insert(0, ".")
from tests.targets import make_target  # noqa: E402
from tests.test_drafter_k3 import make_k3_drafter  # noqa: E402
from tests.test_engine import make_drafter  # noqa: E402

if not torch.cuda.is_available():
    print("needs CUDA")
    sys.exit(2)
import os  # noqa: E402

os.environ["DSPARK_TEST_DEVICE"] = "cuda"
for kind in (sys.argv[1:] or ["qwen3", "k3"]):
    target = make_target(kind, vocab=300)
    d = make_drafter(target, block_size=4) if kind == "qwen3" else make_k3_drafter(target).cuda()
    x = torch.randint(2, 300, (4, 256), device="cuda")
    with torch.no_grad():
        _, aux = target(x, aux_layer_ids=d.config.target_layer_ids)
    anchors = torch.sort(torch.randperm(250, device="cuda")[:96].view(4, 24) + 1, dim=1).values
    res = {}
    for flex in (False, True):
        d.zero_grad()
        h = d.train_forward(aux, x, anchors, flex=flex)
        h.float().pow(2).mean().backward()
        res[flex] = (h.detach(), {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None})
    out_err = (res[True][0] - res[False][0]).abs().max().item()
    grad_err = max((res[True][1][n] - g).abs().max().item() / (g.abs().max().item() + 1e-12)
                   for n, g in res[False][1].items())
    print(f"{kind}: flex vs dense: out max abs {out_err:.2e}, grads max rel {grad_err:.2e}")
    assert out_err < 1e-4 and grad_err < 1e-3
print("ok")
