"""The multi-token-prediction layer of GLM-4.7-Flash (``glm4_moe_lite``: MLA) and GLM-5 (``glm_moe_dsa``: MLA with
DeepSeek Sparse Attention and indexer sharing) read by convert and run by runtime/model/mtp.py, against transformers'
own MTP model (transformers.modeling_layers.MtpModel, which reads the layer from the same checkpoint by the release's
names) - an independent reading and an independent forward.

Both releases store one MTP layer in DeepSeek-V3's layout, ``model.layers.{L}.*`` (L = num_hidden_layers: 47 / 78,
transformers' ``_keys_to_ignore_on_load_unexpected``), announced by config.json's ``num_nextn_predict_layers`` - a
field neither transformers config class has, so the fixture adds it to config.json after save_pretrained, as the
releases have it. GLM-5's decoder layer returns (hidden, top-k) for its indexer sharing, which transformers'
MtpLayer does not unpack: its reference is MtpLayer's formula written out here around transformers' own modules
(the MtpModel's enorm / hnorm / eh_proj / decoder layer / post norm, read from the checkpoint by MtpModel).

Sarvam-105B (``sarvam_mla``) ships no MTP layer (transformers' SarvamMLAConfig: num_mtp_layers defaults to 0, "the
released checkpoints do not include MTP weights"; vLLM and SGLang have no Sarvam MTP model): it is read as
``deepseek_v3`` (arch/sarvam_mla.py), whose MTP reading would apply to a checkpoint that did ship one."""
import importlib.util
import json
import os

import pytest
import torch

from helpers import require
from runtime.model import MoEConfig
from runtime.model.convert import Checkpoint, convert
from runtime.model.mtp import has_mtp, mtp_checkpoint, mtp_dense_tensors, mtp_store_dir
from runtime.store import Manifest

transformers = require("transformers", "the test-only reference")

_spec = importlib.util.spec_from_file_location("_mtp_fixtures", os.path.join(os.path.dirname(__file__), "test_mtp.py"))
fx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fx)                  # SIZES, _release_names, _ours / _close / _seq, mtp_layer

MOE = dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
           moe_intermediate_size=32, routed_scaling_factor=2.5, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
           qk_nope_head_dim=16, v_head_dim=16, pad_token_id=None)
FIXTURES = {
    # GLM-4.7-Flash: DeepSeek-V3's MLA with GLM-4.5's router; layer 0 dense (mlp_layer_types' default)
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(MOE)),
    # GLM-5: MLA + DSA, the indexer's RoPE interleaved; the last decoder layer "shared" (no indexer of its own, as
    # GLM-5.2's layer 77) while the MTP layer has its own - 4 of its cached keys per query, fewer than the texts
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(
        MOE, first_k_dense_replace=1, index_topk=4, index_n_heads=8, index_head_dim=16,
        indexer_types=["full", "full", "shared"])),
}
# what transformers' MtpModel reads from the config (the releases' config.json has num_nextn_predict_layers only)
MTP_FIELDS = ("num_mtp_layers", "mtp_mlp_layer_types", "mtp_layer_types")


def _mtp_fields(c, arch: str) -> None:
    c.num_mtp_layers, c.mtp_mlp_layer_types = 1, ["sparse"]
    if arch == "glm_moe_dsa":
        c.mtp_layer_types = c.layer_types[-1:]


def build_glm_checkpoint(arch: str, out_dir: str, seed: int = 0):
    """A tiny checkpoint of ``arch`` with one MTP layer as the release stores it -> (transformers' model,
    transformers' MTP model loaded back from the directory by the release's names)."""
    from safetensors.torch import load_file, save_file
    from transformers.modeling_layers import MtpModel
    cfg_cls, model_cls, kw = FIXTURES[arch]
    torch.manual_seed(seed)
    c = getattr(transformers, cfg_cls)(**{**fx.SIZES, **kw})
    m = getattr(transformers, model_cls)(c).eval()
    _mtp_fields(c, arch)
    mtp = MtpModel(m, 1).eval()
    fx.randomize(m, mtp)
    m.save_pretrained(out_dir)
    cj = os.path.join(out_dir, "config.json")
    with open(cj) as f:
        d = {k: v for k, v in json.load(f).items() if k not in MTP_FIELDS}
    d["num_nextn_predict_layers"] = 1      # the releases' field (the config classes lack it)
    with open(cj, "w") as f:
        json.dump(d, f, indent=2)
    L, path = c.num_hidden_layers, os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    extra = fx._release_names(arch, L, mtp.state_dict(), c.moe_intermediate_size)
    extra[f"model.layers.{L}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    extra[f"model.layers.{L}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({**tensors, **extra}, path, metadata={"format": "pt"})
    ref = getattr(transformers, model_cls).from_pretrained(out_dir).eval()
    ref._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{L}\..*"]    # the release's 47 / 78: ours is L
    _mtp_fields(ref.config, arch)
    mtp_ref = MtpModel.from_pretrained(ref).eval()
    got = mtp_ref.state_dict()
    for k, v in mtp.state_dict().items():     # transformers read every MTP weight back (none left at its init)
        assert torch.equal(got[k], v), f"transformers did not read {k} back from the release's names"
    return ref, mtp_ref


def mtp_layer(arch: str, mtp_ref, h: torch.Tensor, pos: torch.Tensor, ids: torch.Tensor,
              post_norm: bool = True) -> torch.Tensor:
    """transformers' MTP layer 0 over ids [1, T] at positions pos with hidden states h [1, T, hidden] -> its output
    after the post norm (``post_norm``) or before it (what vLLM chains into the next draft). GLM-4.7-Flash's normed
    output: ``MtpModel.forward_layer``; else MtpLayer's formula around transformers' modules (GLM-5's decoder layer
    returns (hidden, top-k)) with the causal mask the main model makes."""
    if arch != "glm_moe_dsa" and post_norm:
        return fx.mtp_layer(mtp_ref, h, pos, ids)
    from transformers.masking_utils import create_causal_mask
    layer = mtp_ref.layers[0]
    emb = mtp_ref.embed_tokens(ids)                                             # emb: [1, T, hidden]
    x = layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(h)], dim=-1))     # embeddings first
    mask = create_causal_mask(config=mtp_ref.config, inputs_embeds=emb, attention_mask=None, cache=None,
                              position_ids=pos, allow_is_causal_skip=False)
    out = layer.mtp_block(x, attention_mask=mask, position_embeddings=mtp_ref.rotary_emb(emb, position_ids=pos),
                          position_ids=pos)
    out = out[0] if isinstance(out, tuple) else out                             # out: [1, T, hidden]
    return layer.post_norm(out) if post_norm else out


def reference(arch: str, ref, mtp_ref, ids: list):
    """transformers: the target's normed hidden states h of ids[:-1], the MTP layer over positions 0..T-2 reading
    ids[1:] -> (h [T-1, hidden], MTP output after its post norm, MTP logits)."""
    with torch.no_grad():
        x = torch.tensor([ids])
        h = ref.model(x[:, :-1]).last_hidden_state                       # h: [1, T-1, hidden], after the final norm
        out = mtp_layer(arch, mtp_ref, h, torch.arange(1, len(ids))[None], x[:, 1:])
        return h[0], out[0], mtp_ref._project_to_logits(out)[0].float()


@pytest.fixture(scope="module", params=list(FIXTURES))
def glm_mtp(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    ref, mtp_ref = build_glm_checkpoint(request.param, str(d / "hf"))
    report = convert(str(d / "hf"), str(d / "store"))
    return request.param, ref, mtp_ref, str(d / "hf"), str(d / "store"), report


def test_conversion_keeps_the_mtp_layer(glm_mtp):
    """convert reads every tensor of the MTP layer (GLM-5's: its own indexer too, though the layer before it has
    none), none reported unread; the MTP part's dense tensors are the checkpoint's, its experts a 1-layer store."""
    arch, ref, mtp_ref, hf, store_dir, report = glm_mtp
    assert report.mtp_layers == 1 and has_mtp(store_dir)
    assert not [n for n in report.unread if n.startswith("model.layers.3.")], report.unread
    m = Manifest.read(mtp_store_dir(store_dir))
    assert (m.num_layers, m.num_experts, m.layer_numbers) == (1, 16, [3])
    cfg = MoEConfig.from_hf(store_dir)
    from safetensors.torch import load_file
    d = load_file(os.path.join(mtp_store_dir(store_dir), "dense.safetensors"))
    assert set(d) == set(mtp_dense_tensors(cfg, 1))   # the embedding / head copies equal the model's: not kept
    if arch == "glm_moe_dsa":
        assert cfg.index_shared_layers == [2] and "model.layers.3.self_attn.indexer.wk.weight" in d
    ck = mtp_checkpoint(Checkpoint(hf), cfg)
    for k, v in d.items():
        assert torch.equal(v, ck.get(k)), k


@pytest.mark.parametrize("budget", ["all", "tiered"])
def test_mtp_forward_matches_transformers(glm_mtp, budget):
    """The MTP layer's logits and normed output at every position against transformers' on the same weights and
    target hidden states: one prefill chunk, then the same positions one at a time (the decode path); its experts all
    on the device, or tiered (device slots for one token's top-k: 4 of 16)."""
    arch, ref, mtp_ref, hf, store_dir, report = glm_mtp
    ids = torch.randint(0, 96, (11,), generator=torch.Generator().manual_seed(3)).tolist()
    h, want_out, want_logits = reference(arch, ref, mtp_ref, ids)
    model, store, mtp = fx._ours(store_dir, **({} if budget == "all" else {"device_fraction": 0.0}))
    try:
        T = len(ids) - 1
        s = fx._seq(mtp, T)
        got = mtp.forward([s], [ids[1:]], h, every_token=True)
        torch.testing.assert_close(got.logits, want_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.normed, want_out, rtol=1e-4, atol=1e-4)
        s2 = fx._seq(mtp, T)
        rows = [mtp.forward([s2], [[ids[i + 1]]], h[i:i + 1]).logits[0] for i in range(T)]
        torch.testing.assert_close(torch.stack(rows), want_logits, rtol=1e-4, atol=1e-4)
    finally:
        fx._close(model, store, mtp)


def test_chained_draft_matches_transformers(glm_mtp):
    """A second draft feeds the layer its own output at the last position before shared_head.norm (vLLM's
    glm4_moe_lite_mtp.py / deepseek_mtp.py chaining) with the first draft's token: the output chained is
    transformers' layer's before its post norm, and the second draft's logits are transformers' on that input."""
    arch, ref, mtp_ref, hf, store_dir, report = glm_mtp
    ids = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    h, _, _ = reference(arch, ref, mtp_ref, ids)
    model, store, mtp = fx._ours(store_dir)
    try:
        T = len(ids) - 1
        first, d1, second = fx.chain_two(mtp, ids, h)
        with torch.no_grad():
            pos = torch.arange(1, T + 2)[None]
            chained = mtp_layer(arch, mtp_ref, h[None], pos[:, :-1], torch.tensor([ids[1:]]), post_norm=False)[0, -1:]
            torch.testing.assert_close(first.hidden[-1:], chained, rtol=1e-4, atol=1e-4)
            out = mtp_layer(arch, mtp_ref, torch.cat([h, chained])[None], pos, torch.tensor([ids[1:] + [d1]]))
            want = mtp_ref._project_to_logits(out)[0, -1].float()
        torch.testing.assert_close(second.logits[0], want, rtol=1e-4, atol=1e-4)
    finally:
        fx._close(model, store, mtp)
