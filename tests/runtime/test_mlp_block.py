"""tm_mlp_block (runtime/kernels/moe_cpu.c: a dense SwiGLU MLP after a fused block - a MoE block's shared experts,
gated or not, or a dense layer's MLP - in one call) against the MLP written out here in float64 from its definition:
x += [sigmoid(h . w_gate) *] down(silu(h W_g^T) * (h W_u^T)) on the step's post-norm rows h (DeepSeek-V4's
shared expert: silu(min(g, limit)) * clamp(u, +-limit)). The projections in each form a layer holds them in: float32,
bf16 kept as the checkpoint has it, int4 codes (--dense-quant int4: value (q - 8) x the scale of its group of 32,
element 2j in byte j's low nibble, 2j + 1 in its high one) with float or 8-bit activations (per 32 values a scale
amax / 127 and the codes rounded to nearest even, as llama.cpp's Q8_0); and every bad argument refused before any
work (x untouched)."""
import ctypes

import pytest
import torch

from runtime import kernels

if kernels.lib() is None:
    pytest.skip(f"host kernels unavailable: {kernels.unavailable()}", allow_module_level=True)


def _W(d, quant="none", act_quant="none", dtype=torch.float32):
    """The weights DenseMLP reads as a model's loader gives them: float32 compute, the --dense-quant options."""
    from runtime.model.layers.weights import DenseTensors
    return DenseTensors(d, "cpu", dtype, quant, act_quant)


def _deq(lin) -> torch.Tensor:
    """A Linear's weight [N, K] as the kernel reads it, float64, from the format's definition."""
    if lin.quant == "none":
        return (lin.w if lin.kept else lin.wt.t()).double()
    assert lin.quant == "int4" and lin.args.group == 32
    c = lin.codes.view(torch.uint8).long()                              # [N, K / 2]
    q = torch.stack([c & 15, c >> 4], -1).reshape(c.shape[0], -1)       # [N, K]: byte j -> elements 2j, 2j + 1
    s = lin.scales.double().repeat_interleave(32, 1)
    return (q - 8).double() * s


def _q8(x: torch.Tensor) -> torch.Tensor:
    """x [n, K] through 8-bit activations: per 32 values d = amax / 127, q = round-half-even(x / d), back to q d."""
    v = x.double().view(x.shape[0], -1, 32)
    d = v.abs().amax(-1, keepdim=True) / 127
    q = torch.round(torch.where(d > 0, v / torch.where(d > 0, d, 1), 0))
    return (q * d).view_as(x)


def mlp_case(form="f32", gated=True, limit=0.0, B=3, H=64, inter=96, seed=3):
    from runtime.model.layers.fused import MLPPart, StepArgs
    from runtime.model.layers.mlp import DenseMLP
    from runtime.model.layers.dense import Linear
    g = torch.Generator().manual_seed(seed)
    dt = torch.bfloat16 if form == "bf16" else torch.float32
    w = {p + ".weight": (torch.randn(*s, generator=g) * s[1] ** -0.5 * 2).to(dt)
         for p, s in (("gate_proj", (inter, H)), ("up_proj", (inter, H)), ("down_proj", (H, inter)))}
    quant, aq = {"f32": ("none", "none"), "bf16": ("none", "none"), "int4": ("int4", "none"),
                 "int4q8": ("int4", "q8")}[form]
    mlp = DenseMLP(_W(w, quant, aq), "", limit=limit)
    gate = Linear((torch.randn(1, H, generator=g) * H ** -0.5).to(dt), None, torch.float32) if gated else None
    part = MLPPart.build(mlp, gate)
    assert part is not None, form
    keep = []
    x, h = torch.randn(B, H, generator=g), torch.randn(B, H, generator=g)
    S = StepArgs()
    K_max = max(H, inter)
    for name, t in (("x", x), ("h", h), ("tmp", torch.zeros(B, H)), ("xq", torch.zeros(B * K_max, dtype=torch.int8)),
                    ("xd", torch.zeros(B * kernels.lib().tm_q8_ldd(K_max)))):
        keep.append(t)
        setattr(S, name, t.data_ptr())
    S.B, S.nthreads = B, 2
    S.cap_B, S.cap_H, S.cap_K = B, H, K_max

    # the reference, float64, on copies taken before the call
    act_in = _q8 if aq == "q8" else (lambda v: v.double())
    gu = act_in(h) @ _deq(mlp.gate_up).T                                # [B, 2 inter]
    gg, uu = gu[:, :inter], gu[:, inter:]
    if limit:
        gg, uu = gg.clamp(max=limit), uu.clamp(-limit, limit)
    a = gg * torch.sigmoid(gg) * uu
    out = act_in(a.float()) @ _deq(mlp.down).T
    if gated:
        out = out * torch.sigmoid(h.double() @ _deq(gate).T)
    return dict(part=part, S=S, x=x, want=x.double() + out, keep=keep, mlp=mlp, gate=gate)


def _run(c, B=None):
    return c["part"](kernels.lib(), c["S"], c["S"].B if B is None else B)


@pytest.mark.parametrize("form", ["f32", "bf16", "int4", "int4q8"])
@pytest.mark.parametrize("gated", [True, False])
def test_mlp_block_equals_definition(form, gated):
    c = mlp_case(form, gated)
    d = c["part"].args
    assert (d.gate_up.kind, d.down.kind) == {"f32": (0, 0), "bf16": (1, 1)}.get(form, (2, 2))
    _run(c)
    err = (c["x"].double() - c["want"]).abs().max().item()
    assert err <= 2e-5 * c["want"].abs().max().item(), (form, gated, err)


@pytest.mark.parametrize("B", [1, 4])
def test_mlp_block_clamped_and_batch_sizes(B):
    """DeepSeek-V4's clamped shared expert; one row and more rows than the step was first sized for (the part's
    scratch grows)."""
    c = mlp_case("bf16", gated=False, limit=0.5, B=B, seed=7)
    _run(c)
    assert (c["x"].double() - c["want"]).abs().max().item() <= 2e-5 * c["want"].abs().max().item()


def test_mlp_block_mutation_caught():
    """The comparison can fail: the gate's sigmoid left out of the reference is told apart."""
    c = mlp_case("f32", gated=True)
    _run(c)
    no_gate = mlp_case("f32", gated=False)["want"]
    assert (c["x"].double() - no_gate).abs().max().item() > 1e-3


@pytest.mark.parametrize("bad", ["act", "down_N", "gate_N", "scratch", "cap_K", "cap_B", "h_null", "W_null", "H"])
def test_mlp_block_refusals_touch_nothing(bad):
    c = mlp_case("int4q8", gated=True)
    part, S, M = c["part"], c["S"], c["part"].args
    part.scratch = torch.zeros(S.B * (3 * M.I + 1))
    M.scratch, M.scratch_n = part.scratch.data_ptr(), part.scratch.numel()
    setattr_ = {"act": lambda: setattr(M, "act", 1), "down_N": lambda: setattr(M.down, "N", M.down.N + 1),
                "gate_N": lambda: setattr(M.gate, "N", 2), "scratch": lambda: setattr(M, "scratch_n", M.scratch_n - 1),
                "cap_K": lambda: setattr(S, "cap_K", M.I - 1), "cap_B": lambda: setattr(S, "cap_B", S.B - 1),
                "h_null": lambda: setattr(S, "h", None), "W_null": lambda: setattr(M.down, "W", None),
                "H": lambda: setattr(M, "H", 0)}
    setattr_[bad]()
    x0 = c["x"].clone()
    rc = kernels.lib().tm_mlp_block(ctypes.byref(M), ctypes.byref(S))
    assert rc < 0, bad
    assert torch.equal(c["x"], x0), bad
    with pytest.raises(RuntimeError, match="fused MLP kernel refused"):
        part(kernels.lib(), S, S.B)


def test_mlp_part_declines_what_the_kernel_cannot_read():
    """A projection the kernels cannot read in place (float16 compute), or a gate of more than one output: no part
    (the MLP runs composed)."""
    from runtime.model.layers.fused import MLPPart
    from runtime.model.layers.mlp import DenseMLP
    from runtime.model.layers.dense import Linear
    w = {p + ".weight": torch.randn(*s) for p, s in (("gate_proj", (8, 32)), ("up_proj", (8, 32)),
                                                      ("down_proj", (32, 8)))}
    mlp = DenseMLP(_W(w), "")
    assert MLPPart.build(mlp) is not None
    assert MLPPart.build(mlp, Linear(torch.randn(2, 32), None, torch.float32)) is None
    assert MLPPart.build(DenseMLP(_W(w, dtype=torch.float16), "")) is None
    assert MLPPart.build(None) is None
