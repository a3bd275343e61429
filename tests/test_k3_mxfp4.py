"""MXFP4 pack/unpack (OCP E2M1 + E8M0, low nibble = even element) and MXFP4 expert checkpoints."""
import json

import torch
from safetensors.torch import load_file

from dspark.kernels.mxfp4_matmul import FP4_E2M1_LUT
from dspark.models.k3 import K3ForCausalLM, convert_to_mxfp4, dequantize_mxfp4, quantize_mxfp4
from dspark.models.k3.config import k3_tiny_config
from dspark.models.k3.mxfp4 import MXFP4Linear


def _random_mx(out_f=16, in_f=128, seed=0):
    """Random codes (no -0) and exponents, each block's max forced to +-6 or +-4 so the OCP scale is recoverable."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_f, in_f), generator=g)
    codes[codes == 8] = 0
    G = in_f // 32
    top = torch.tensor([7, 15, 6, 14])[torch.randint(0, 4, (out_f, G), generator=g)]
    pos = torch.randint(0, 32, (out_f, G), generator=g) + torch.arange(G) * 32
    codes.scatter_(1, pos, top)
    codes = codes.to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale = torch.randint(127 - 20, 127 + 20, (out_f, G), generator=g).to(torch.uint8)
    return packed, scale


def test_pack_unpack_exact_on_representable_values():
    packed, scale = _random_mx()
    w = dequantize_mxfp4(packed, scale)
    p2, s2 = quantize_mxfp4(w)
    assert torch.equal(p2, packed) and torch.equal(s2, scale)
    assert torch.equal(dequantize_mxfp4(p2, s2), w)


def test_dequantize_values_and_nibble_order():
    packed = torch.tensor([[0x21] + [0] * 15], dtype=torch.uint8)  # low nibble 1 (0.5), high nibble 2 (1.0)
    scale = torch.tensor([[128]], dtype=torch.uint8)  # 2^1
    w = dequantize_mxfp4(packed, scale)
    assert w[0, 0] == 1.0 and w[0, 1] == 2.0 and (w[0, 2:] == 0).all()
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1], w[0, 2] = -6.0, 0.5, 3.0  # amax 6 -> shared_exp = floor(log2 6) - 2 = 0 -> byte 127
    packed, scale = quantize_mxfp4(w)
    assert scale.item() == 127
    assert packed[0, 0].item() == (0xF | (0x1 << 4)) and packed[0, 1].item() == 0x5
    assert torch.equal(FP4_E2M1_LUT[torch.arange(8)], torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6]))


def test_round_to_nearest_even_and_saturation():
    vals = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, -0.74, 7.9])
    w = torch.zeros(1, 32)
    w[0, :10] = vals  # amax 7.9 -> shared_exp 0: the values are the scaled ones
    out = dequantize_mxfp4(*quantize_mxfp4(w))[0, :10]
    assert torch.equal(out, torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, 6.0]))


def test_quantisation_error_bounded_on_random_weights():
    w = torch.randn(64, 256) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different magnitudes
    wq = dequantize_mxfp4(*quantize_mxfp4(w))
    amax = w.view(64, 8, 32).abs().amax(-1, keepdim=True)
    err = (wq - w).view(64, 8, 32).abs()
    # step of E2M1 at the top of the scaled range is 2 (4->6), the scale is <= amax/4: |err| <= amax/4 (saturation
    # of values in (6, 8) x 2^e costs at most 2 x 2^e as well)
    assert (err <= amax / 4 + 1e-12).all()
    rel = ((wq - w).norm() / w.norm()).item()
    print(f"MXFP4 relative Frobenius error on gaussian weights: {rel:.4f}")
    assert rel < 0.15


def test_mxfp4_model_save_load_reproduces_logits(tmp_path):
    torch.manual_seed(0)
    model = K3ForCausalLM(k3_tiny_config()).eval()
    ids = torch.randint(3, 97, (2, 9))
    with torch.no_grad():
        ref = model(ids)
        convert_to_mxfp4(model)
        q = model(ids)
    experts = model.model.layers[1].block_sparse_moe.experts  # 8 experts, [w1 | w3] 2 x 32 rows of 32 inputs
    assert experts.mxfp4 and not list(experts.parameters())
    assert experts.w13_weight_packed.shape == (8, 64, 16) and experts.w13_weight_scale.shape == (8, 64, 1)
    assert model.config.quantization_config["format"] == "mxfp4-pack-quantized"
    assert 0 < (q - ref).abs().max() < 0.5 * ref.abs().max()
    model.save_pretrained(tmp_path / "q")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "mxfp4-pack-quantized"
    saved = load_file(str(tmp_path / "q" / "model.safetensors"))  # one packed tensor per expert and projection
    w1 = "model.layers.1.block_sparse_moe.experts.3.w1"
    assert saved[f"{w1}.weight_packed"].shape == (32, 16) and saved[f"{w1}.weight_scale"].shape == (32, 1)
    assert torch.equal(saved[f"{w1}.weight_packed"], experts.w13_weight_packed[3, :32])
    loaded = K3ForCausalLM.from_pretrained(tmp_path / "q")
    assert loaded.model.layers[2].block_sparse_moe.experts.mxfp4
    assert loaded.model.layers[2].block_sparse_moe.shared_experts.gate_up_proj.weight.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(loaded(ids), q)
    assert isinstance(MXFP4Linear.from_linear(torch.nn.Linear(64, 8, bias=False)), MXFP4Linear)
