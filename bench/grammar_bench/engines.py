"""The engines side by side, each as its integration would call it: llguidance (as runtime/engine/grammar.py
does, and writing its mask in place), xgrammar, outlines-core; whether each is importable here."""
from __future__ import annotations

import json
import os

from .tokenizer import EOS_TEXT, Tok

ENGINES = ("llguidance", "llguidance-inplace", "xgrammar", "outlines-core")
MODULE = {"llguidance": "llguidance", "llguidance-inplace": "llguidance", "xgrammar": "xgrammar",
          "outlines-core": "outlines_core"}


def to_bool(words, V: int):
    """Packed mask -> the bool mask the engine consumes: the expression of runtime Matcher.allowed.
    words: int32 [ceil(V/32)], bit j of word i = token 32 i + j. Returns bool [V]."""
    import torch
    bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1      # bits: [W, 32]
    return bits.reshape(-1)[:V].bool()


class LLGuidance:
    """As runtime/engine/grammar.py uses it: LLTokenizer from the tokenizer.json path, per request
    grammar_from + LLMatcher; per step compute_bitmask() (a new bytes object) -> bytearray -> torch.frombuffer."""
    name = "llguidance"

    def __init__(self, tk: Tok) -> None:
        from llguidance import LLTokenizer
        self.tk = tk
        self.tok = LLTokenizer(tk.path, n_vocab=tk.V, eos_token=[tk.eos])

    def compile(self, schema: dict):
        from llguidance import grammar_from
        g = grammar_from("json_schema", json.dumps({**schema, "x-guidance": {
            "whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}}))
        return g, self.matcher(g)

    def matcher(self, g):
        """A new request's matcher: llguidance compiles the grammar here, as the runtime's Matcher does."""
        from llguidance import LLMatcher
        m = LLMatcher(self.tok, g)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def mask(self, m):
        return m.compute_bitmask()

    def words(self, m, raw):
        import torch
        return torch.frombuffer(bytearray(raw), dtype=torch.int32)          # [ceil(V/32)]

    def advance(self, m, t: int) -> None:
        if not m.consume_token(t):
            raise ValueError(f"refused token {t}: {m.get_error()}")


class LLGuidanceInplace(LLGuidance):
    """llguidance writing the mask into a preallocated int32 tensor (unsafe_compute_mask_ptr, what
    llguidance.torch.fill_next_token_bitmask does): no bytes object, no bytearray copy."""
    name = "llguidance-inplace"

    def __init__(self, tk: Tok) -> None:
        super().__init__(tk)
        import torch
        self.buf = torch.zeros((tk.V + 31) // 32, dtype=torch.int32)        # [W]

    def mask(self, m):
        m.unsafe_compute_mask_ptr(self.buf.data_ptr(), self.buf.numel() * 4)
        return self.buf

    def words(self, m, raw):
        return raw


class XGrammar:
    """TokenizerInfo from the HF tokenizer (transformers.PreTrainedTokenizerFast over the same tokenizer.json);
    GrammarCompiler (max_threads = the machine's cores, cache off so each compile is timed); per step
    fill_next_token_bitmask into a preallocated int32 [1, W] tensor, accept_token."""
    name = "xgrammar"

    def __init__(self, tk: Tok) -> None:
        import torch
        import transformers
        import xgrammar as xgr
        self.tk = tk
        hf = transformers.PreTrainedTokenizerFast(tokenizer_file=tk.path, eos_token=EOS_TEXT)
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tk.V, stop_token_ids=[tk.eos])
        self.vocab_type = str(self.info.vocab_type)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=os.cpu_count() or 1, cache_enabled=False)
        self.buf = xgr.allocate_token_bitmask(1, tk.V)                     # [1, W] int32
        assert self.buf.dtype == torch.int32

    def compile(self, schema: dict):
        import xgrammar as xgr
        cg = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"),
                                               strict_mode=False)
        return cg, xgr.GrammarMatcher(cg)

    def matcher(self, cg):
        import xgrammar as xgr
        return xgr.GrammarMatcher(cg)

    def mask(self, m):
        m.fill_next_token_bitmask(self.buf)
        return self.buf

    def words(self, m, raw):
        return raw[0]

    def advance(self, m, t: int) -> None:
        if not m.accept_token(t):
            raise ValueError(f"refused token {t}")


class OutlinesCore:
    """Vocabulary from the token bytes (EOS kept out, as it requires); per schema build_regex_from_schema
    (whitespace_pattern "") -> Index (precomputes every DFA state's allowed tokens) -> Guide; per step
    write_mask_into a preallocated int32 [W] tensor, advance(return_tokens=False)."""
    name = "outlines-core"

    def __init__(self, tk: Tok) -> None:
        import torch
        from outlines_core import Vocabulary
        self.tk = tk
        m: dict = {}
        for i, b in enumerate(tk.token_bytes):
            if i not in tk.special and b:
                m.setdefault(b, []).append(i)
        self.vocab = Vocabulary(tk.eos, m)
        self.buf = torch.zeros((tk.V + 31) // 32, dtype=torch.int32)        # [W]

    def compile(self, schema: dict):
        from outlines_core import Guide, Index
        from outlines_core.json_schema import build_regex_from_schema
        idx = Index(build_regex_from_schema(json.dumps(schema), ""), self.vocab)
        return idx, Guide(idx)

    def matcher(self, idx):
        from outlines_core import Guide
        return Guide(idx)

    def mask(self, g):
        g.write_mask_into(self.buf.data_ptr(), self.buf.numel(), 4)
        return self.buf

    def words(self, g, raw):
        return raw

    def advance(self, g, t: int) -> None:
        g.advance(t, return_tokens=False)


CLASSES = {c.name: c for c in (LLGuidance, LLGuidanceInplace, XGrammar, OutlinesCore)}


def engine_version(name: str) -> str:
    import importlib.metadata as md
    return md.version({"outlines-core": "outlines-core", "xgrammar": "xgrammar"}.get(name, "llguidance"))


def importable(name: str) -> "str | None":
    """None, or why the engine cannot be used here."""
    import importlib
    try:
        importlib.import_module(MODULE[name])
        if name == "xgrammar":
            importlib.import_module("transformers")
    except Exception as e:  # noqa: BLE001 - an ImportError or a broken native library alike
        return f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return None

