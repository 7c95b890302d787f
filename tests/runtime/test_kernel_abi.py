"""The host kernels' ABI (runtime/kernels/moe_cpu.c) refuses what it is not built for: every exported
entry point is called through ctypes with sizes and indices out of range - an expert's rows past the row
buffers, a gathered token past the input, a combine row past the rows computed, a position past its read
row, a cache slot past the cache, a batch past the step's scratch - and must return its error code (the
Python wrappers: KernelError naming the entry point and the code) without writing anything, where before
it wrote past a buffer or divided by zero. Plus: the fixed RoPE-in-place attention against torch, and two
threads sharing one Linear and one HostMoE (each call has its own arguments and scratch)."""
import ctypes
import os
import threading

import numpy as np
import pytest
import torch

from runtime import kernels
from runtime.kernels.moe import HostMoE
from runtime.quant import encode_expert, expert_weight_specs, get_format

if kernels.lib() is None:      # tests/conftest.py fails the run instead under TIERED_MOE_REQUIRE_HOST_KERNELS=1
    pytest.skip(f"host kernels unavailable: {kernels.unavailable()}", allow_module_level=True)

P = ctypes.c_void_p


@pytest.fixture(autouse=True)
def default_build():
    """The widest build (test_host_kernels.py runs every build; the checks here do not depend on it)."""
    kernels.reset()
    yield
    kernels.reset()


def experts(fmt: str, params: dict, H: int, I: int, n: int, bias: bool = False) -> tuple:
    g = torch.Generator().manual_seed(0)
    specs = expert_weight_specs(H, I, get_format(fmt, **params), torch.bfloat16 if bias else None)
    blobs = []
    for _ in range(n):
        gate, up, down = (torch.randn(s, generator=g) * 0.1 for s in ((I, H), (I, H), (H, I)))
        t = {"gate": gate, "up": up, "gate_up": torch.cat([gate, up]), "down": down}
        if bias:
            t["gate_up_bias"], t["down_bias"] = torch.randn(2 * I, generator=g), torch.randn(H, generator=g)
        blobs.append(encode_expert(specs, t))
    return specs, blobs


def refused(code: int, entry: str = "tm_moe"):
    """pytest.raises for a KernelError of this entry point and code."""
    return pytest.raises(kernels.KernelError, match=rf"^{entry} refused its arguments \(code {code}: ")


def test_sanitized_build():
    """Under tests/kernels_sanitize.sh (TIERED_MOE_KERNEL_SANITIZE=1) the loaded library is the ASan + UBSan
    one; otherwise the plain one."""
    want = os.environ.get("TIERED_MOE_KERNEL_SANITIZE") == "1"
    assert kernels.lib().tm_sanitized() == int(want)


def test_every_code_has_its_own_text():
    lib = kernels.lib()
    codes = [getattr(kernels, n) for n in dir(kernels) if n.startswith("E_")]
    texts = [lib.tm_strerror(c).decode() for c in codes]
    assert len(codes) == 12 and len(set(codes)) == 12 and len(set(texts)) == 12
    assert "unknown code" not in texts and lib.tm_strerror(-99).decode() == "unknown code"
    assert lib.tm_version() == kernels.ABI_VERSION


# ---- tm_moe ----------------------------------------------------------------------------------------------

H, I = 64, 64


@pytest.fixture(scope="module")
def moe():
    specs, blobs = experts("int4", {"group": 32, "scale_dtype": "bfloat16"}, H, I, 3)
    return HostMoE(specs, H, I, H), blobs


@pytest.mark.parametrize("row0,rows", [([0, 1, 2], [1, 1, 3]),        # past the 4 rows of xs / ys
                                       ([0, -1, 2], [1, 1, 1]),       # a negative first row
                                       ([0, 1, 2], [1, -1, 1]),       # a negative count
                                       ([0, 1, 2 ** 62], [1, 1, 2 ** 62])])   # row0 + rows overflowing int64
def test_moe_rows_outside_the_row_buffers(moe, row0, rows):
    kern, blobs = moe
    xs, ys = torch.randn(4, H), torch.full((4, H), float("nan"))
    with refused(kernels.E_ROWS):
        kern.run(blobs, row0, rows, xs, ys)
    assert ys.isnan().all()                                     # refused before any work
    kern.run(blobs, [0, 1, 2], [1, 1, 2], xs, ys)               # the same call in range
    assert not ys.isnan().any()


def test_moe_gather_and_combine_indices(moe):
    kern, blobs = moe
    T, k = 2, 2
    row0, rows = [0, 1, 3], [1, 2, 1]
    xin, wts = torch.randn(T, H), torch.rand(T, k)
    good_tok, good_back = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 2, 3])
    for tok, back, code in ((torch.tensor([0, 0, 2, 1]), good_back, kernels.E_TOK),     # token 2 of 2
                            (torch.tensor([0, -1, 1, 1]), good_back, kernels.E_TOK),
                            (good_tok, torch.tensor([0, 1, 2, 4]), kernels.E_BACK),     # row 4 of 4 computed
                            (good_tok, torch.tensor([0, -3, 2, 3]), kernels.E_BACK)):
        out = torch.full((T, H), 7.0)
        with refused(code):
            kern.run(blobs, row0, rows, torch.empty(4, H), torch.empty(4, H), gather=(xin, tok),
                     combine=(back, wts, out))
        assert (out == 7.0).all()
    # back may only name rows the experts compute: with rows 0..2 computed of 8 allocated, row 3 is refused
    out = torch.full((T, H), 7.0)
    with refused(kernels.E_BACK):
        kern.run(blobs[:2], [0, 1], [1, 2], torch.empty(8, H), torch.empty(8, H), gather=(xin, good_tok[:3]),
                 combine=(good_back, wts, out))
    kern.run(blobs, row0, rows, torch.empty(4, H), torch.empty(4, H), gather=(xin, good_tok),
             combine=(good_back, wts, out))
    assert (out != 7.0).all()


def test_moe_raw_struct_layouts_and_pointers(moe):
    """The struct filled by hand (as any other caller could): codes that used to divide by zero (an fp8
    tile or an int4 group of 0), unknown formats, a NULL weight, scratch smaller than the rows."""
    kern, blobs = moe
    lib = kernels.lib()
    xs, ys = torch.randn(4, H), torch.full((4, H), float("nan"))
    row0, rows = np.array([0, 1], np.int64), np.array([1, 3], np.int64)
    ptrs = np.concatenate([kern._row(b) for b in blobs[:2]])
    # buffers the bad calls point at, alive through them
    no_ptrs, tok, out, back, wts = np.zeros(16, np.int64), torch.zeros(4, dtype=torch.int64), torch.empty(2, H), \
        torch.zeros(2, dtype=torch.int64), torch.ones(2)

    def call(**change):
        a = kern._call(4)
        a.n_exp, a.nthreads = 2, 1
        a.row0, a.rows, a.ptrs, a.x, a.y = row0.ctypes.data, rows.ctypes.data, ptrs.ctypes.data, xs.data_ptr(), \
            ys.data_ptr()
        for k, v in change.items():
            setattr(a, k, v)
        return lib.tm_moe(ctypes.byref(a))

    with refused(kernels.E_GROUP):
        call(group=0)
    with refused(kernels.E_FP8):
        call(fmt=kernels.FMT_CODES["fp8_e4m3"], bo=0, bi=128)
    with refused(kernels.E_FP8):
        call(fmt=kernels.FMT_CODES["fp8_e4m3"], bo=128, bi=0)
    with refused(kernels.E_ARG):
        call(fmt=9)
    with refused(kernels.E_ARG):
        call(act=5)
    with refused(kernels.E_ARG):
        call(I=0)
    with refused(kernels.E_LAYOUT):
        call(H_in=48)
    with refused(kernels.E_ROWS):
        call(scratch_rows=3)                                   # h holds 3 rows, the experts use 4
    with refused(kernels.E_NULL):
        call(h=None)
    with refused(kernels.E_NULL):
        call(ptrs=no_ptrs.ctypes.data)                         # experts without weights
    with refused(kernels.E_NULL):
        call(tok=tok.data_ptr())                               # a gather without its input rows
    with refused(kernels.E_ARG):
        call(out=out.data_ptr(), back=back.data_ptr(), wts=wts.data_ptr(), T=2, k=0)
    assert ys.isnan().all()
    assert call() == 0 and not ys.isnan().any()


def test_moe_shapes_checked_in_python(moe):
    kern, blobs = moe
    with pytest.raises(ValueError, match="one entry per expert"):
        kern.run(blobs, [0, 1], [1, 1, 1], torch.randn(3, H), torch.empty(3, H))
    with pytest.raises(ValueError, match=r"rows must be \[n, 64\]"):
        kern.run(blobs, [0], [1], torch.randn(3, H + 1), torch.empty(3, H))
    with pytest.raises(ValueError, match="combine needs back"):
        kern.run(blobs[:1], [0], [1], torch.randn(1, H), torch.empty(1, H),
                 combine=(torch.zeros(1, dtype=torch.int64), torch.ones(1, 2), torch.empty(1, H)))


# ---- tm_linear_q / tm_linear_bf16 / tm_rms_norm -----------------------------------------------------------

def test_linear_q_scratch_and_layout():
    from runtime.model.layers.dense import Linear
    lin = Linear(torch.randn(40, 64), None, torch.float32, quant="int4", act_quant="q8")
    lib = kernels.lib()
    x, y = torch.randn(3, 64), torch.full((3, 40), float("nan"))
    xq, xd = torch.empty(3 * 64, dtype=torch.int8), torch.empty(3 * lib.tm_q8_ldd(64))

    def call(**change):
        a = kernels.LinArgs.from_buffer_copy(lin.args)
        a.n, a.nthreads, a.x, a.y, a.xq, a.xd, a.xq_rows = 3, 1, x.data_ptr(), y.data_ptr(), xq.data_ptr(), \
            xd.data_ptr(), 3
        for k, v in change.items():
            setattr(a, k, v)
        return lib.tm_linear_q(ctypes.byref(a))

    with refused(kernels.E_SCRATCH, "tm_linear_q"):
        call(xq_rows=2)                                        # q8 scratch of 2 rows for 3
    with refused(kernels.E_LAYOUT, "tm_linear_q"):
        call(K=48)
    with refused(kernels.E_GROUP, "tm_linear_q"):
        call(group=0)
    with refused(kernels.E_ARG, "tm_linear_q"):
        call(n=-1)
    with refused(kernels.E_NULL, "tm_linear_q"):
        call(xd=None)
    assert y.isnan().all()
    assert call() == 0 and torch.allclose(y, lin(x))


def test_linear_bf16_and_rms_norm_sizes():
    lib = kernels.lib()
    x, w, y = torch.randn(2, 32), torch.randn(8, 32).bfloat16(), torch.full((2, 8), float("nan"))
    for n, K, W, N, code in ((-1, 32, w.data_ptr(), 8, kernels.E_ARG), (2, 0, w.data_ptr(), 8, kernels.E_ARG),
                             (2, 32, w.data_ptr(), 0, kernels.E_ARG), (2, 32, None, 8, kernels.E_NULL)):
        with refused(code, "tm_linear_bf16"):
            lib.tm_linear_bf16(x.data_ptr(), n, K, W, N, y.data_ptr(), 1)
    assert y.isnan().all()
    xn, wn, out = torch.randn(3, 16), torch.ones(16), torch.full((3, 16), float("nan"))
    with refused(kernels.E_ARG, "tm_rms_norm"):
        lib.tm_rms_norm(xn.data_ptr(), 3, 16, wn.data_ptr(), 0, 1e-6, out.data_ptr())   # G = 0: was r % 0
    with refused(kernels.E_ARG, "tm_rms_norm"):
        lib.tm_rms_norm(xn.data_ptr(), 3, 0, wn.data_ptr(), 1, 1e-6, out.data_ptr())
    with refused(kernels.E_NULL, "tm_rms_norm"):
        lib.tm_rms_norm(xn.data_ptr(), 3, 16, None, 1, 1e-6, out.data_ptr())
    assert out.isnan().all()
    assert lib.tm_rms_norm(xn.data_ptr(), 0, 0, None, 1, 1e-6, None) == 0          # no rows: nothing to do
    assert lib.tm_rms_norm(xn.data_ptr(), 3, 16, wn.data_ptr(), 1, 1e-6, out.data_ptr()) == 0
    assert torch.allclose(out, xn * torch.rsqrt(xn.pow(2).mean(-1, keepdim=True) + 1e-6), atol=1e-6)
    assert lib.tm_linear_bf16(x.data_ptr(), 2, 32, w.data_ptr(), 8, y.data_ptr(), 1) == 0
    assert torch.allclose(y, x @ w.float().T, atol=1e-5)


# ---- tm_gqa_decode ---------------------------------------------------------------------------------------

def gqa_case(B=2, nh=4, nkv=2, hd=32, rd=16, n=6, slots=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ld = (nh + 2 * nkv) * hd
    c = dict(B=B, nh=nh, nkv=nkv, hd=hd, rd=rd, n=n, ld=ld)
    c["qkv"] = torch.randn(B, ld, generator=g)
    ang = torch.rand(B, rd // 2, generator=g) * 6
    c["cos"] = torch.cat([ang.cos(), ang.cos()], 1).contiguous()
    c["ssin"] = torch.cat([-ang.sin(), ang.sin()], 1).contiguous()             # the signed sin: x cos + roll(x) ssin
    c["K"], c["V"] = torch.randn(slots, nkv, hd, generator=g), torch.randn(slots, nkv, hd, generator=g)
    c["write"] = torch.tensor([3, 9][:B])
    c["pos"] = torch.tensor([2, 5][:B])
    read = torch.full((B, n), -1, dtype=torch.int64)                           # past pos: never read
    read[0, :3] = torch.tensor([1, 2, 3])
    if B > 1:
        read[1, :6] = torch.tensor([4, 5, 6, 7, 8, 9])
    c["read"] = read
    c["out"] = torch.full((B, nh * hd), float("nan"))
    c["scratch"] = torch.empty(B * nh * n)
    return c


def gqa_call(c, **change):
    c = {**c, **change}
    qkv = c["qkv"]
    return kernels.lib().tm_gqa_decode(
        qkv.data_ptr(), c["ld"], qkv.data_ptr() + (c["nh"] + c["nkv"]) * c["hd"] * 4, c["ld"], c["cos"].data_ptr(),
        c["ssin"].data_ptr(), c["rd"], c["K"].data_ptr(), c["V"].data_ptr(), c.get("slots", c["K"].shape[0]),
        c["write"].data_ptr(),
        c["read"].data_ptr(), c["n"], c["pos"].data_ptr(), c["B"], c["nh"], c["nkv"], c["hd"], (c["hd"] or 1) ** -0.5,
        None if c.get("sinks") is None else c["sinks"].data_ptr(), c["out"].data_ptr(), c["scratch"].data_ptr(), 2)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_gqa_decode_against_torch(with_sinks):
    """RoPE now rotates each channel pair in place (it copied the head into a 4 KB stack array): the
    output, the cache writes and the rotated q against torch. With sinks (gpt-oss), each head's softmax
    also takes its sink logit, which carries no value: written out here as transformers' eager attention
    does it (the sink appended as one more score column, dropped after the softmax)."""
    c = gqa_case()
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])[:c["nh"]] if with_sinks else None
    c["sinks"] = sinks
    B, nh, nkv, hd, rd = c["B"], c["nh"], c["nkv"], c["hd"], c["rd"]
    qk0 = c["qkv"][:, :(nh + nkv) * hd].reshape(B, nh + nkv, hd).clone()
    v = c["qkv"][:, (nh + nkv) * hd:].reshape(B, nkv, hd).clone()
    K, V = c["K"].clone(), c["V"].clone()
    rot = qk0[..., :rd]
    rot = rot * c["cos"][:, None] + torch.roll(rot, rd // 2, -1) * c["ssin"][:, None]
    qk = torch.cat([rot, qk0[..., rd:]], -1)
    for b in range(B):
        K[c["write"][b]], V[c["write"][b]] = qk[b, nh:], v[b]
    want = torch.empty(B, nh, hd)
    for b in range(B):
        idx = c["read"][b, :c["pos"][b] + 1]
        for h in range(nh):
            kv = h // (nh // nkv)
            scores = K[idx, kv] @ qk[b, h] * hd ** -0.5
            if sinks is not None:
                scores = torch.cat([scores, sinks[h:h + 1]])
            p = torch.softmax(scores, 0)[:len(idx)]
            want[b, h] = p @ V[idx, kv]
    assert gqa_call(c) == 0
    assert torch.allclose(c["out"], want.reshape(B, -1), atol=1e-5)
    assert torch.allclose(c["K"], K, atol=1e-6) and torch.equal(c["V"], V)
    assert torch.allclose(c["qkv"][:, :(nh + nkv) * hd].reshape(B, nh + nkv, hd), qk, atol=1e-6)


@pytest.mark.parametrize("change,code", [
    ({"pos": torch.tensor([2, 6])}, kernels.E_POS),            # position 6 of a read row of 6
    ({"pos": torch.tensor([-1, 5])}, kernels.E_POS),
    ({"write": torch.tensor([-1, 9])}, kernels.E_SLOT),
    ({"write": torch.tensor([3, 16])}, kernels.E_SLOT),        # one past the 16 slots the cache holds
    ({"read": torch.tensor([[1, -2, 3, 0, 0, 0], [4, 5, 6, 7, 8, 9]])}, kernels.E_SLOT),
    ({"read": torch.tensor([[1, 2, 3, 0, 0, 0], [4, 5, 6, 7, 8, 1 << 40]])}, kernels.E_SLOT),   # far past the cache
    ({"slots": 9}, kernels.E_SLOT),                            # a cache of 9 slots: slot 9 is past it
    ({"slots": -1}, kernels.E_ARG),
    ({"nh": 3}, kernels.E_ARG),                                # heads not a multiple of the kv heads
    ({"rd": 15}, kernels.E_ARG),                               # odd rotary width
    ({"rd": 34}, kernels.E_ARG),                               # rotary past the head
    ({"hd": 0}, kernels.E_ARG),
    ({"n": 0}, kernels.E_ARG),
])
def test_gqa_decode_refuses(change, code):
    c = gqa_case()
    K, qkv = c["K"].clone(), c["qkv"].clone()
    with refused(code, "tm_gqa_decode"):
        gqa_call(c, **change)
    assert torch.equal(c["K"], K) and torch.equal(c["qkv"], qkv) and c["out"].isnan().all()   # nothing written


# ---- tm_attn_block ---------------------------------------------------------------------------------------

def attn_case(router="softmax_topk", B=2, n=6, slots=16, E=8, k=2, n_group=1, topk_group=1):
    from runtime.model.layers.fused import ROUTER_CODES, LayerArgs, StepArgs
    g = torch.Generator().manual_seed(1)
    Hd, nh, nkv, hd = 64, 2, 1, 32
    ld = (nh + 2 * nkv) * hd
    keep = []

    def buf(*shape, dtype=torch.float32):
        t = torch.randn(*shape, generator=g).to(dtype) if dtype == torch.float32 else torch.zeros(*shape, dtype=dtype)
        keep.append(t)
        return t

    L = LayerArgs()
    L.H, L.nh, L.nkv, L.hd, L.rd, L.qk_norm, L.E, L.k = Hd, nh, nkv, hd, 16, 0, E, k
    L.router, L.renorm, L.n_group, L.topk_group = ROUTER_CODES[router], 1, n_group, topk_group
    L.eps, L.scale, L.route_scale = 1e-6, hd ** -0.5, 1.0
    L.in_norm, L.post_norm = buf(Hd).data_ptr(), buf(Hd).data_ptr()
    for name, K_, N_ in (("qkv", Hd, ld), ("o", nh * hd, Hd), ("gate", Hd, E)):
        d = getattr(L, name)
        d.kind, d.K, d.N, d.W = 0, K_, N_, buf(K_, N_).mul_(0.1).data_ptr()       # float32 input-major [K, N]
    cache_k, cache_v = buf(slots, nkv, hd), buf(slots, nkv, hd)
    L.K, L.V, L.slots = cache_k.data_ptr(), cache_v.data_ptr(), slots
    c = gqa_case(B=B, nh=nh, nkv=nkv, hd=hd, rd=16, n=n, slots=slots)
    S = StepArgs()
    S.B, S.n, S.nthreads = B, n, 2
    x = buf(B, Hd)
    S.x, S.cos, S.ssin = x.data_ptr(), c["cos"].data_ptr(), c["ssin"].data_ptr()
    S.write, S.read, S.pos = c["write"].data_ptr(), c["read"].data_ptr(), c["pos"].data_ptr()
    keep += [c["cos"], c["ssin"], c["write"], c["read"], c["pos"]]
    for name, numel in (("h", B * Hd), ("qkv", B * ld), ("att", B * nh * hd), ("tmp", B * Hd),
                        ("scores", B * nh * n), ("logits", B * E), ("wts", B * k),
                        ("xd", B * kernels.lib().tm_q8_ldd(Hd))):
        setattr(S, name, buf(numel).data_ptr())
    S.xq = buf(B * Hd, dtype=torch.int8).data_ptr()
    out = {}
    for name, numel in (("ids", B * k), ("n_used", 1), ("used", E), ("counts", E), ("row0", E), ("rows", E),
                        ("tok", B * k), ("back", B * k)):
        out[name] = buf(numel, dtype=torch.int64)
        setattr(S, name, out[name].data_ptr())
    S.cap_B, S.cap_n, S.cap_H, S.cap_qkv, S.cap_att, S.cap_heads, S.cap_E, S.cap_k, S.cap_K = \
        B, n, Hd, ld, nh * hd, nh, E, k, Hd
    return dict(L=L, S=S, x=x, cache_k=cache_k, out=out, c=c, keep=keep, B=B, k=k, E=E)


def attn_call(t) -> int:
    return kernels.lib().tm_attn_block(ctypes.byref(t["L"]), ctypes.byref(t["S"]))


@pytest.mark.parametrize("router,n_group,topk_group", [("softmax_topk", 1, 1), ("topk_softmax", 1, 1),
                                                       ("sigmoid_group", 4, 2), ("softmax_group", 4, 2)])
def test_attn_block_dispatch(router, n_group, topk_group):
    """A valid call (the router's scratch now on the heap): each (token, slot) sorted once by expert."""
    t = attn_case(router, n_group=n_group, topk_group=topk_group)
    assert attn_call(t) == 0
    o, B, k = t["out"], t["B"], t["k"]
    nu = int(o["n_used"][0])
    ids = o["ids"].view(B, k)
    assert ((ids >= 0) & (ids < t["E"])).all() and all(len(set(r.tolist())) == k for r in ids)
    assert o["rows"][:nu].sum().item() == B * k and sorted(o["back"].tolist()) == list(range(B * k))
    for i in range(B * k):                       # the sorted row of (token, slot) i holds token i // k
        assert o["tok"][o["back"][i]].item() == i // k
    if n_group > 1:                              # every chosen expert in one of the top-2 of 4 groups
        assert all(len({e // 2 for e in r.tolist()}) <= 2 for r in ids)


def refused_before_work(t, where, change, call, cache_key) -> int:
    """Apply ``change`` to the case's step tensors ("c") or argument struct ("L", "S", "M"), call, and check
    that x and the cache are untouched; returns the call's code."""
    for name, v in change.items():
        if where == "c":
            t["c"][name].copy_(v)
        else:
            setattr(t[where], name, v)
    x, cache = t["x"].clone(), t[cache_key].clone()
    code = call(t)
    assert torch.equal(t["x"], x) and torch.equal(t[cache_key], cache)    # refused before any work
    return code


@pytest.mark.parametrize("where,change,code", [
    ("c", {"write": torch.tensor([3, 16])}, kernels.E_SLOT),           # slot 16 of a 16-slot cache
    ("c", {"read": torch.tensor([[1, 2, 30, -1, -1, -1], [4, 5, 6, 7, 8, 9]])}, kernels.E_SLOT),
    ("c", {"pos": torch.tensor([6, 5])}, kernels.E_POS),
    ("S", {"B": 3}, kernels.E_SCRATCH),                                # a batch past the step's scratch
    ("S", {"n": 7}, kernels.E_SCRATCH),
    ("S", {"cap_K": 32}, kernels.E_SCRATCH),                           # q8 scratch narrower than the input
    ("S", {"tok": None}, kernels.E_NULL),
    ("L", {"slots": -1}, kernels.E_ARG),
    ("L", {"k": 9}, kernels.E_ARG),                                    # top-9 of 8 experts
    ("L", {"nkv": 3}, kernels.E_ARG),                                  # 2 heads over 3 kv heads
    ("L", {"rd": 33}, kernels.E_ARG),
    ("L", {"router": 2, "n_group": 3, "topk_group": 1}, kernels.E_ARG),  # 8 experts in 3 groups
    ("L", {"router": 2, "n_group": 4, "topk_group": 5}, kernels.E_ARG),
    ("L", {"E": 9}, kernels.E_LAYOUT),                                 # the router's width is 8
    ("L", {"H": 63}, kernels.E_LAYOUT),
])
def test_attn_block_refuses(where, change, code):
    # (layers/fused.py raises on the code, naming the layer)
    assert refused_before_work(attn_case(), where, change, attn_call, "cache_k") == code


# ---- tm_mla_block ----------------------------------------------------------------------------------------

def _rms(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _rope_ref(x, ang, mode):
    """The rotations by definition: "half" pairs channel i with i + d/2; "interleaved" (DeepSeek) pairs 2i with
    2i+1 and writes the pair's two results at i and i + d/2; "none" leaves x."""
    if mode == "none":
        return x
    c, s_ = ang.cos(), ang.sin()
    a, b = (x[..., 0::2], x[..., 1::2]) if mode == "interleaved" else x.chunk(2, dim=-1)
    return torch.cat([a * c - b * s_, b * c + a * s_], dim=-1)


def mla_case(rot="interleaved", q_lora=24, B=2, n=6, slots=16):
    """An MLA layer with float32 input-major projections and no router (the block stops at the logits), the
    step over gqa_case's slots, and the reference: each head's keys and values expanded from the cached
    latents through kv_b (no absorption), softmax attention, x + o(attention)."""
    from runtime.model.layers.fused import MLA_ROT, LayerArgs, MLAArgs, StepArgs
    g = torch.Generator().manual_seed(3)
    H, nh, nope, rope, vd, lat, E = 64, 2, 16, 8, 16, 32, 8
    qk, w = nope + rope, lat + rope
    keep = []

    def t(*shape, scale=1.0):
        keep.append((torch.randn(*shape, generator=g) * scale).contiguous())
        return keep[-1]

    def lin(d, K_, N_):
        d.kind, d.K, d.N, d.W = 0, K_, N_, t(K_, N_, scale=K_ ** -0.5).data_ptr()
        return keep[-1]

    L, M, S = LayerArgs(), MLAArgs(), StepArgs()
    L.H, L.nh, L.nkv, L.hd, L.E, L.k, L.router = H, nh, 1, qk, E, 1, -1
    L.eps, L.scale, L.route_scale = 1e-5, qk ** -0.5, 1.0
    in_norm, post_norm = t(H).abs_(), t(H).abs_()
    L.in_norm, L.post_norm = in_norm.data_ptr(), post_norm.data_ptr()
    Wo, _ = lin(L.o, nh * vd, H), lin(L.gate, H, E)
    M.nope, M.rope, M.vd, M.lat, M.q_lora, M.rot, M.lat_eps = nope, rope, vd, lat, q_lora, MLA_ROT[rot], 1e-6
    Wqa = lin(M.q_a, H, q_lora) if q_lora else None
    qa_norm = t(q_lora).abs_() if q_lora else None
    M.q_a_norm = qa_norm.data_ptr() if q_lora else None
    Wq, Wkva = lin(M.q, q_lora or H, nh * qk), lin(M.kv_a, H, w)
    kva_norm, kv_b = t(lat).abs_(), t(nh * (nope + vd), lat, scale=lat ** -0.5)
    M.kv_a_norm, M.kv_b = kva_norm.data_ptr(), kv_b.data_ptr()
    cache = t(slots, w)
    M.cache, M.slots = cache.data_ptr(), slots
    c = gqa_case(B=B, rd=rope, n=n, slots=slots)
    ang = torch.rand(B, rope // 2, generator=g) * 6
    cos, ssin = torch.cat([ang.cos(), ang.cos()], 1).contiguous(), torch.cat([-ang.sin(), ang.sin()], 1).contiguous()
    x = t(B, H)
    keep += [cos, ssin, c["write"], c["read"], c["pos"]]
    S.B, S.n, S.nthreads, S.x, S.cos, S.ssin = B, n, 2, x.data_ptr(), cos.data_ptr(), ssin.data_ptr()
    S.write, S.read, S.pos = c["write"].data_ptr(), c["read"].data_ptr(), c["pos"].data_ptr()
    qkv_w, att_w, K_max = nh * qk + w + q_lora, nh * (vd + 2 * lat), max(H, nh * vd, q_lora)
    for name, numel in (("h", B * H), ("qkv", B * qkv_w), ("att", B * att_w), ("tmp", B * H), ("scores", B * nh * n),
                        ("logits", B * E), ("wts", B), ("xd", B * kernels.lib().tm_q8_ldd(K_max))):
        setattr(S, name, t(numel).data_ptr())
    keep.append(torch.zeros(B * K_max, dtype=torch.int8))
    S.xq = keep[-1].data_ptr()
    S.cap_B, S.cap_n, S.cap_H, S.cap_qkv, S.cap_att, S.cap_heads, S.cap_E, S.cap_k, S.cap_K = \
        B, n, H, qkv_w, att_w, nh, E, 1, K_max

    # the reference, on copies taken before the call
    xr, cr = x.clone(), cache.clone()
    h = _rms(xr, in_norm, L.eps)
    q = (_rms(h @ Wqa, qa_norm, 1e-6) @ Wq if q_lora else h @ Wq).view(B, nh, qk)
    ckv = h @ Wkva
    for b in range(B):
        cr[c["write"][b]] = torch.cat([_rms(ckv[b, :lat], kva_norm, 1e-6), _rope_ref(ckv[b, lat:], ang[b], rot)])
    wkv = kv_b.view(nh, nope + vd, lat)
    att = torch.zeros(B, nh, vd)
    for b in range(B):
        rows = cr[c["read"][b, :c["pos"][b] + 1]]                                   # [m, lat + rope]
        for hh in range(nh):
            k = torch.cat([rows[:, :lat] @ wkv[hh, :nope].T, rows[:, lat:]], dim=1)    # [m, qk]
            v = rows[:, :lat] @ wkv[hh, nope:].T                                     # [m, vd]
            qh = torch.cat([q[b, hh, :nope], _rope_ref(q[b, hh, nope:], ang[b], rot)])
            att[b, hh] = torch.softmax(k @ qh * L.scale, 0) @ v
    want_x = xr + att.reshape(B, nh * vd) @ Wo
    return dict(L=L, M=M, S=S, x=x, cache=cache, want_x=want_x, want_cache=cr, keep=keep, c=c)


def mla_call(t) -> int:
    return kernels.lib().tm_mla_block(ctypes.byref(t["L"]), ctypes.byref(t["M"]), ctypes.byref(t["S"]))


@pytest.mark.parametrize("rot,q_lora", [("interleaved", 24), ("half", 0), ("none", 24)])
def test_mla_block_against_expanded_attention(rot, q_lora):
    """tm_mla_block (kv_b absorbed into the query and the output) against attention over keys and values
    expanded per head from the cached latents, for each rotation and both q paths."""
    t = mla_case(rot, q_lora)
    assert mla_call(t) == 0
    torch.testing.assert_close(t["cache"], t["want_cache"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(t["x"], t["want_x"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("where,change,code", [
    ("c", {"write": torch.tensor([3, 16])}, kernels.E_SLOT),
    ("c", {"pos": torch.tensor([6, 5])}, kernels.E_POS),
    ("S", {"cap_qkv": 100}, kernels.E_SCRATCH),                        # q, the latent rows and q_a's do not fit
    ("S", {"cap_att": 64}, kernels.E_SCRATCH),
    ("M", {"rot": 3}, kernels.E_ARG),
    ("M", {"rope": 7}, kernels.E_ARG),
    ("M", {"slots": -1}, kernels.E_ARG),
    ("M", {"q_lora": 20}, kernels.E_LAYOUT),                            # q_a's width is 24
    ("M", {"kv_b": None}, kernels.E_NULL),
])
def test_mla_block_refuses(where, change, code):
    assert refused_before_work(mla_case(), where, change, mla_call, "cache") == code


# ---- threads sharing one layer -----------------------------------------------------------------------------

def test_threads_sharing_a_linear_and_a_hostmoe():
    """The argument struct and the q8 scratch were one per Linear / HostMoE, so a second thread's call
    overwrote the first's pointers while its kernel ran; now each call fills its own."""
    from runtime.model.layers.dense import Linear
    lin = Linear(torch.randn(96, 256), None, torch.float32, quant="int4", act_quant="q8")
    specs, blobs = experts("mxfp4", {}, 128, 128, 2)
    kern = HostMoE(specs, 128, 128, 128, act_quant="q8")
    g = torch.Generator().manual_seed(5)
    xl = [torch.randn(1 + i % 3, 256, generator=g) for i in range(4)]
    xm = [torch.randn(3, 128, generator=g) for _ in range(4)]

    def moe(x):
        y = torch.empty(3, 128)
        kern.run(blobs, [0, 1], [1, 2], x, y)
        return y
    want_l, want_m = [lin(x) for x in xl], [moe(x) for x in xm]
    bad = []

    def worker(i):
        for _ in range(150):
            if not torch.equal(lin(xl[i]), want_l[i]) or not torch.equal(moe(xm[i]), want_m[i]):
                bad.append(i)
                return
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not bad
