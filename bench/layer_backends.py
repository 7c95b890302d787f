"""Decode speed of the layer kinds off the GQA path - MLA (DeepSeek-V2-Lite-like), KDA + MLA (Kimi-Linear-like),
Gated DeltaNet + gated attention (Qwen3-Next-like) and sinks + sliding windows (gpt-oss-like) - for two source trees
side by side (issue 30: A/B of a change
to how those layers compute, e.g. their projections on the host kernels' Linear instead of float32 F.linear).

Each checkpoint is built with transformers (seed 0, non-norm weights x4 as the tests do, saved in bf16; hidden
512, 8 layers, 32 experts top-4: the mid-size shape of bench/decode_speed.py), converted once (by the new tree)
into a bf16 and an int4 store that both trees decode; each configuration (tree, shape, format, batch) runs in a fresh process of that tree at
its defaults with 1 thread, every expert in memory (one memory, --host-budget auto), 16-token prompts and 32 new
tokens; interleaved over --reps, the best kept. Reports decode tok/s and the ratio new / old.

Usage: python bench/layer_backends.py --old DIR [--new DIR] [--reps 2] [--out bench/results/layer_backends.md]
  (--old: a checkout of the tree to compare against, e.g. `git worktree add /tmp/old HEAD~1`; --new: this tree)
"""
import argparse
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

from exp_common import generate_rate, write_markdown  # noqa: E402 (bench/: results files)

SHAPES = {
    "mla": ("DeepSeek-V2-Lite-like (MLA, no q LoRA, shared expert, first layer dense)", "DeepseekV3",
            dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=8, q_lora_rank=None, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
                 v_head_dim=64, n_routed_experts=32, num_experts_per_tok=4, moe_intermediate_size=512,
                 n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=4096)),
    "kda": ("Kimi-Linear-like (KDA:MLA 3:1, shared expert)", "KimiLinear",
            dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=8, num_local_experts=32, num_experts_per_tok=4, moe_intermediate_size=512,
                 n_shared_experts=1, n_group=1, topk_group=1, kv_lora_rank=128, qk_rope_head_dim=32,
                 qk_nope_head_dim=64, v_head_dim=64, linear_head_dim=64, linear_num_heads=8,
                 routed_scaling_factor=2.5, max_position_embeddings=4096,
                 layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2, mlp_layer_types=["sparse"] * 8)),
    "gdn": ("Qwen3-Next-like (Gated DeltaNet:gated attention 3:1, shared expert)", "Qwen3Next",
            dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                 linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=32,
                 num_experts_per_tok=4, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                 max_position_embeddings=4096, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2)),
    "gptoss": ("gpt-oss-like (sinks, sliding 128 / full alternating, biases, clamped SwiGLU)", "GptOss",
               dict(vocab_size=4096, hidden_size=512, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                    max_position_embeddings=4096, layer_types=["sliding_attention", "full_attention"] * 4)),
}


def build(shape: str, hf: str) -> None:
    import torch
    import transformers
    _, cls, kw = SHAPES[shape]
    torch.manual_seed(0)
    cfg = getattr(transformers, cls + "Config")(**kw, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    m = getattr(transformers, cls + "ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" not in n and not n.endswith(("A_log", "dt_bias")):
                p.mul_(4.0)
    m.to(torch.bfloat16).save_pretrained(hf)


def run(tree: str, store: str, batch: int) -> float:
    cmd = [sys.executable, "-m", "runtime.cli", "generate", "--model", store, "--threads", "1", "--max-tokens", "32",
           "--json"]
    for b in range(batch):
        cmd += ["--prompt-ids", ",".join(str((61 * i + 7 * b) % 4096) for i in range(1, 17))]
    env = {**os.environ, "PYTHONPATH": tree}
    p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    return generate_rate(p, tree)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", default=ROOT)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "tiered-moe-bench-layers"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "layer_backends.md"))
    a = ap.parse_args()
    shapes = a.shapes.split(",")
    trees = {"old": os.path.abspath(a.old), "new": os.path.abspath(a.new)}
    stores = {}
    for s in shapes:
        hf = os.path.join(a.workdir, s, "hf")
        if not os.path.exists(os.path.join(hf, "config.json")):
            build(s, hf)
        for fmt in ("bf16", "int4"):         # converted by the new tree; both trees decode the same store
            d = os.path.join(a.workdir, s, fmt)
            if not os.path.exists(os.path.join(d, "manifest.json")):
                q = [] if fmt == "bf16" else ["--quantize", "int4"]
                subprocess.run([sys.executable, "-m", "runtime.cli", "convert", "--model", hf, "--out", d, *q],
                               cwd=trees["new"], env={**os.environ, "PYTHONPATH": trees["new"]}, check=True,
                               capture_output=True)
            stores[s, fmt] = d
    cases = [(s, fmt, b) for s in shapes for fmt in ("bf16", "int4") for b in (1, 8)]
    got = {(c, t): [] for c in cases for t in trees}
    for r in range(a.reps):
        for c in cases:
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for t in order:
                got[(c, t)].append(run(trees[t], stores[c[0], c[1]], c[2]))
                print(f"rep {r + 1} {c} {t}: {got[(c, t)][-1]:.1f} tok/s", flush=True)
    rows = []
    for c in cases:
        old, new = max(got[(c, "old")]), max(got[(c, "new")])
        rows.append(f"| {SHAPES[c[0]][0]} | {c[1]} | {c[2]} | {old:.1f} | {new:.1f} | {new / old:.2f}x |")
    write_markdown(a.out, [
        "# Layer kinds off the GQA path: two source trees side by side",
        "",
        f"Command: `python bench/layer_backends.py {' '.join(sys.argv[1:])}` ({os.cpu_count()} cores; old = "
        f"`{trees['old']}`, new = `{trees['new']}`). Hidden 512, 8 layers, 32 experts top-4, bf16 checkpoints built "
        f"with transformers; each tree's defaults, 1 thread, every expert in memory, 16-token prompts, 32 new "
        f"tokens, best of {a.reps} interleaved reps.",
        "",
        "| shape | experts | batch | old decode tok/s | new decode tok/s | new / old |",
        "|---|---|---|---|---|---|",
        *rows,
    ])


if __name__ == "__main__":
    main()
