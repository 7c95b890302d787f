"""runtime/kernels/hugepages.py: the weights moved into huge-page memory keep every value, view and sharing, the
memory really is advised (the kernel's own smaps says so), and a model decodes the same tokens either way."""
import os

import pytest
import torch

from runtime.kernels import hugepages


def thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "absent"


needs_thp = pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason="no transparent huge pages here")


def smaps_entry(addr: int) -> dict:
    """The /proc/self/smaps fields of the mapping that holds ``addr`` (the kernel's account, not ours)."""
    cur, fields = None, {}
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                if cur is not None:
                    break
                lo, hi = (int(x, 16) for x in head.split("-"))
                if lo <= addr < hi:
                    cur = (lo, hi)
            elif cur is not None:
                k, v = line.split(":", 1)
                fields[k] = v.split()[0]
    return fields


class Holder:
    def __init__(self, **kw):
        self.__dict__.update(kw)


@needs_thp
def test_rehome_keeps_values_views_and_sharing(monkeypatch):
    monkeypatch.setenv("TIERED_MOE_HUGEPAGES", "1")
    g = torch.Generator().manual_seed(0)
    big = torch.randn(1024, 1536, generator=g).bfloat16()              # 3 MiB: one whole huge page at least
    view = big[7:300, 5:900]                                             # a strided view on the same storage
    t = torch.randn(512, 2048, generator=g).t()                          # transposed: strides kept
    small = torch.randn(16)                                              # under MIN_TENSOR_BYTES: stays
    want = [x.clone() for x in (big, view, t, small)]
    obj = Holder(layers=[Holder(w=big, v=view)], d={"t": t, "s": small}, same=big)
    old_small = small.data_ptr()
    moved = hugepages.rehome(obj)
    assert moved >= big.numel() * 2 + t.numel() * 4
    for x, w in zip((big, view, t, small), want):
        assert torch.equal(x, w)
    assert small.data_ptr() == old_small
    assert view.untyped_storage().data_ptr() == big.untyped_storage().data_ptr()     # still one storage
    assert view.stride() == (1536, 1) and t.stride() == (1, 2048)
    view.zero_()                                                         # writes through to big, as before
    assert big[7:300, 5:900].abs().sum() == 0
    assert big.data_ptr() % hugepages.HUGE == 0                          # the first storage starts a huge page
    fields = smaps_entry(big.data_ptr())
    assert fields.get("THPeligible") == "1", fields


@needs_thp
def test_off_switch_and_skip(monkeypatch):
    x = torch.randn(1024, 1024)
    monkeypatch.setenv("TIERED_MOE_HUGEPAGES", "0")
    assert hugepages.rehome(Holder(w=x)) == 0
    monkeypatch.setenv("TIERED_MOE_HUGEPAGES", "1")
    inner = Holder(w=x)
    p = x.data_ptr()
    assert hugepages.rehome(Holder(a=inner), skip=(inner,)) == 0 and x.data_ptr() == p


@needs_thp
def test_advised_slab_gets_huge_pages(monkeypatch):
    """A store's host slots are advised before they are written: once touched, the kernel backs them with 2 MiB
    pages (AnonHugePages in smaps, where the kernel could find free huge pages: THPeligible at least)."""
    monkeypatch.setenv("TIERED_MOE_HUGEPAGES", "1")
    from runtime.store.host_tier import Slab
    s = Slab(8, 1 << 20, "cpu", pin=False)
    s.data.fill_(1)
    fields = smaps_entry(s.data.data_ptr() + (4 << 20))
    assert fields.get("THPeligible") == "1", fields


@needs_thp
@pytest.mark.parametrize("dense_quant", ["none", "int4"])
def test_decode_is_the_same_with_and_without(tiny_store, monkeypatch, dense_quant):
    """The model moved into huge pages decodes the same tokens: the fused kernels took the new addresses, and the
    quantized dense weights' C arguments point at their codes where they are now (an address kept from before the
    move decoded other tokens, or crashed)."""
    from runtime.engine import Engine, SamplingParams
    from runtime.model import load_model
    _, store = tiny_store
    # the tiny model's weights are far under a huge page: move every tensor anyway, so the test sees the kernels
    # read the moved bytes (an address taken before the move would decode garbage or crash)
    monkeypatch.setattr(hugepages, "MIN_TENSOR_BYTES", 0)
    monkeypatch.setattr(hugepages, "MIN_ARENA_BYTES", 0)
    moved, orig = [], hugepages.rehome
    monkeypatch.setattr(hugepages, "rehome", lambda *a, **k: moved.append(orig(*a, **k)) or moved[-1])
    outs = []
    for flag in ("0", "1"):
        monkeypatch.setenv("TIERED_MOE_HUGEPAGES", flag)
        model, st = load_model(store, device="cpu", dense_quant=dense_quant)
        try:
            eng = Engine(model, st, max_batch=2)
            eng.add_request([3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(max_tokens=12, ignore_eos=True))
            eng.add_request([2, 7, 1, 8], SamplingParams(max_tokens=12, ignore_eos=True))
            done = eng.run()
            outs.append([done[i].output for i in sorted(done)])
        finally:
            st.close()
    assert moved[0] == 0 and moved[1] > 0
    assert outs[0] == outs[1] and all(len(o) == 12 for o in outs[0])
