"""tm_gdn_block (runtime/kernels/moe_cpu.c: a linear-attention layer's decode in one call - Gated DeltaNet of
Qwen3-Next / Qwen3.5, KDA of Kimi-Linear / K3) against the recurrence written out here in float64 from its
definition (Yang et al., "Gated Delta Networks"; transformers' Qwen3NextGatedDeltaNet and
KimiLinearDeltaAttention): h = rmsnorm(x); q|k|v (and, Gated DeltaNet, z|b|a in the same projection; KDA, b
from its own and the decay's f and the gate through rank-r factors) from h; the causal depthwise conv over
q|k|v from the slot's last W-1 inputs, then SiLU; q, k L2-normalised per key head (+1e-6 inside the root), q
by 1/sqrt(dk); per value head beta = sigmoid(b) and a decay exp(-exp(A_log) softplus(. + dt_bias)) of a (one
per head) or of f (one per key channel); S <- decay S (row by row), u = beta (v - S^T k), S <- S + k u^T,
o = S^T q; o rmsnorm'd, times norm, times silu(z) (KDA: sigmoid(gate)); x += o W_o. The state slots are
scattered in a larger arena: the others stay as they were. And every bad argument is refused before any
work (x and the arena untouched)."""
import ctypes

import pytest
import torch

from runtime import kernels

if kernels.lib() is None:
    pytest.skip(f"host kernels unavailable: {kernels.unavailable()}", allow_module_level=True)


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def gdn_case(hk=2, hv=4, dk=16, dv=8, W=4, state=(3, 0), slots=5, init=None, kind=0, rank=6):
    """The case's structs, tensors and float64 reference; ``init``: x / R / C to start from instead of the seeded
    ones. kind 0 Gated DeltaNet (one projection [q|k|v|z|b|a], a decay per head, SiLU gate); kind 1 KDA (hk = hv,
    dk = dv; q|k|v and b projections, the decay per key channel and the sigmoid gate through rank-``rank``
    factors)."""
    from runtime.model.layers.fused import GDNArgs, LayerArgs, StepArgs
    g = torch.Generator().manual_seed(11)
    H, E, B = 48, 8, len(state)
    if kind:
        hk, dv = hv, dk
    kd, cd = hk * dk, 2 * hk * dk + hv * dv
    pw = cd + hv * dv + 2 * hv
    width = 5 * hv * dk + hv + 2 * rank if kind else pw
    keep = []

    def t(*shape, scale=1.0):
        keep.append((torch.randn(*shape, generator=g) * scale).contiguous())
        return keep[-1]

    def lin(d, K_, N_):                      # float32 input-major [K, N] (tm_lin_desc kind 0)
        d.kind, d.K, d.N, d.W = 0, K_, N_, t(K_, N_, scale=K_ ** -0.5).data_ptr()
        return keep[-1]

    L, G, S = LayerArgs(), GDNArgs(), StepArgs()
    L.H, L.nh, L.nkv, L.hd, L.E, L.k, L.router = H, hv, 1, dk, E, 1, -1      # no router: the block stops at the logits
    L.eps, L.scale, L.route_scale = 1e-6, 1.0, 1.0
    in_norm, post_norm = t(H).abs_(), t(H).abs_()
    L.in_norm, L.post_norm = in_norm.data_ptr(), post_norm.data_ptr()
    Wo, _ = lin(L.o, hv * dv, H), lin(L.gate, H, E)
    G.kind, G.hk, G.hv, G.dk, G.dv, G.W, G.norm_eps, G.rank = kind, hk, hv, dk, dv, W, 1e-6, rank if kind else 0
    if kind:
        Win, Wfa, Wfb, Wb = lin(G.in_, H, cd), lin(G.f_a, H, rank), lin(G.f_b, rank, hv * dk), lin(G.b, H, hv)
        Wga, Wgb = lin(G.g_a, H, rank), lin(G.g_b, rank, hv * dk)
    else:
        Win = lin(G.in_, H, pw)
    conv, A_log, dt_bias, norm = t(cd, W, scale=0.5), t(hv, scale=0.5), t(hv * dk if kind else hv), t(dv).abs_()
    G.conv, G.A_log, G.dt_bias, G.norm = conv.data_ptr(), A_log.data_ptr(), dt_bias.data_ptr(), norm.data_ptr()
    R, C = t(slots, hv, dk, dv, scale=0.3), t(slots, cd, W - 1)
    st = torch.tensor(state, dtype=torch.int64)
    keep.append(st)
    G.R, G.C, G.slots, G.state = R.data_ptr(), C.data_ptr(), slots, st.data_ptr()
    x = t(B, H)
    for name, v in (init or {}).items():
        {"x": x, "R": R, "C": C}[name].copy_(v)
    # the paged-attention fields the step carries for the attention layers (unused here, checked present)
    wr, rd, pos = torch.zeros(B, dtype=torch.int64), torch.zeros(B, 1, dtype=torch.int64), torch.zeros(B, dtype=torch.int64)
    keep += [wr, rd, pos]
    S.B, S.n, S.nthreads, S.x = B, 1, 2, x.data_ptr()
    S.write, S.read, S.pos = wr.data_ptr(), rd.data_ptr(), pos.data_ptr()
    K_max = max(H, hv * dv, rank)
    for name, numel in (("h", B * H), ("qkv", B * width), ("att", B * hv * dv), ("tmp", B * H), ("scores", B * hv),
                        ("logits", B * E), ("wts", B), ("xd", B * kernels.lib().tm_q8_ldd(K_max))):
        setattr(S, name, t(numel).data_ptr())
    keep.append(torch.zeros(B * K_max, dtype=torch.int8))
    S.xq = keep[-1].data_ptr()
    S.cap_B, S.cap_n, S.cap_H, S.cap_qkv, S.cap_att, S.cap_heads, S.cap_E, S.cap_k, S.cap_K = \
        B, 1, H, width, hv * dv, hv, E, 1, K_max

    # the reference in float64, on copies taken before the call
    d = torch.float64
    xr, Rr, Cr = x.to(d), R.to(d).clone(), C.to(d).clone()
    hn = _rms(xr, in_norm.to(d), L.eps)
    p = hn @ Win.to(d)                                                      # p: [B, pw] (KDA: [B, cd])
    if kind:
        f = (hn @ Wfa.to(d) @ Wfb.to(d)).view(B, hv, dk) + dt_bias.to(d).view(hv, dk)
        beta_in, gate = hn @ Wb.to(d), (hn @ Wga.to(d) @ Wgb.to(d)).view(B, hv, dv)
    else:
        f = p[:, cd + hv * dv + hv:, None] + dt_bias.to(d)[:, None]       # [B, hv, 1]: one decay per head
        beta_in, gate = p[:, cd + hv * dv:cd + hv * dv + hv], p[:, cd:cd + hv * dv].view(B, hv, dv)
    act = torch.sigmoid if kind else (lambda v: v * torch.sigmoid(v))
    r = hv // hk
    silu = lambda v: v * torch.sigmoid(v)                                   # noqa: E731
    out = torch.zeros(B, hv, dv, dtype=d)
    for b, s in enumerate(state):
        window = torch.cat([Cr[s], p[b, :cd, None]], 1)                    # [cd, W]: oldest input first
        mixed = silu((window * conv.to(d)).sum(1))
        Cr[s] = window[:, 1:]
        q, k, v = mixed[:kd].view(hk, dk), mixed[kd:2 * kd].view(hk, dk), mixed[2 * kd:].view(hv, dv)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / dk ** 0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        for h in range(hv):
            beta = torch.sigmoid(beta_in[b, h])
            decay = torch.exp(-torch.exp(A_log[h].to(d)) * torch.nn.functional.softplus(f[b, h]))   # [dk] or [1]
            M = Rr[s, h] * decay[:, None]                                    # [dk, dv]: row i by its channel's decay
            u = beta * (v[h] - M.T @ k[h // r])
            M = M + torch.outer(k[h // r], u)
            Rr[s, h] = M
            o = M.T @ q[h // r]
            out[b, h] = _rms(o, norm.to(d), 1e-6) * act(gate[b, h])
    want_x = xr + out.reshape(B, hv * dv) @ Wo.to(d)
    return dict(L=L, G=G, S=S, x=x, R=R, C=C, st=st, want_x=want_x, want_R=Rr, want_C=Cr, keep=keep)


def gdn_call(t) -> int:
    return kernels.lib().tm_gdn_block(ctypes.byref(t["L"]), ctypes.byref(t["G"]), ctypes.byref(t["S"]))


@pytest.mark.parametrize("kind,hk,hv,W", [(0, 2, 4, 4), (0, 2, 2, 4), (0, 1, 3, 2), (1, 3, 3, 4), (1, 2, 2, 2)])
def test_gdn_block_against_the_recurrence(kind, hk, hv, W):
    t = gdn_case(hk=hk, hv=hv, W=W, kind=kind)
    assert gdn_call(t) == 0
    assert torch.allclose(t["x"].double(), t["want_x"], rtol=1e-4, atol=1e-4 * t["want_x"].abs().max().item())
    assert torch.allclose(t["R"].double(), t["want_R"], atol=1e-5 * t["want_R"].abs().max().item())
    assert torch.allclose(t["C"].double(), t["want_C"], atol=1e-6)         # slots 1, 2, 4 untouched, 0 and 3 shifted


@pytest.mark.parametrize("kind", [0, 1])
def test_gdn_block_decodes_a_sequence_token_by_token(kind):
    """Steps on the same slots: the state each call leaves is the one the next reads (the reference's fifth step
    starts from what the kernel's fourth left)."""
    t = gdn_case(kind=kind)
    for _ in range(4):
        assert gdn_call(t) == 0
    ref = gdn_case(init=dict(x=t["x"], R=t["R"], C=t["C"]), kind=kind)
    assert gdn_call(t) == 0
    assert torch.allclose(t["x"].double(), ref["want_x"], rtol=1e-4, atol=1e-4 * ref["want_x"].abs().max().item())
    assert torch.allclose(t["R"].double(), ref["want_R"], atol=1e-5 * ref["want_R"].abs().max().item())
    assert torch.allclose(t["C"].double(), ref["want_C"], atol=1e-6)


@pytest.mark.parametrize("where,change,code", [
    ("st", torch.tensor([5, 0]), kernels.E_SLOT),            # slot 5 of a 5-slot arena
    ("st", torch.tensor([-1, 0]), kernels.E_SLOT),
    ("st", torch.tensor([2, 2]), kernels.E_SLOT),            # two sequences on one slot
    ("G", {"slots": -1}, kernels.E_ARG),
    ("G", {"hv": 3}, kernels.E_ARG),                          # 3 value heads over 2 key heads
    ("G", {"W": 0}, kernels.E_ARG),
    ("G", {"R": None}, kernels.E_NULL),
    ("G", {"state": None}, kernels.E_NULL),
    ("L", {"nh": 2}, kernels.E_ARG),                          # the layer's heads are not the value heads
    ("S", {"cap_qkv": 100}, kernels.E_SCRATCH),               # the projection wider than the step's scratch
    ("S", {"B": 3}, kernels.E_SCRATCH),
    ("G", {"kind": 2}, kernels.E_ARG),
    ("K", {"rank": 0}, kernels.E_ARG),                        # KDA without its low-rank width
    ("K", {"dv": 8}, kernels.E_ARG),                          # KDA's values as wide as its keys
    ("K", {"cap_K": 4}, kernels.E_SCRATCH),                   # the q8 scratch narrower than the rank
])
def test_gdn_block_refuses(where, change, code):
    t = gdn_case(kind=1) if where == "K" else gdn_case()
    if where == "K":
        where = "S" if "cap_K" in change else "G"
    if where == "st":
        t["st"].copy_(change)
    else:
        for name, v in change.items():
            setattr(t[where], name, v)
    x, R, C = t["x"].clone(), t["R"].clone(), t["C"].clone()
    assert gdn_call(t) == code
    assert torch.equal(t["x"], x) and torch.equal(t["R"], R) and torch.equal(t["C"], C)   # refused before any work
