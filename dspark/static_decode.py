"""Graph-safe static decoding for the Qwen3 target (gpt-fast style): static KV cache, fused projections, CUDA graphs.

    fused = fuse_projections(model)                                          # once: fused weight copies
    out = generate_greedy(model, prompt_ids, 64, graphs=True, fused=fused)   # [B, 64] greedy tokens

- `StaticCache` / `StaticBatch`: per layer one contiguous [B, max_len, C] store of [k|v] rows (the layout
  `Qwen3Attention` writes through `batch.cache.attn_append`), lengths as a device tensor. A `StaticBatch` is a
  ForwardBatch for T new tokens per row built from device ops only (no .item(), no host branching on values):
  attention runs over the whole max_len under a mask, rows are written with `index_copy_` at slots computed on the
  device. So `Qwen3ForCausalLM.forward(ids, batch=...)` unchanged can be captured in a CUDA graph.
- `fuse_projections(model)` -> `FusedQwen3`: an inference-only forward over a StaticBatch with one [q|k|v] and one
  [gate|up] matmul per layer (weights concatenated once; the model and its checkpoint names stay untouched),
  residual adds folded into the o/down matmuls (`addmm_`), q/k-norm + RoPE in four kernels written back into the
  qkv output. Norms use torch's fused `rms_norm` (fp32 math, one rounding), so in bf16 it differs from the module
  path by rounding only. `compile=True` also runs each layer's glue through torch.compile (optional).
  `kernels=True` (default): a one-token step (B*T = 1, the bs=1 decode) on CUDA runs five launches per layer
  instead: matvecs with the RMSNorm / silu*mul prologue and the residual add fused in (kernels/decode_gemv.py) and
  one q/k-norm + RoPE + cache write + attention kernel (kernels/decode_attention.py). Other shapes (verify
  steps, batches) keep cuBLAS, which reads each weight once for all tokens.
- `GraphDecoder`: one `torch.cuda.CUDAGraph` per (batch-size bucket, T) of plan + forward + greedy argmax, with
  static input/output buffers; `step(ids)` = copy in, replay, advance lengths on the device. T=1 decodes, T=k+1
  verifies (`advance=False`, then `batch.commit(n_keep)` with a device tensor).
Cost of the design: every step attends over max_len keys (masked), so keep max_len near what a request needs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark.kernels import use_triton
from dspark.kernels.decode_attention import decode_attention, rope_inv_freq
from dspark.kernels.decode_gemv import decode_gemv
from dspark.models.layers import rope_cos_sin


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class StaticCache:
    """Contiguous KV stores {layer: [B, max_len, C]} and per-row lengths [B] (long, on the model's device)."""

    def __init__(self, model, batch_size: int, max_len: int, device=None, dtype=None):
        p = next(model.parameters())
        device, dtype = device or p.device, dtype or p.dtype
        attn, kda = model.cache_layout()
        if kda:
            raise ValueError("StaticCache: attention-only targets (Qwen3) expected; this target has KDA layers")
        self.B, self.max_len = batch_size, max_len
        self.kv = {layer: torch.zeros(batch_size, max_len, C, device=device, dtype=dtype) for layer, C in attn.items()}
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)

    def reset(self, length: int = 0) -> None:
        self.lengths.fill_(length)


class StaticBatch:
    """What `Qwen3ForCausalLM.forward(ids, batch=...)` needs (positions / valid / key_mask / cache.attn_append) for
    the first `rows` sequences of a StaticCache with T new tokens each. Positions, valid flags, the key mask and
    the write slots derive from the cache's current device lengths; `plan()` (before every forward:
    `forward_static` calls it, inside the captured region when graphing) drops the last forward's, and each is
    recomputed on first use, so a forward pays only for what it reads (the fused decode kernels read none).
    The batch is its own CacheView: it owns the write slots."""

    record = False

    def __init__(self, static_cache: StaticCache, rows: int, T: int):
        if not 1 <= rows <= static_cache.B:
            raise ValueError(f"rows: expected 1..{static_cache.B}, got {rows}")
        if T > static_cache.max_len:
            raise ValueError(f"T: {T} new tokens exceed max_len={static_cache.max_len}")
        self.static_cache, self.rows, self.T = static_cache, rows, T
        self.cache = self
        self.device = static_cache.lengths.device
        self.num_new = torch.full((rows,), T, dtype=torch.long, device=self.device)  # every new token is valid
        self.plan()

    def plan(self) -> None:
        self._planned: dict[str, torch.Tensor] = {}

    def _derived(self, name: str) -> torch.Tensor:
        if name not in self._planned:
            rows, T, L, dev = self.rows, self.T, self.static_cache.max_len, self.device
            if name == "pos":  # [rows, T]
                value = self.static_cache.lengths[:rows, None] + torch.arange(T, device=dev)
            elif name == "valid":  # [rows, T]
                value = torch.arange(T, device=dev)[None] < self.num_new[:, None]
            elif name == "mask":  # [rows, 1, T, L]
                value = (torch.arange(L, device=dev)[None, None] <= self._derived("pos")[:, :, None])[:, None]
            else:  # "slots": flat row index into store.view(rows * L, C); callers keep lengths + T <= max_len
                value = (torch.arange(rows, device=dev)[:, None] * L + self._derived("pos").clamp(max=L - 1)).flatten()
            self._planned[name] = value
        return self._planned[name]

    @property
    def slots(self) -> torch.Tensor:
        return self._derived("slots")

    def _check(self, T: int) -> None:
        if T != self.T:
            raise ValueError(f"StaticBatch: planned for T={self.T}, the forward has T={T}")

    def positions(self, T: int) -> torch.Tensor:
        self._check(T)
        return self._derived("pos")

    def valid(self, T: int) -> torch.Tensor:
        self._check(T)
        return self._derived("valid")

    def key_mask(self, T: int, L: int) -> torch.Tensor:
        self._check(T)
        if L != self.static_cache.max_len:
            raise ValueError(f"key_mask: the static cache has L=max_len={self.static_cache.max_len}, got {L}")
        return self._derived("mask")

    def attn_append(self, layer: int, new: torch.Tensor) -> torch.Tensor:
        """new [rows, T, C] -> writes row (b, t) at slot lengths[b] + t; returns the whole store [rows, max_len, C]."""
        store = self.static_cache.kv[layer][: self.rows]
        store.view(-1, store.shape[-1]).index_copy_(0, self.slots, new.reshape(-1, new.shape[-1]).to(store.dtype))
        return store

    def commit(self, n_keep: torch.Tensor | int | None = None) -> None:
        """Keep n_keep new tokens per row (default all T): lengths += n_keep, on the device. Rows written past the
        kept length are overwritten by the next forward."""
        self.static_cache.lengths[: self.rows] += self.num_new if n_keep is None else n_keep


def forward_static(fwd, input_ids: torch.Tensor, batch: StaticBatch) -> torch.Tensor:
    """One forward over a static batch: plan from the current lengths, run. `fwd` is the model or a FusedQwen3."""
    batch.plan()
    return fwd(input_ids, batch=batch)


# ---------------------------------------------------------------------------------------------- fused projections
def attend(qkv, store, slots, bias, wc, ws, H: int, Hkv: int, eps: float) -> torch.Tensor:
    """The attention half of a Qwen3 layer from the fused projection qkv [B, T, (H + 2*Hkv) * D]: q/k norm + RoPE
    (in place on qkv), the [k|v] rows into the layer's cache store [B, L, C] at the flat `slots`, GQA attention
    under the additive mask bias [B, 1, G*T, L] (row g*T + t = head g of a kv group, token t) -> o [B*T, H*D].
    wc/ws [B, T, H+Hkv, D]: q/k-norm weight folded into NeoX RoPE (see FusedQwen3._rope_tables)."""
    B, T = qkv.shape[:2]
    D = wc.shape[-1]
    G, half = H // Hkv, D // 2
    qk = qkv[..., : (H + Hkv) * D].unflatten(-1, (H + Hkv, D))
    xn = F.rms_norm(qk, (D,), None, eps)  # q/k norm without weight, then (xn*w)*cos + rotate_half(xn*w)*sin:
    if torch.compiler.is_compiling():  # dynamo takes no strided out=; inductor fuses the copy anyway
        qk.copy_(xn * wc)
    else:
        torch.mul(xn, wc, out=qk)
    qk[..., :half].addcmul_(xn[..., half:], ws[..., :half])
    qk[..., half:].addcmul_(xn[..., :half], ws[..., half:])
    C = store.shape[-1]
    store.view(-1, C).index_copy_(0, slots, qkv[..., H * D:].reshape(B * T, C))  # the [k|v] rows
    kv = store.view(B, store.shape[1], 2, Hkv, D)
    q = qkv[..., : H * D].view(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
    o = F.scaled_dot_product_attention(q, kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2), attn_mask=bias)
    return o.view(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B * T, H * D)


def fused_layer(h, store, slots, bias, wc, ws, ln1, w_qkv, w_o, ln2, w_gate_up, w_down,
                H: int, Hkv: int, eps: float) -> None:
    """One Qwen3 decoder layer, in place on the residual stream h [B, T, hidden] and the layer's cache store
    [B, L, C] (see `attend` for slots / bias / wc / ws). A function of tensors only, so torch.compile can fuse its
    element-wise ops."""
    B, T, hidden = h.shape
    h2 = h.view(B * T, hidden)
    qkv = F.linear(F.rms_norm(h, (hidden,), ln1, eps), w_qkv)  # [B, T, (H + 2*Hkv) * D]
    h2.addmm_(attend(qkv, store, slots, bias, wc, ws, H, Hkv, eps), w_o.t())  # h += o_proj(o)
    gate, up = F.linear(F.rms_norm(h, (hidden,), ln2, eps), w_gate_up).chunk(2, dim=-1)
    h2.addmm_((F.silu(gate) * up).view(B * T, -1), w_down.t())  # h += mlp(.)


class FusedQwen3:
    """Inference-only forward of a Qwen3ForCausalLM over a StaticBatch: `fused(ids, batch=...)` -> logits.
    Fused [q|k|v] / [gate|up] weights are copies made once (about 9 GB extra at 8B); o_proj, down_proj, norms,
    embedding and lm_head are the model's own tensors. The model, its state_dict names and checkpoints are
    untouched. compile=True runs `fused_layer` through torch.compile (element-wise ops fused into Triton kernels on
    CUDA; one compilation per input shape, reused by every layer). kernels=True: the bs=1 one-token step through
    the fused decode kernels (see the module docstring)."""

    def __init__(self, model, compile: bool = False, kernels: bool = True):
        c = model.config
        if c.attention_bias:
            raise ValueError("fuse_projections: attention_bias=True is not supported (Qwen3 checkpoints have none)")
        self.model = model
        self.H, self.Hkv, self.D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.eps, self.rope_theta = c.rms_norm_eps, model.rope_theta
        layers = model.model.layers
        with torch.no_grad():
            self.w_qkv = [torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
                          for a in (layer.self_attn for layer in layers)]
            self.w_gate_up = [torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]) for layer in layers]
            # q_norm / k_norm weights laid out over the [q heads | k heads] of the fused output: [layers, H+Hkv, D]
            self.qk_norm = torch.stack([torch.cat([layer.self_attn.q_norm.weight.expand(self.H, self.D),
                                                   layer.self_attn.k_norm.weight.expand(self.Hkv, self.D)])
                                        for layer in layers])
        half = self.D // 2
        self.rot_sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(self.qk_norm)  # rotate_half = roll * sign
        self.layer = torch.compile(fused_layer, dynamic=False) if compile else fused_layer
        self.kernels = kernels
        self.inv_freq = rope_inv_freq(self.D, self.rope_theta, device=self.rot_sign.device)

    def _rope_tables(self, batch, T: int, dtype):
        """Every layer's q/k-norm weight w folded into NeoX RoPE: (xn*w)*cos + rotate_half(xn*w)*sin =
        xn*wc + roll(xn, D/2)*ws with wc = w*cos, ws = roll(w, D/2)*sin*[-1..-1, 1..1]. -> [layers, B, T, H+Hkv, D]."""
        cos, sin = rope_cos_sin(batch.positions(T), self.D, self.rope_theta, dtype=dtype)  # [B, T, D]
        w = self.qk_norm[:, None, None]
        return w * cos[None, :, :, None], w.roll(self.D // 2, -1) * (sin * self.rot_sign)[None, :, :, None]

    def _attn_bias(self, batch, T: int, dtype):
        L = batch.static_cache.max_len
        mask = batch.key_mask(T, L)  # [B, 1, T, L] bool
        B, G = mask.shape[0], self.H // self.Hkv
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        return bias[:, :, None].expand(B, 1, G, T, L).reshape(B, 1, G * T, L)

    def __call__(self, input_ids: torch.Tensor, batch: StaticBatch) -> torch.Tensor:
        m = self.model.model
        if self.kernels and input_ids.shape == (1, 1) and use_triton(m.embed_tokens.weight):
            return self._decode_kernels(input_ids, batch)
        T = input_ids.shape[1]
        h = F.embedding(input_ids, m.embed_tokens.weight)  # [B, T, hidden], updated in place layer by layer
        wc, ws = self._rope_tables(batch, T, h.dtype)
        bias = self._attn_bias(batch, T, h.dtype)
        for i, layer in enumerate(m.layers):
            self.layer(h, batch.static_cache.kv[i][: batch.rows], batch.slots, bias, wc[i], ws[i],
                       layer.input_layernorm.weight, self.w_qkv[i], layer.self_attn.o_proj.weight,
                       layer.post_attention_layernorm.weight, self.w_gate_up[i], layer.mlp.down_proj.weight,
                       self.H, self.Hkv, self.eps)
        return F.linear(F.rms_norm(h, (h.shape[-1],), m.norm.weight, self.eps), self.model.lm_head.weight)

    def _decode_kernels(self, input_ids: torch.Tensor, batch: StaticBatch) -> torch.Tensor:
        """The bs=1 one-token step ([1, 1] ids): five launches per layer, the decode matvecs (norm / silu*mul
        prologues and the residual add fused in) and the one-launch decode_attention kernel. Verify steps of several
        tokens take the cuBLAS path of __call__ (measured faster than matvecs that read W once per token)."""
        m, eps = self.model.model, self.eps
        h = F.embedding(input_ids.view(1), m.embed_tokens.weight)  # [1, hidden], updated in place
        lengths = batch.static_cache.lengths[:1]  # the new token's position
        for i, layer in enumerate(m.layers):
            a, store = layer.self_attn, batch.static_cache.kv[i][:1]
            qkv = decode_gemv(h, self.w_qkv[i], "rmsnorm", layer.input_layernorm.weight, eps)
            o = decode_attention(qkv, store, lengths, a.q_norm.weight, a.k_norm.weight, self.inv_freq,
                                 self.rope_theta, self.H, self.Hkv, eps)
            decode_gemv(o, a.o_proj.weight, residual=h, out=h)
            gate_up = decode_gemv(h, self.w_gate_up[i], "rmsnorm", layer.post_attention_layernorm.weight, eps)
            decode_gemv(gate_up, layer.mlp.down_proj.weight, "silu_mul", residual=h, out=h)
        return decode_gemv(h, self.model.lm_head.weight, "rmsnorm", m.norm.weight, eps).view(1, 1, -1)


def fuse_projections(model, compile: bool = False, kernels: bool = True) -> FusedQwen3:
    """Fused [q|k|v] and [gate|up] weights per layer, for inference only (see FusedQwen3)."""
    return FusedQwen3(model, compile, kernels)


# ---------------------------------------------------------------------------------------------------- CUDA graphs
class _Graph:
    def __init__(self, graph, ids, batch, logits, tokens):
        self.graph, self.ids, self.batch, self.logits, self.tokens = graph, ids, batch, logits, tokens


class GraphDecoder:
    """CUDA graphs of plan + `fwd(ids[b, T], batch)` + argmax over a StaticCache, one per (batch-size bucket, T),
    captured on first use (or by `capture`). All graphs share one memory pool (they never run concurrently)."""

    def __init__(self, fwd, static_cache: StaticCache, buckets=(1,), warmup: int = 2):
        if static_cache.lengths.device.type != "cuda":
            raise ValueError("GraphDecoder: needs a StaticCache on a CUDA device")
        if not buckets or max(buckets) > static_cache.B:
            raise ValueError(f"buckets: expected sizes in 1..{static_cache.B}, got {buckets}")
        self.fwd, self.static_cache, self.buckets, self.warmup = fwd, static_cache, sorted(buckets), warmup
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = None

    @torch.no_grad()
    def capture(self, rows: int, T: int) -> _Graph:
        batch = StaticBatch(self.static_cache, rows, T)
        ids = torch.zeros(rows, T, dtype=torch.long, device=self.static_cache.lengths.device)

        def run():
            logits = forward_static(self.fwd, ids, batch)
            return logits, logits.argmax(-1)

        # warm-up on a side stream (cuBLAS handles, allocator); its cache writes land past the committed lengths
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits, tokens = run()
        self.pool = graph.pool()
        self.graphs[(rows, T)] = _Graph(graph, ids, batch, logits, tokens)
        return self.graphs[(rows, T)]

    @torch.no_grad()
    def step(self, ids: torch.Tensor, advance: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [b, T] (device) -> (logits [b, T, V], greedy tokens [b, T]): views of the graph's static outputs,
        valid until that graph's next replay. advance=True commits all T tokens (lengths += T on the device)."""
        b, T = ids.shape
        bucket = next((r for r in self.buckets if r >= b), None)
        if bucket is None:
            raise ValueError(f"step: batch of {b} rows exceeds the largest bucket {self.buckets[-1]}")
        g = self.graphs.get((bucket, T)) or self.capture(bucket, T)
        g.ids[:b].copy_(ids)
        g.graph.replay()
        if advance:
            self.static_cache.lengths[:b] += T
        return g.logits[:b], g.tokens[:b]


@torch.no_grad()
def generate_greedy(model, prompt_ids, max_new_tokens: int, graphs: bool = True, fused: FusedQwen3 | None = None,
                    max_len: int | None = None) -> torch.Tensor:
    """prompt_ids [B, P] (or one list of ids) -> the next max_new_tokens greedy tokens [B, N] (device; no EOS stop).
    Prefill runs eagerly through `model` into a fresh StaticCache, decode steps through `fused` (or `model`), in
    CUDA graphs when graphs=True. No host synchronisation per token: tokens stay on the device until returned."""
    dev = next(model.parameters()).device
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=dev)
    ids = ids[None] if ids.dim() == 1 else ids
    B, P = ids.shape
    need = P + max_new_tokens
    max_len = max_len or _round_up(need, 64)  # multiples of 64 keep the attention masks aligned
    if need > max_len:
        raise ValueError(f"max_len: {P} prompt + {max_new_tokens} new tokens exceed max_len={max_len}")
    static_cache = StaticCache(model, B, max_len)
    prefill = StaticBatch(static_cache, B, P)
    tok = forward_static(model, ids, prefill)[:, -1].argmax(-1)
    prefill.commit()
    out = torch.empty(B, max_new_tokens, dtype=torch.long, device=dev)
    out[:, 0] = tok
    decode_fwd = fused if fused is not None else model
    if graphs:
        decoder = GraphDecoder(decode_fwd, static_cache, buckets=(B,))
    else:
        step_batch = StaticBatch(static_cache, B, 1)
    for i in range(1, max_new_tokens):
        if graphs:
            tok = decoder.step(tok[:, None])[1][:, 0]
        else:
            tok = forward_static(decode_fwd, tok[:, None], step_batch)[:, -1].argmax(-1)
            step_batch.commit()
        out[:, i] = tok
    return out


__all__ = ["StaticCache", "StaticBatch", "forward_static", "FusedQwen3", "fuse_projections", "GraphDecoder",
           "generate_greedy"]
