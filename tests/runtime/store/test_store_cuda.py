"""The store on a real GPU: pinned host slab, CUDA device slab, side-stream copies."""
import pytest
import torch

from runtime.quant import WeightSpec
from runtime.store import ExpertStore, Manifest, StoreWriter

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_store_is_pinned_and_exact(tmp_path):
    d = str(tmp_path / "s")
    w = StoreWriter(d, model="m", num_layers=2, num_experts=8, weights=[WeightSpec("w", (256, 256), "bf16")])
    want = {}
    for l in range(2):
        for e in range(8):
            want[(l, e)] = torch.randn(256, 256).to(torch.bfloat16)
            w.write(l, e, {"w": want[(l, e)]})
    w.close()
    s = Manifest.read(d).blob_stride
    with ExpertStore(d, device_budget=3 * s, device="cuda") as st:
        assert st.host.data.is_pinned() and st.dev.data.is_cuda and not st.device_is_stand_in
        for t in range(5):
            for l in range(2):
                f = st.request(l, [t % 8, (t + 3) % 8], t)
                for wave in f.waves():
                    for e in wave:
                        assert torch.equal(f.tensors(e)["w.t"].t().cpu(), want[(l, e)])
