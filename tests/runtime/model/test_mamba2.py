"""Mamba-2 layers (runtime/model/mamba2.py) against their definition and transformers' own Granite 4 module, and the
Granite 4 hybrid's config reading.

The definition, per head h of P channels reading group g(h) of B and C: [z | x B C | dt] = x W_in; x B C through a
depthwise causal convolution with bias and SiLU; dt = softplus(dt + dt_bias); S = exp(dt A) S + dt x B^T with
A = -exp(A_log); y = S C + D x; then y * SiLU(z) RMS-normed per group of channels (times its weight), out_proj.
Written out below in float64, one token at a time."""
import pytest
import torch

from conftest import hf_config
from helpers import require
from runtime.model.config import MoEConfig
from runtime.model.mamba2 import CHUNK, Mamba2, Mamba2Config

transformers = require("transformers", "the test-only reference")

HID, H, P, G, N, W = 32, 4, 8, 2, 6, 4
CFG = Mamba2Config(hidden_size=HID, num_heads=H, head_dim=P, num_groups=G, state_size=N, conv_kernel=W)


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.3            # noqa: E731
    conv = CFG.conv_dim
    return {"in_proj.weight": r(H * P + conv + H, HID), "conv1d.weight": r(conv, 1, W), "conv1d.bias": r(conv),
            "dt_bias": r(H), "A_log": r(H), "D": r(H), "norm.weight": 1 + r(H * P), "out_proj.weight": r(HID, H * P)}


def _oracle(w, x, eps=1e-6):
    """The definition in float64, token by token. x: [T, hidden] -> y [T, hidden], S [H, P, N]."""
    w = {k: v.double() for k, v in w.items()}
    x = x.double()
    conv, inner, GN = CFG.conv_dim, H * P, G * N
    hist = torch.zeros(conv, W, dtype=torch.float64)
    S = torch.zeros(H, P, N, dtype=torch.float64)
    A = -w["A_log"].exp()
    ys = []
    for t in range(x.shape[0]):
        p = w["in_proj.weight"] @ x[t]
        z, xbc, dt = p[:inner], p[inner:inner + conv], p[inner + conv:]
        hist = torch.cat([hist[:, 1:], xbc[:, None]], 1)
        xbc = torch.nn.functional.silu((hist * w["conv1d.weight"][:, 0]).sum(1) + w["conv1d.bias"])
        xs, B, C = xbc[:inner].reshape(H, P), xbc[inner:inner + GN].reshape(G, N), xbc[inner + GN:].reshape(G, N)
        dt = torch.nn.functional.softplus(dt + w["dt_bias"])
        y = torch.empty(H, P, dtype=torch.float64)
        for h in range(H):
            g = h // (H // G)
            S[h] = torch.exp(dt[h] * A[h]) * S[h] + dt[h] * torch.outer(xs[h], B[g])
            y[h] = S[h] @ C[g] + w["D"][h] * xs[h]
        y = (y.reshape(-1) * torch.nn.functional.silu(z)).reshape(G, -1)
        y = (y / torch.sqrt((y * y).mean(-1, keepdim=True) + eps)).reshape(-1) * w["norm.weight"]
        ys.append(w["out_proj.weight"] @ y)
    return torch.stack(ys), S


def test_prefill_in_chunks_and_decode_follow_the_definition():
    """150 tokens (three of the prefill's blocks) fed as 70 + 79, the state carried, then one decode token batched
    with a fresh sequence's first: against the definition."""
    w = _weights()
    layer = Mamba2(CFG, w)
    x = torch.randn(150, HID, generator=torch.Generator().manual_seed(1))
    assert x.shape[0] > 2 * CHUNK
    want, S_want = _oracle(w, x)
    y1, st = layer(x[:70])
    y2, st = layer(x[70:149], st)
    R = torch.stack([st.recurrent, torch.zeros(H, P, N)])
    C = torch.stack([st.conv, torch.zeros_like(st.conv)])
    y3, S, _ = layer.step(torch.stack([x[149], x[0]]), R, C)
    got = torch.cat([y1, y2, y3[:1]])
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() < 1e-4 * scale
    assert (S[0].double() - S_want).abs().max().item() < 1e-4 * S_want.abs().max().item()
    assert (y3[1].double() - want[0]).abs().max().item() < 1e-4 * scale


def test_equals_transformers_mamba_layer():
    """transformers' GraniteMoeHybridMambaLayer (its torch chunk scan, chunks of 16) on 100 tokens, then its recurrent
    step for two more from the states it cached: ours with the same weights."""
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as mg
    c = hf_config("granitemoehybrid")
    c.hidden_size, c.mamba_n_heads, c.mamba_d_head, c.mamba_n_groups, c.mamba_d_state = HID, H, P, G, N
    c.mamba_expand, c.mamba_chunk_size = H * P // HID, 16
    c.layer_types = ["linear_attention"] * c.num_hidden_layers
    torch.manual_seed(0)
    ref = mg.GraniteMoeHybridMambaLayer(c, layer_idx=0).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape) * 0.3 + (1.0 if p.dim() == 1 and p.shape[0] == H * P else 0.0))
    w = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ours = Mamba2(Mamba2Config(hidden_size=HID, num_heads=H, head_dim=P, num_groups=G, state_size=N, conv_kernel=W,
                               rms_norm_eps=c.rms_norm_eps), w)
    x = torch.randn(1, 102, HID, generator=torch.Generator().manual_seed(2))
    cache = mg.DynamicCache(config=c)
    with torch.no_grad():
        want = [ref(x[:, :100], cache=cache)] + [ref(x[:, t:t + 1], cache=cache) for t in (100, 101)]
    want = torch.cat(want, 1)[0]
    y, st = ours(x[0, :100])
    ys, R, C = [y], st.recurrent[None], st.conv[None]
    for t in (100, 101):
        y, R, C = ours.step(x[0, t:t + 1], R, C)
        ys.append(y)
    got = torch.cat(ys)
    assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item()


def test_granite4_config_reading():
    """The releases' layer_types names (mamba / attention) read as transformers'; NoPE attention unless
    position_embedding_type is rope; a dense Granite 4 and a clamped time step are refused by name."""
    d = hf_config("granitemoehybrid").to_dict()
    a = MoEConfig.from_dict(d)
    assert a.linear_layers == [0, 2] and a.nope_layers == [1] and a.linear.head_dim == 32
    released = {**d, "layer_types": ["mamba", "attention", "mamba"]}
    assert MoEConfig.from_dict(released) == a
    assert MoEConfig.from_dict({**d, "position_embedding_type": "rope"}).nope_layers == []
    with pytest.raises(ValueError, match="num_local_experts 0"):
        MoEConfig.from_dict({**d, "num_local_experts": 0})
    with pytest.raises(ValueError, match="time_step_limit"):
        MoEConfig.from_dict({**d, "time_step_limit": [0.0, 10.0]})
