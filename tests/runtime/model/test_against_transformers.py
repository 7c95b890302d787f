"""Our model vs transformers' own, on tiny random checkpoints saved with save_pretrained."""
import pytest
import torch

from runtime.engine import Engine, SamplingParams
from runtime.model import load_model
from runtime.store import Manifest

from helpers import check_against_transformers


def budgets(store_dir, frac):
    m = Manifest.read(store_dir)
    return max(4, int(frac * m.num_layers * m.num_experts)) * m.blob_stride


@pytest.mark.parametrize("frac", [1.0, 0.1])
def test_logits_and_greedy_tokens_match(hf_model, frac):
    name, ref, hf_dir, store_dir = hf_model
    check_against_transformers(ref, store_dir, frac, name)


def test_batched_decode_equals_alone(hf_model):
    name, ref, hf_dir, store_dir = hf_model
    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 7, 12, 5)]
    outs = {}
    for batch in (1, 3):
        model, store = load_model(store_dir, expert_budget=budgets(store_dir, 0.25))
        try:
            eng = Engine(model, store, max_batch=batch, prefill_chunk=5)
            ids = [eng.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts]
            eng.run()
            outs[batch] = [eng.done[i].output for i in ids]
        finally:
            store.close()
    assert outs[1] == outs[3], name
