"""Host expert kernels: the candidates issue 18 names, measured on one expert shape per format, side
by side in one run (1 thread by default; the decode case: one token per expert).

Candidates run here:
  reference      dequantize (or widen) into a float32 scratch, then torch.mm (the path before the kernels)
  fp32 cache     float32 copies of the experts kept in memory (the old bf16 path: twice the bytes read)
  torch bf16     torch.mm on bf16 operands (bf16 experts)
  torch int4pack torch's own CPU int4 kernel (aten._weight_int4pack_mm_for_cpu on its repacked layout; what
                 torchao's Int4CPULayout calls), int4 experts - timing only, its layout is not ours
  torch int8pack aten._weight_int8pack_mm (int8 per-channel weights: a yardstick, not one of our formats)
  compile        torch.compile (Inductor's CPU code generation) of dequantize + matmul, int4 experts
  ours           runtime/kernels tm_moe: the stored bytes decoded in registers, one call for the layer
  ours q8        the same with 8-bit activations (--host-act-quant q8), mxfp4 / int4 / int8
  ours avx2      the base (AVX2) build of the kernels, where the CPU runs a wider one: what a CPU
                 without AVX-512 / VNNI gets
Not run, and why: torchao's CPU MoE path (da8w4) ships as a C++ extension built against its own torch
pin; kt-kernel pins an older torch and wants AMX; ggml-python builds ggml from source and one graph per
call - ggml itself is measured end to end in bench/vs_llama_cpp.py.

Each timed call computes a layer's ``--experts`` experts (drawn from a pool of 64, so weights come from
memory, not cache), one token each; reported: microseconds per expert and stored bytes read per
second. A second table times the crossover behind MAX_ROWS / GEMV_ROWS (tokens per expert at which
the reference's BLAS matmul beats the kernel).

Usage: python bench/host_kernels.py [--hidden 512 --inter 512] [--threads 1] [--out bench/results/host_kernels.md]
"""
import argparse
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from runtime import kernels  # noqa: E402
from runtime.kernels.moe import HostMoE  # noqa: E402
from runtime.quant import ExpertCodec, encode_expert, expert_weight_specs, get_format  # noqa: E402

POOL = 64
FORMATS = [("bf16", {}), ("mxfp4", {}), ("int4", {"group": 32, "scale_dtype": "bfloat16"}),
           ("int8", {"group": 32, "scale_dtype": "float16"}), ("fp8_e4m3", {"block": (128, 128)})]


def pool(fmt, params, H, I):
    g = torch.Generator().manual_seed(0)
    specs = expert_weight_specs(H, I, get_format(fmt, **params))
    blobs = []
    for _ in range(POOL):
        gate, up, down = (torch.randn(s, generator=g) * 0.05 for s in ((I, H), (I, H), (H, I)))
        blobs.append(encode_expert(specs, {"gate": gate, "up": up, "gate_up": torch.cat([gate, up]), "down": down}))
    return specs, blobs


def best_of(fn, reps):
    best = float("inf")
    for rep in range(reps):
        t0 = time.perf_counter()
        fn(rep)
        best = min(best, time.perf_counter() - t0)
    return best


def swiglu_mm(x, gu_t, dn_t, I):
    h = x @ gu_t
    return (torch.nn.functional.silu(h[:, :I]) * h[:, I:]) @ dn_t


def candidates(fmt, specs, blobs, H, I, n_exp, rows):
    """name -> callable(rep) computing n_exp experts of ``rows`` tokens each."""
    pick = lambda rep: [blobs[(rep * 13 + j * 7) % POOL] for j in range(n_exp)]   # noqa: E731
    x = torch.randn(n_exp * rows, H)
    out = {}
    codec = ExpertCodec(specs, torch.float32, "cpu")

    def reference(rep):
        for j, b in enumerate(pick(rep)):
            t = codec.weights(b)
            swiglu_mm(x[j * rows:(j + 1) * rows], t.gate_up_t, t.down_t, I)
    out["reference"] = reference
    if fmt == "bf16":
        f32 = [(b["gate_up.t"].float(), b["down.t"].float()) for b in blobs]
        out["fp32 cache"] = lambda rep: [swiglu_mm(x[j * rows:(j + 1) * rows], *f32[(rep * 13 + j * 7) % POOL], I)
                                         for j in range(n_exp)]
        xb = x.bfloat16()
        out["torch bf16"] = lambda rep: [swiglu_mm(xb[j * rows:(j + 1) * rows], b["gate_up.t"], b["down.t"], I)
                                         for j, b in enumerate(pick(rep))]
    if fmt == "int4":
        out.update(torch_int4(blobs, x, H, I, n_exp, rows))
    kern = HostMoE(specs, H, I, H)
    y = torch.empty_like(x)
    r0 = [j * rows for j in range(n_exp)]
    out["ours"] = lambda rep: kern.run(pick(rep), r0, [rows] * n_exp, x, y)
    if fmt in ("mxfp4", "int4", "int8"):
        kq = HostMoE(specs, H, I, H, act_quant="q8")
        out["ours q8"] = lambda rep: kq.run(pick(rep), r0, [rows] * n_exp, x, y)
    if kernels.isa() != "avx2":          # the base build, loaded beside the wide one for this comparison
        base = _avx2_kernel(specs, H, I, fmt in ("mxfp4", "int4", "int8"))
        if base is not None:
            out["ours avx2" + (" q8" if fmt in ("mxfp4", "int4", "int8") else "")] = \
                lambda rep: base.run(pick(rep), r0, [rows] * n_exp, x, y)
    return out


def _avx2_kernel(specs, H, I, q8: bool):
    """A HostMoE on the AVX2 build of the kernels (TIERED_MOE_HOST_ISA=avx2), or None."""
    os.environ["TIERED_MOE_HOST_ISA"] = "avx2"
    kernels.reset()
    try:
        return HostMoE(specs, H, I, H, act_quant="q8" if q8 else "none") if kernels.lib() is not None else None
    finally:
        del os.environ["TIERED_MOE_HOST_ISA"]
        kernels.reset()


def torch_int4(blobs, x, H, I, n_exp, rows):
    """torch's CPU int4 kernels on weights repacked into their layout (timing; and int8pack as a yardstick)."""
    out = {}
    try:
        def pack(w):   # w: [N, K] float -> (packed, scales_and_zeros) in torch's int4 CPU layout, group 32
            N, K = w.shape
            g = w.reshape(N, K // 32, 32)
            scale = g.abs().amax(-1).clamp_min(1e-8) / 7
            q = (g / scale[..., None]).round().clamp(-8, 7) + 8
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(N, K).to(torch.int32), 1)
            sz = torch.stack([scale, torch.zeros_like(scale)], -1).transpose(0, 1).contiguous()
            return packed, sz
        g = torch.Generator().manual_seed(1)
        mats = [(pack(torch.randn(2 * I, H, generator=g)), pack(torch.randn(H, I, generator=g))) for _ in range(POOL)]
        mm4 = torch.ops.aten._weight_int4pack_mm_for_cpu

        def int4pack(rep):
            for j in range(n_exp):
                (gu, gus), (dn, dns) = mats[(rep * 13 + j * 7) % POOL]
                h = mm4(x[j * rows:(j + 1) * rows], gu, 32, gus)
                mm4((torch.nn.functional.silu(h[:, :I]) * h[:, I:]).contiguous(), dn, 32, dns)
        int4pack(0)
        out["torch int4pack"] = int4pack
    except (RuntimeError, AttributeError) as e:
        print(f"torch int4pack unavailable: {e}", file=sys.stderr)
    m8 = [(torch.randint(-127, 127, (2 * I, H), dtype=torch.int8), torch.rand(2 * I),
           torch.randint(-127, 127, (H, I), dtype=torch.int8), torch.rand(H)) for _ in range(POOL)]

    def int8pack(rep):
        for j in range(n_exp):
            a, sa, b, sb = m8[(rep * 13 + j * 7) % POOL]
            h = torch._weight_int8pack_mm(x[j * rows:(j + 1) * rows], a, sa)
            torch._weight_int8pack_mm(torch.nn.functional.silu(h[:, :I]) * h[:, I:], b, sb)
    out["torch int8pack (int8 yardstick)"] = int8pack
    return out


def compiled_int4(specs, blobs, H, I, n_exp, rows):
    """torch.compile of the int4 expert (nibble decode, scales, SwiGLU, matmuls) from the stored tensors."""
    x = torch.randn(n_exp * rows, H)

    def deq(packed, scale):
        b = packed.view(torch.uint8)
        q = torch.stack([b & 15, b >> 4], -1).reshape(b.shape[0], -1).float() - 8
        return (q.view(q.shape[0], -1, 32) * scale.float()[..., None]).view(q.shape[0], -1)

    def expert(x, gp, gs, upk, us, dp, ds):
        g, u = x @ deq(gp, gs).t(), x @ deq(upk, us).t()
        return (torch.nn.functional.silu(g) * u) @ deq(dp, ds).t()
    f = torch.compile(expert, dynamic=False)
    args = [[b[k] for k in ("gate.packed", "gate.scale", "up.packed", "up.scale", "down.packed", "down.scale")] for b in blobs]
    t0 = time.perf_counter()
    f(x[:rows], *args[0])
    compile_s = time.perf_counter() - t0
    return (lambda rep: [f(x[j * rows:(j + 1) * rows], *args[(rep * 13 + j * 7) % POOL]) for j in range(n_exp)]), compile_s


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile (a minute of compilation)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "host_kernels.md"))
    a = ap.parse_args()
    if kernels.lib() is None:
        raise SystemExit(f"host kernels unavailable: {kernels.unavailable()}")
    torch.set_num_threads(a.threads)
    kernels.set_threads(a.threads)
    H, I, n = a.hidden, a.inter, a.experts
    lines = ["# Host expert kernels: candidates (issue 18)", "",
             f"`python bench/host_kernels.py --hidden {H} --inter {I} --experts {n} --threads {a.threads}`", "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
             f"kernels built for {kernels.isa()}. "
             f"One expert: hidden {H}, intermediate {I} (SwiGLU: gate, up, down); a call computes {n} experts, one "
             f"token each, drawn from a pool of {POOL} (weights read from memory). Best of {a.reps}.", "",
             "| format | candidate | us per expert | stored GB/s | vs reference |", "|---|---|---|---|---|"]
    for fmt, params in FORMATS:
        specs, blobs = pool(fmt, params, H, I)
        nbytes = sum(v.numel() * v.element_size() for v in blobs[0].values())
        cands = candidates(fmt, specs, blobs, H, I, n, 1)
        if fmt == "int4" and not a.no_compile:
            try:
                cands["compile"], cs = compiled_int4(specs, blobs, H, I, n, 1)
                print(f"torch.compile took {cs:.0f} s", file=sys.stderr)
            except Exception as e:  # noqa: BLE001 - report any compile failure and go on
                print(f"torch.compile failed: {e}", file=sys.stderr)
        ref = None
        for name, fn in cands.items():
            fn(0)
            t = best_of(fn, a.reps) / n
            ref = ref or t
            lines.append(f"| {fmt} | {name} | {t * 1e6:.0f} | {nbytes / t / 1e9:.1f} | {ref / t:.1f}x |")
            print(lines[-1], flush=True)
    lines += ["", "## Tokens per expert: kernel against the reference (the MAX_ROWS crossover)", "",
              "| format | tokens per expert | ours us | reference us | ours / reference |", "|---|---|---|---|---|"]
    for fmt, params in FORMATS[:3]:
        specs, blobs = pool(fmt, params, H, I)
        for rows in (1, 4, 8, 16, 32, 64):
            c = candidates(fmt, specs, blobs, H, I, n, rows)
            to, tr = best_of(c["ours"], max(3, a.reps // 4)), best_of(c["reference"], max(3, a.reps // 4))
            lines.append(f"| {fmt} | {rows} | {to / n * 1e6:.0f} | {tr / n * 1e6:.0f} | {to / tr:.2f} |")
            print(lines[-1], flush=True)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
