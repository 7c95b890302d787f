"""Block Attention Residuals (runtime/model/attn_res.py) against a plain loop written from the paper's
equations, and the K3-shaped synthetic checkpoint (KDA:MLA 3:1, LatentMoE, top-k of many experts,
two shared experts, Block AttnRes, MXFP4 experts) that ``demo --shape k3`` runs."""
import math

import pytest
import torch

from runtime.engine import Engine, SamplingParams
from runtime.model import MoEConfig, Sequence, load_model
from runtime.model.attn_res import BlockAttnRes
from runtime.model.convert import convert
from runtime.model.synthetic import K3ShapeSpec, build_k3_checkpoint
from runtime.store import Manifest
from helpers import feed


def plain_input(emb, outputs, block_of, current_block, query, eps):
    """The input of the next sublayer, token by token and source by source: sources are the
    embedding, the sum of each completed block's outputs, and the sum of the current block's
    outputs so far (when there are any); weights softmax(q . v / rms(v)) over the sources."""
    T, H = emb.shape
    out = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        sources = [emb[t].double()]
        for b in range(current_block + 1):
            members = [o[t].double() for o, ob in zip(outputs, block_of) if ob == b]
            if members:
                sources.append(sum(members))
        logits = []
        for v in sources:
            rms = math.sqrt(sum(float(x) ** 2 for x in v) / H + eps)
            logits.append(sum(float(q) * float(x) for q, x in zip(query, v)) / rms)
        m = max(logits)
        e = [math.exp(z - m) for z in logits]
        for a, v in zip(e, sources):
            out[t] += a / sum(e) * v
    return out


def test_block_attn_res_equals_plain_loop():
    torch.manual_seed(0)
    T, H, L, per_block, eps = 3, 8, 5, 2, 1e-5
    emb = torch.randn(T, H)
    A = [torch.randn(H, H) * 0.7 for _ in range(2 * L)]
    queries = [torch.randn(H) for _ in range(2 * L + 1)]
    # ours
    res, got = BlockAttnRes(emb, eps), []
    for l in range(L):
        for s in range(2):
            h = res.input(queries[2 * l + s])
            got.append(h)
            res.add(torch.tanh(h @ A[2 * l + s]))
        if (l + 1) % per_block == 0:
            res.end_block()
    got.append(res.input(queries[-1]))
    # plain loop
    outputs, block_of, want = [], [], []
    for l in range(L):
        for s in range(2):
            h = plain_input(emb, outputs, block_of, l // per_block, queries[2 * l + s], eps)
            want.append(h)
            outputs.append(torch.tanh(h.float() @ A[2 * l + s]))
            block_of.append(l // per_block)
    want.append(plain_input(emb, outputs, block_of, L // per_block, queries[-1], eps))
    for j, (g, w) in enumerate(zip(got, want)):
        assert torch.allclose(g.double(), w, atol=1e-5), j
    # a zero pseudo-query weighs the sources equally; one source passes through unchanged
    res = BlockAttnRes(emb, eps)
    assert torch.equal(res.input(torch.zeros(H)), emb)
    res.add(torch.ones(T, H))
    assert torch.allclose(res.input(torch.zeros(H)), (emb + 1) / 2)


SMALL = K3ShapeSpec(vocab_size=96, hidden_size=64, latent_size=32, expert_intermediate=32, num_layers=4, num_experts=32,
                    top_k=8, kda_heads=2, kda_head_dim=16, mla_heads=2, kv_lora_rank=16, qk_nope_head_dim=16,
                    qk_rope_head_dim=8, v_head_dim=16, attn_res_block_layers=2, topics=4)


@pytest.fixture(scope="module")
def k3_store(tmp_path_factory):
    d = tmp_path_factory.mktemp("k3")
    build_k3_checkpoint(str(d / "hf"), SMALL)
    convert(str(d / "hf"), str(d / "store"), quantize="mxfp4")
    return str(d / "store")


def test_k3_shape_config(k3_store):
    cfg = MoEConfig.from_hf(k3_store)
    assert cfg.linear_layers == [0, 1, 2] and cfg.attention_layers == [3]
    assert (cfg.latent_dim, cfg.top_k, cfg.num_experts, cfg.shared_intermediate) == (32, 8, 32, 2 * 32)
    assert cfg.attn_res_block_layers == 2 and Manifest.read(k3_store).expert_format == "mxfp4"


def test_model_residual_stream_is_block_attn_res(k3_store):
    """The model's forward equals the same sublayers wired through the plain loop above."""
    def plain_layers(self, x, ctx, final_query):
        cfg = self.cfg
        outputs, block_of = [], []

        def inp(q):
            return plain_input(x, outputs, block_of, len(outputs) // 2 // cfg.attn_res_block_layers, q,
                               cfg.rms_norm_eps).to(x.dtype)
        for i, layer in enumerate(self.layers):
            h = layer.input_norm(inp(layer.attn_query))
            outputs.append(layer.attn(h, ctx))
            block_of.append(i // cfg.attn_res_block_layers)
            h = layer.post_norm(inp(layer.mlp_query))
            outputs.append(layer.ffn(h, ctx))
            block_of.append(i // cfg.attn_res_block_layers)
        return inp(final_query)

    class PlainLoop:
        """The model's residual scheme replaced by the loop above (which returns the final hidden state)."""
        def __init__(self, model):
            self.model, self.final_query = model, model.residual.final_query

        def enter(self, emb):
            return emb

        def run(self, layers, x, ctx):
            return plain_layers(self.model, x, ctx, self.final_query)

        def leave(self, x):
            return x

    prompt = [5, 17, 3, 60, 2]
    logits = []
    for plain in (False, True):
        model, store = load_model(k3_store)
        try:
            if plain:
                model.residual = PlainLoop(model)
            s = Sequence()
            logits.append(torch.stack([feed(model, [s], [prompt[:3]])[0]] +
                                      [feed(model, [s], [[t]])[0] for t in prompt[3:]]))
        finally:
            store.close()
    assert torch.allclose(logits[0], logits[1], atol=1e-4)
    assert logits[0].std() > 0


@pytest.mark.slow
def test_k3_shape_tokens_equal_across_tiers_and_batching(k3_store):
    prompts = [[5, 17, 3, 60, 2], [9, 9, 40], [1, 2, 3, 4, 5, 6, 7]]
    outs = {}
    for name, frac, batch in (("resident", 1.0, 1), ("10%", 0.1, 1), ("batched 10%", 0.1, 3)):
        m = Manifest.read(k3_store)
        model, store = load_model(k3_store, expert_budget=max(8, int(frac * m.num_layers * m.num_experts)) * m.blob_stride)
        try:
            eng = Engine(model, store, max_batch=batch, prefill_chunk=3)
            ids = [eng.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts]
            eng.run()
            outs[name] = [eng.done[i].output for i in ids]
            if frac < 1:
                assert store.stats.hits["device"] < sum(store.stats.hits.values())
        finally:
            store.close()
    assert outs["resident"] == outs["10%"] == outs["batched 10%"]
