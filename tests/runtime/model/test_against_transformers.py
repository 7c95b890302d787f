"""Our model vs transformers' own, on tiny random checkpoints saved with save_pretrained."""
import pytest
import torch

from runtime.engine import Engine, SamplingParams
from runtime.model import Sequence, load_model
from runtime.store import Manifest


def budgets(store_dir, frac):
    m = Manifest.read(store_dir)
    return max(4, int(frac * m.num_layers * m.num_experts)) * m.blob_stride


@pytest.mark.parametrize("frac", [1.0, 0.1])
def test_logits_and_greedy_tokens_match(hf_model, frac):
    name, ref, hf_dir, store_dir = hf_model
    prompt = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(prompt).logits[0]                                    # want: [10, vocab]
    model, store = load_model(store_dir, expert_budget=budgets(store_dir, frac))
    try:
        # Every position: feed the prompt one chunk at a time and compare each last-token logit.
        s = Sequence()
        got = torch.stack([model.forward([s], [[t]])[0] for t in prompt[0].tolist()])
        assert (got - want).abs().max().item() < 1e-4, name
        with torch.no_grad():
            gen = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32, do_sample=False,
                               min_new_tokens=32, eos_token_id=None, pad_token_id=None)[0, 10:].tolist()
        eng = Engine(model, store, max_batch=1, prefill_chunk=4)
        rid = eng.add_request(prompt[0].tolist(), SamplingParams(max_tokens=32, ignore_eos=True))
        eng.run()
        assert eng.done[rid].output == gen, name
        if frac < 1:
            assert store.stats.hits["device"] < sum(store.stats.hits.values())   # offloading really happened
    finally:
        store.close()


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
