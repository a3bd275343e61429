"""The tiny hybrid K3 model (KDA + MLA + AttnRes + LatentMoE): incremental decoding, verify/rollback, aux states."""
import math
from unittest.mock import patch

import pytest
import torch

from dspark.cache.batch import DenseCache
from dspark.models.k3 import K3ForCausalLM
from dspark.models.k3.attn_res import attn_res, attn_res_naive
from dspark.models.k3.config import k3_tiny_config
from dspark.models.k3.mla import MLAttention

ATOL = 1e-4


def _model(seed=0, **overrides):
    torch.manual_seed(seed)
    model = K3ForCausalLM(k3_tiny_config(**overrides)).eval()
    with torch.no_grad():  # move off the zero-init pseudo-queries / unit gains so every path matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _ids(B, T, seed=1):
    return torch.randint(3, 97, (B, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_prefill_then_decode_equals_full_sequence():
    model = _model()
    ids = _ids(1, 30)
    full = model(ids)  # T=30: chunked KDA
    cache = DenseCache(1, 40)
    outs = [model(ids[:, :20], batch=cache.batch([20]))]  # chunked prefill
    cache.commit()
    for t in range(20, 30):
        outs.append(model(ids[:, t:t + 1], batch=cache.batch([1])))
        cache.commit()
    assert (torch.cat(outs, 1) - full).abs().max() < ATOL


@torch.no_grad()
@pytest.mark.parametrize("rope_theta", [None, 10000.0])  # the K3 target (NoPE) and the DSpark drafter (RoPE)
def test_mla_absorbed_attention_equals_expanded(rope_theta):
    """Few queries over many latent rows take the absorbed form (kv_b_proj folded into queries and output); it equals
    the expanded form for bool, additive and batch-broadcast masks; long query runs stay expanded."""
    torch.manual_seed(0)
    m = MLAttention(64, 4, 32, 32, 16, 8, 16, rope_theta=rope_theta, causal=False)
    for T, L in ((1, 20), (9, 30), (14, 40)):  # 14 * (2*32 + 8) = 1008 < 32 * (16 + 16): still absorbed
        q, rows = m.queries(torch.randn(3, T, 64)), m.latent_rows(torch.randn(3, L, 64))
        visible = torch.rand(3, 1, T, L) > 0.3
        visible[..., 0] = True
        additive = torch.zeros(3, 1, T, L).masked_fill(~visible, float("-inf"))
        for mask in (visible, additive, visible[:1], visible[:1, :, :1], None):
            got = m.attend(q, rows, mask)
            assert torch.equal(got, m._absorbed(q, rows, mask))
            want = m._expanded(q, rows, mask, False)
            assert (got - want).abs().max() < 1e-5 * want.abs().max()
    q, rows = m.queries(torch.randn(2, 15, 64)), m.latent_rows(torch.randn(2, 15, 64))
    assert torch.equal(m.attend(q, rows), m._expanded(q, rows, None, False))
    # on a GPU only enough rows x heads take it, whatever the length: the H100 graph timings' points
    with torch.device("meta"):  # no weights needed
        mini, k3 = MLAttention(768, 6, 384, 256, 128, 64, 128), MLAttention(7168, 64, 1536, 512, 128, 64, 128)
    assert mini.absorbs(16, 1, 256, cuda=True) and mini.absorbs(64, 9, 256, cuda=True)
    assert not mini.absorbs(4, 1, 4096, cuda=True) and not mini.absorbs(1, 9, 1024, cuda=True)
    assert k3.absorbs(1, 1, 256, cuda=True) and k3.absorbs(8, 9, 1024, cuda=True)
    assert mini.absorbs(512, 9, 256, cuda=True) and mini.absorbs(1, 1, 256, cuda=False)
    assert not mini.absorbs(512, 256, 1024, cuda=False)  # a prefill's queries: expanded everywhere
    assert torch.equal(m.attend(q, rows, is_causal=True), m._expanded(q, rows, None, True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_cuda_mla_absorbed_attention_at_k3_shapes():
    """bf16 on the GPU at the K3 and k3-mini shapes: a decode (T = 1) and a verify (T = 9) over up to 1024 cached rows
    per row, ragged lengths, against the expanded form in fp32."""
    for shape in ((7168, 64, 1536, 512, 128, 64, 128), (768, 6, 384, 256, 128, 64, 128)):
        torch.manual_seed(0)
        m = MLAttention(*shape).cuda()
        m16 = MLAttention(*shape).cuda().bfloat16()
        m16.load_state_dict(m.state_dict())
        heads, kv_lora, nope, rope = shape[1], shape[3], shape[4], shape[5]
        lengths = torch.randint(1, 1025, (8,), device="cuda")
        for T in (1, 9):
            q = torch.randn(8, heads, T, nope + rope, device="cuda")
            rows = torch.randn(8, 1024, kv_lora + rope, device="cuda")
            mask = (torch.arange(1024, device="cuda") < lengths[:, None])[:, None, None, :].expand(8, 1, T, 1024)
            got = m16._absorbed(q.bfloat16(), rows.bfloat16(), mask)
            want = m._expanded(q, rows, mask, False)
            assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max(), (shape, T)
            # attend takes it where rows x heads are many: K3's 8 x 64, not k3-mini's 8 x 6 (which form ran, not
            # torch.equal on their outputs: SDPA's kernels may differ in the last bit from one call to the next)
            with (patch.object(m16, "_absorbed", wraps=m16._absorbed) as absorbed,
                  patch.object(m16, "_expanded", wraps=m16._expanded) as expanded):
                chosen = m16.attend(q.bfloat16(), rows.bfloat16(), mask)
            assert (absorbed.call_count, expanded.call_count) == ((1, 0) if heads == 64 else (0, 1)), (shape, T)
            assert (chosen.float() - want).abs().max() <= 2e-2 * want.abs().max(), (shape, T)


@torch.no_grad()
def test_batched_ragged_prefill_and_decode_equal_per_row_full():
    model = _model(seed=2)
    lengths, extra = [18, 25, 9], [[2, 1, 3], [1, 1, 1], [3, 2, 1]]  # prompt lengths; new tokens per later step
    total = [n + sum(step[b] for step in extra) for b, n in enumerate(lengths)]
    seqs = [_ids(1, total[b], seed=10 + b)[0] for b in range(3)]
    refs = [model(s[None])[0] for s in seqs]
    cache = DenseCache(3, 40)
    pos = list(lengths)
    ids = torch.zeros(3, max(lengths), dtype=torch.long)  # right padding with token 0
    for b in range(3):
        ids[b, :lengths[b]] = seqs[b][:lengths[b]]
    logits = model(ids, batch=cache.batch(lengths))
    cache.commit()
    for b in range(3):
        assert (logits[b, :lengths[b]] - refs[b][:lengths[b]]).abs().max() < ATOL
    for step in extra:
        T = max(step)
        ids = torch.zeros(3, T, dtype=torch.long)
        for b in range(3):
            ids[b, :step[b]] = seqs[b][pos[b]:pos[b] + step[b]]
        logits = model(ids, batch=cache.batch(step))
        cache.commit()
        for b in range(3):
            assert (logits[b, :step[b]] - refs[b][pos[b]:pos[b] + step[b]]).abs().max() < ATOL
            pos[b] += step[b]


@torch.no_grad()
def test_verify_commit_rolls_kda_state_back_exactly():
    model = _model(seed=3)
    prompt, k = 12, 4
    seqs = _ids(2, prompt + k + 2, seed=5)
    n_keep = torch.tensor([2, 5])  # accepted drafts + 1 per row
    cache = DenseCache(2, 40)
    model(seqs[:, :prompt], batch=cache.batch([prompt, prompt]))
    cache.commit()
    model(seqs[:, prompt:prompt + k + 1], batch=cache.batch([k + 1, k + 1], record=True))  # verify t0, d1..dk
    cache.commit(n_keep)
    for b in range(2):
        n = prompt + int(n_keep[b])
        ref = DenseCache(1, 40)
        model(seqs[b:b + 1, :n], batch=ref.batch([n]))
        ref.commit()
        for layer in ref.kda:
            assert (cache.kda[layer][0][b] - ref.kda[layer][0][0]).abs().max() <= 1e-5
            assert (cache.kda[layer][1][b] - ref.kda[layer][1][0]).abs().max() <= 1e-5
        assert len(ref.kda) == 3  # KDA layers 0, 1, 3
    # the next step continues from the rolled-back state (MLA rows past the kept length are overwritten)
    nxt = torch.stack([seqs[b, prompt + int(n_keep[b])] for b in range(2)])[:, None]
    logits = model(nxt, batch=cache.batch([1, 1]))
    for b in range(2):
        n = prompt + int(n_keep[b]) + 1
        assert (logits[b, 0] - model(seqs[b:b + 1, :n])[0, -1]).abs().max() < ATOL


def _contract_attn_res(prefix, delta, blocks, res_norm, res_proj, out_norm, n, write_idx):
    """The AttnRes mix with its block bookkeeping (docs/k3-model.md), written literally over a [B, T, nB, d] blocks
    tensor."""
    if delta is not None:
        prefix = prefix + delta
    if write_idx >= 0:
        blocks[:, :, write_idx] = prefix
    srcs = [blocks[:, :, j] for j in range(n)] + [prefix]
    mix = attn_res(srcs, res_norm, res_proj) if n > 0 else prefix
    return prefix, (out_norm(mix) if out_norm is not None else mix)


@torch.no_grad()
def test_attn_res_forward_and_aux_follow_the_contract():
    model = _model(seed=4, num_hidden_layers=5, attn_res_block_size=2,
                   linear_attn_config={"kda_layers": [1, 2, 4, 5], "full_attn_layers": [3], "num_heads": 2,
                                       "head_dim": 16, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                                       "use_full_rank_gate": True})
    c, m = model.config, model.model
    ids = _ids(2, 9)
    Bs, L = c.attn_res_block_size, c.num_hidden_layers
    nB = math.ceil(L / Bs)
    prefix = m.embed_tokens(ids)
    blocks = prefix.new_zeros(2, 9, nB, c.hidden_size)
    mlp_out, expected_aux, sublayer_outs = None, {}, {}
    for i, layer in enumerate(m.layers):
        write = i % Bs == 0
        nprev = math.ceil(i / Bs)
        prefix, h = _contract_attn_res(prefix, mlp_out, blocks, layer.self_attention_res_norm,
                                       layer.self_attention_res_proj, layer.input_layernorm, nprev,
                                       i // Bs if write else -1)
        attn_out = layer.self_attn(h)
        delta = attn_out
        if write:
            prefix, delta = attn_out, None
        prefix, h = _contract_attn_res(prefix, delta, blocks, layer.mlp_res_norm, layer.mlp_res_proj,
                                       layer.post_attention_layernorm, nprev + write, -1)
        mlp_out = layer.ffn(h)
        expected_aux[i] = prefix + mlp_out
        sublayer_outs[i] = attn_out + mlp_out
    _, final = _contract_attn_res(prefix, mlp_out, blocks, m.output_attn_res_norm, m.output_attn_res_proj,
                                  None, nB, -1)
    expected_logits = model.lm_head(m.norm(final))
    with pytest.raises(ValueError, match=r"aux_layer_ids: \[3, 0, 2\] must be strictly increasing"):
        model(ids, aux_layer_ids=[3, 0, 2])  # the same rule as Qwen3: the features follow layer order
    logits, aux = model(ids, aux_layer_ids=[0, 2, 3])
    assert (logits - expected_logits).abs().max() < 1e-5
    d = c.hidden_size
    assert aux.shape == (2, 9, 3 * d)
    for slot, i in enumerate([0, 2, 3]):
        assert (aux[..., slot * d:(slot + 1) * d] - expected_aux[i]).abs().max() < 1e-5
    # partial current-block sums, stated directly: block 0 = layers 0..1, block 1 = layers 2..3
    assert (aux[..., :d] - sublayer_outs[0]).abs().max() < 1e-5
    assert (aux[..., 2 * d:] - (sublayer_outs[2] + sublayer_outs[3])).abs().max() < 1e-5
    torch.testing.assert_close(model(ids), logits)


@torch.no_grad()
def test_aux_plain_residual_stream_and_id_validation():
    model = _model(seed=6, attn_res_block_size=None)
    ids = _ids(1, 6)
    captured = {}
    for i, layer in enumerate(model.model.layers):
        layer.post_attention_layernorm.register_forward_hook(
            lambda mod, inp, out, i=i: captured.__setitem__(i, inp[0]))
    logits, aux = model(ids, aux_layer_ids=[1])
    h = model.model.layers[1].ffn(model.model.layers[1].post_attention_layernorm(captured[1]))
    assert (aux - (captured[1] + h)).abs().max() < 1e-5  # hidden + residual after layer 1
    for bad in (-1, 4):
        with pytest.raises(ValueError, match=rf"aux_layer_ids.*{bad}.*0\.\.3"):
            model(ids, aux_layer_ids=[0, bad])


def test_attn_res_vectorised_equals_naive():
    torch.manual_seed(0)
    from dspark.models.layers import RMSNorm
    norm, proj = RMSNorm(8, eps=1e-5), torch.nn.Linear(8, 1, bias=False)
    with torch.no_grad():
        norm.weight.add_(torch.randn(8) * 0.3)
        proj.weight.normal_()
    srcs = [torch.randn(2, 3, 8) * s for s in (1.0, 3.0, 0.5)]
    torch.testing.assert_close(attn_res(srcs, norm, proj), attn_res_naive(srcs, norm, proj))
    with torch.no_grad():
        proj.weight.zero_()  # zero pseudo-query: the uniform average
    torch.testing.assert_close(attn_res(srcs, norm, proj), sum(srcs) / 3)


def test_training_backward_and_on_step_end():
    model = _model(seed=7).train()
    ids = _ids(2, 20)
    loss = torch.nn.functional.cross_entropy(model(ids)[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1))
    loss.backward()
    assert model.model.layers[1].self_attn.A_log.grad is not None
    assert model.model.layers[3].self_attention_res_proj.weight.grad.abs().sum() > 0
    before = model.model.layers[1].block_sparse_moe.gate.e_score_correction_bias.clone()
    model.on_step_end()
    after = model.model.layers[1].block_sparse_moe.gate.e_score_correction_bias
    assert not torch.equal(before, after) and abs(float(after.mean())) < 1e-6
