"""The checkpoint's multi-token-prediction layers (runtime/model/mtp.py) against transformers' own MTP model
(transformers.modeling_layers.MtpModel: MtpLayer's enorm / hnorm / eh_proj around the architecture's decoder layer
class, the post norm, the shared head), which reads them from the same checkpoint by the release's names - an
independent reading and an independent forward.

The fixture: a tiny DeepSeek-V3 / GLM-4.5 (transformers' config classes, sizes shrunk, num_nextn_predict_layers = 1),
random weights, saved with save_pretrained; the MTP layer's tensors are appended as the releases name them
(``model.layers.{L}.enorm`` / ``hnorm`` / ``eh_proj`` / ``shared_head.norm`` / ``shared_head.head`` /
``embed_tokens``, the decoder layer's tensors with per-expert ``mlp.experts.{e}.*_proj``)."""
import os

import pytest
import torch

from helpers import require
from runtime.engine.kv_manager import KVManager
from runtime.model import load_model
from runtime.model.convert import Checkpoint, convert
from runtime.model.layers.cache import Sequence
from runtime.model import MoEConfig
from runtime.model.mtp import has_mtp, load_mtp, mtp_checkpoint, mtp_dense_tensors, mtp_store_dir
from runtime.expert_codec import ExpertCodec
from runtime.store import Manifest

transformers = require("transformers", "the test-only reference")

SIZES = dict(vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=256, eos_token_id=None, bos_token_id=None)
DEEPSEEK_MOE = dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
                    moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=2.5,
                    num_nextn_predict_layers=1)
FIXTURES = {
    # MLA with a q LoRA, sigmoid group-limited routing with a correction bias, a shared expert
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        DEEPSEEK_MOE, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)),
    # GQA with q/k/v biases, per-head q/k norms, RoPE on half of each head; the same router
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        DEEPSEEK_MOE, use_qk_norm=True, attention_bias=True, num_key_value_heads=2, pad_token_id=None)),
    # DeepSeek-V3.2: the same MLA and MoE with DeepSeek Sparse Attention - the MTP layer has its own indexer, which
    # keeps 4 of the MTP layer's cached keys per query (fewer than the tests' texts)
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(
        DEEPSEEK_MOE, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        index_topk=4, index_n_heads=8, index_head_dim=16, pad_token_id=None)),
    # Gated DeltaNet and gated full attention with (1 + w) norms, a sigmoid-gated shared expert; its MTP head stored
    # as mtp.* (fc, pre_fc_norm_embedding / _hidden, layers.0, norm) - config.json's mtp_num_hidden_layers
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        num_key_value_heads=2, pad_token_id=None,
        # the last layer full attention: transformers' MtpModel takes its norm class from the last layer's first norm
        # (a Gated DeltaNet layer's would be its gated norm)
        layer_types=["linear_attention", "linear_attention", "full_attention"])),
    # Qwen3.5's language model: the same, its Gated DeltaNet projections unfused, every layer MoE
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        num_key_value_heads=2, pad_token_id=None, intermediate_size=None,
        layer_types=["linear_attention", "linear_attention", "full_attention"])),
}
QWEN_PARTS = {"enorm.weight": "mtp.pre_fc_norm_embedding.weight", "hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
              "eh_proj.weight": "mtp.fc.weight", "post_norm.weight": "mtp.norm.weight"}


def _release_names(arch: str, L: int, state: dict, I: int) -> dict:
    """transformers' MtpModel state (layers.0.*) -> the release's tensor names of MTP layer L: DeepSeek's / GLM's
    model.layers.L.* (the decoder layer's tensors there too, post_norm as shared_head.norm), Qwen3-Next's mtp.*; the
    fused experts per expert (gate_up_proj [E, 2I, H]: gate rows first; down_proj [E, H, I])."""
    qwen = arch.startswith("qwen3")
    p, block, out = f"model.layers.{L}.", "mtp.layers.0." if qwen else f"model.layers.{L}.", {}
    for k, v in state.items():
        if not k.startswith("layers.0."):
            continue
        k = k[len("layers.0."):]
        if k.startswith("mtp_block.mlp.experts."):
            w = k.rsplit(".", 1)[1]
            for e in range(v.shape[0]):
                if w == "gate_up_proj":
                    out[block + f"mlp.experts.{e}.gate_proj.weight"] = v[e, :I].contiguous()
                    out[block + f"mlp.experts.{e}.up_proj.weight"] = v[e, I:].contiguous()
                else:
                    out[block + f"mlp.experts.{e}.down_proj.weight"] = v[e].contiguous()
        elif k.startswith("mtp_block."):
            out[block + k.removeprefix("mtp_block.")] = v.contiguous()
        elif qwen:
            out[QWEN_PARTS[k]] = v.contiguous()
        else:
            out[p + ("shared_head.norm.weight" if k == "post_norm.weight" else k)] = v.contiguous()
    return out


def randomize(m, mtp) -> None:
    """Routing and logits far from ties, norms that matter, a correction bias that matters: the model's weights x4,
    its norms 1 + 0.2 N(0, 1), MtpModel's own parameters (the fused experts it leaves uninitialised) 0.08 N(0, 1)
    (the test_mtp_* files' fixtures use it too)."""
    with torch.no_grad():
        for mod in (m, mtp):
            for n, p in mod.named_parameters():
                if n.endswith("e_score_correction_bias"):
                    p.copy_(torch.randn(p.shape) * 0.5)
                elif "norm" in n:
                    p.copy_(1 + 0.2 * torch.randn(p.shape))
                elif mod is mtp and n.startswith(("embed_tokens", "shared_head")):
                    pass           # the main model's own, scaled with it
                elif mod is mtp:   # MtpModel leaves some of its parameters (the fused experts) uninitialised
                    p.copy_(torch.randn(p.shape) * 0.08)
                else:
                    p.mul_(4.0)
            for n, b in mod.named_buffers():
                if n.endswith("e_score_correction_bias"):
                    b.copy_(torch.randn(b.shape) * 0.5)


def build_mtp_checkpoint(arch: str, out_dir: str, seed: int = 0):
    """A tiny checkpoint of ``arch`` with one MTP layer -> (transformers' model, transformers' MTP model loaded back
    from the directory by the release's names)."""
    from safetensors.torch import load_file, save_file
    from transformers.modeling_layers import MtpModel
    cfg_cls, model_cls, kw = FIXTURES[arch]
    torch.manual_seed(seed)
    # a fixture's None drops a size its config class does not define (Qwen3.5's text config: no intermediate_size)
    c = getattr(transformers, cfg_cls)(**{k: v for k, v in {**SIZES, **kw}.items() if not (k in kw and kw[k] is None)})
    if arch.startswith("qwen3"):       # the release's field, and what transformers' MtpModel reads (not config fields)
        c.mtp_num_hidden_layers, c.num_mtp_layers, c.mtp_layer_types = 1, 1, ["full_attention"]
    if arch == "deepseek_v32":     # what transformers' MtpModel reads (DeepseekV32Config has no MTP field)
        c.num_mtp_layers, c.mtp_mlp_layer_types, c.mtp_layer_types = 1, ["sparse"], c.layer_types[-1:]
    m = getattr(transformers, model_cls)(c).eval()
    mtp = MtpModel(m, 1).eval()
    randomize(m, mtp)
    m.save_pretrained(out_dir)
    L = c.num_hidden_layers
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    extra = _release_names(arch, L, mtp.state_dict(), c.moe_intermediate_size)
    if not arch.startswith("qwen3"):   # DeepSeek's / GLM's releases store the MTP layer's own embedding and head copies
        extra[f"model.layers.{L}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        extra[f"model.layers.{L}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({**tensors, **extra}, path, metadata={"format": "pt"})
    ref = getattr(transformers, model_cls).from_pretrained(out_dir).eval()
    if not arch.startswith("qwen3"):   # transformers finds them by the released model's layer number (61 / 92): ours is L
        ref._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{L}\..*"]
    mtp_ref = MtpModel.from_pretrained(ref).eval()
    got = mtp_ref.state_dict()
    for k, v in mtp.state_dict().items():     # transformers read every MTP weight back (none left at its init)
        assert torch.equal(got[k], v), f"transformers did not read {k} back from the release's names"
    return ref, mtp_ref


@pytest.fixture(scope="module", params=list(FIXTURES))
def mtp_fixture(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    ref, mtp_ref = build_mtp_checkpoint(request.param, str(d / "hf"))
    report = convert(str(d / "hf"), str(d / "store"))
    return request.param, ref, mtp_ref, str(d / "hf"), str(d / "store"), report


def mtp_layer(mtp_ref, h: torch.Tensor, pos: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """transformers' MTP layer 0 over ids [1, T] at positions pos with hidden states h [1, T, hidden] -> its output
    after the post norm. ``MtpModel.forward_layer``, but where it has no mask for the layer's type (DeepSeek-V3.2's
    ``indexed_attention``) its steps with the causal mask the main model makes for that layer type."""
    if "indexed_attention" not in (getattr(mtp_ref.config, "layer_types", None) or []):
        return mtp_ref.forward_layer(0, h, pos, None, input_ids=ids)
    from transformers.masking_utils import create_causal_mask
    emb = mtp_ref.embed_tokens(ids)
    mask = create_causal_mask(config=mtp_ref.config, inputs_embeds=emb, attention_mask=None, cache=None,
                              position_ids=pos, allow_is_causal_skip=False)     # as DeepseekV32Model makes it
    return mtp_ref.layers[0](emb, h, position_embeddings=mtp_ref.rotary_emb(emb, position_ids=pos),
                             attention_mask=mask, position_ids=pos, cache=None)


def _reference(ref, mtp_ref, ids: list):
    """transformers: the target's normed hidden states h[0..T-2] of ids[:-1] (its model's last_hidden_state), and the
    MTP layer over positions 0..T-2 reading ids[1:] -> (h, MTP output after its post norm, MTP logits)."""
    with torch.no_grad():
        x = torch.tensor([ids])
        h = ref.model(x[:, :-1]).last_hidden_state                       # h: [1, T-1, hidden], after the final norm
        pos = torch.arange(1, len(ids))[None]                           # transformers rotates the token's position
        out = mtp_layer(mtp_ref, h, pos, x[:, 1:])
        return h[0], out[0], mtp_ref._project_to_logits(out)[0].float()


def _ours(store_dir: str, **kw):
    model, store = load_model(store_dir, dtype=torch.float32)
    mtp = load_mtp(store_dir, model, **kw)
    mtp.init_kv(256)
    return model, store, mtp


def _close(model, store, mtp):
    mtp.experts.close()
    store.close()


def _seq(mtp, n: int) -> Sequence:
    s = Sequence()
    KVManager.for_cache(mtp.kv).ensure(s, n)
    return s


def chain_two(mtp, ids: list, h: torch.Tensor) -> tuple:
    """Our first two drafts after the prompt ``ids`` (h: the target's rows of its positions but the last): the first
    from every position, the second chained from the layer's own output at the last one with the first draft's
    token -> (first step, the first draft's token, second step)."""
    s = _seq(mtp, len(ids))
    first = mtp.forward([s], [ids[1:]], h)
    d1 = int(first.logits[0].argmax())
    return first, d1, mtp.forward([s], [[d1]], first.hidden[-1:])


def test_conversion_keeps_mtp_layers(mtp_fixture):
    """(b) convert reads every MTP tensor (none reported unread), the MTP part holds its experts as a store and its
    dense tensors; the experts' bytes round-trip (each expert's gate / up / down as the checkpoint has them)."""
    arch, ref, mtp_ref, hf, store_dir, report = mtp_fixture
    assert report.mtp_layers == 1 and has_mtp(store_dir)
    assert not [n for n in report.unread if n.startswith(("model.layers.3.", "mtp."))], report.unread
    m = Manifest.read(mtp_store_dir(store_dir))
    assert (m.num_layers, m.num_experts, m.layer_numbers) == (1, 16, [3])
    from runtime.store import ExpertStore
    cfg = MoEConfig.from_hf(store_dir)
    ck = mtp_checkpoint(Checkpoint(hf), cfg)          # read by our names (Qwen3-Next's release: mtp.*)
    codec = ExpertCodec(m.weights, torch.float32, "cpu")
    with ExpertStore(mtp_store_dir(store_dir), device_budget=16 * m.blob_stride) as st:
        for e in (0, 7, 15):
            f = st.request(0, [e], 0)
            f.wait()
            t = codec.dequantize_all(f.tensors(e))     # logical [out, in] weights, as the store's codec reads them
            I = 32
            gu = t["gate_up"].float()
            assert torch.equal(gu[:I], ck.get(f"model.layers.3.mlp.experts.{e}.gate_proj.weight").float())
            assert torch.equal(gu[I:], ck.get(f"model.layers.3.mlp.experts.{e}.up_proj.weight").float())
            assert torch.equal(t["down"].float(), ck.get(f"model.layers.3.mlp.experts.{e}.down_proj.weight").float())
    from safetensors.torch import load_file
    d = load_file(os.path.join(mtp_store_dir(store_dir), "dense.safetensors"))
    assert set(d) == set(mtp_dense_tensors(cfg, 1))   # the copies equal the model's: not kept
    for k, v in d.items():
        assert torch.equal(v, ck.get(k)), k


@pytest.mark.parametrize("budget", ["all", "tiered"])
def test_mtp_forward_matches_transformers(mtp_fixture, budget):
    """(a) The MTP layer's logits and normed output at every position against transformers' MtpModel on the same
    weights and the same target hidden states: one prefill chunk, then the same positions fed one at a time (the
    decode path); its experts all on the device, or tiered (device slots for one token's top-k only: 4 of 16)."""
    arch, ref, mtp_ref, hf, store_dir, report = mtp_fixture
    ids = torch.randint(0, 96, (11,), generator=torch.Generator().manual_seed(3)).tolist()
    h, want_out, want_logits = _reference(ref, mtp_ref, ids)
    kw = {} if budget == "all" else {"device_fraction": 0.0}      # one token's top-k slots
    model, store, mtp = _ours(store_dir, **kw)
    try:
        T = len(ids) - 1
        s = _seq(mtp, T)
        got = mtp.forward([s], [ids[1:]], h, every_token=True)
        assert s.length == T
        torch.testing.assert_close(got.logits, want_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.normed, want_out, rtol=1e-4, atol=1e-4)
        s2 = _seq(mtp, T)
        rows = [mtp.forward([s2], [[ids[i + 1]]], h[i:i + 1]).logits[0] for i in range(T)]
        torch.testing.assert_close(torch.stack(rows), want_logits, rtol=1e-4, atol=1e-4)
    finally:
        _close(model, store, mtp)


def test_chained_draft_matches_transformers(mtp_fixture):
    """A second draft feeds the layer its own output at the last position (vLLM's chaining: before shared_head.norm
    for DeepSeek / GLM, after mtp.norm for Qwen3-Next) with the first draft's token: transformers' layer on that same
    input agrees."""
    arch, ref, mtp_ref, hf, store_dir, report = mtp_fixture
    ids = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    h, _, _ = _reference(ref, mtp_ref, ids)
    model, store, mtp = _ours(store_dir)
    try:
        T = len(ids) - 1
        first, d1, second = chain_two(mtp, ids, h)
        with torch.no_grad():
            hh = torch.cat([h, first.hidden[-1:]])[None]
            x = torch.tensor([ids[1:] + [d1]])
            out = mtp_layer(mtp_ref, hh, torch.arange(1, T + 2)[None], x)
            want = mtp_ref._project_to_logits(out)[0, -1].float()
        torch.testing.assert_close(second.logits[0], want, rtol=1e-4, atol=1e-4)
    finally:
        _close(model, store, mtp)


def test_mtp_errors_name_the_problem(mtp_fixture, tmp_path):
    arch, ref, mtp_ref, hf, store_dir, report = mtp_fixture
    model, store, mtp = _ours(store_dir)
    try:
        s = _seq(mtp, 4)
        with pytest.raises(ValueError, match=r"hidden states \(3, 64\) for 2 tokens"):
            mtp.forward([s], [[1, 2]], torch.zeros(3, 64))
        with pytest.raises(ValueError, match="holds KV blocks for"):
            mtp.forward([Sequence()], [[1]], torch.zeros(1, 64))
    finally:
        _close(model, store, mtp)
    bare = tmp_path / "bare"
    os.makedirs(bare)
    with pytest.raises(ValueError, match="holds no MTP layers"):
        load_mtp(str(bare), model)
