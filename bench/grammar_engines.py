"""Structured-output grammar engines side by side: llguidance (what runtime/engine/grammar.py uses), xgrammar and
outlines-core, on the same byte-level BPE tokenizer, at two vocab sizes (4,096 and 128,000 tokens) and three JSON
schemas (a flat object: a string with maxLength, an integer, an enum; a nested object with an array of objects;
json_object = any JSON object). Each engine not importable is skipped with the reason in the report.

Measured per (engine, vocab, schema):
- compile: the schema to a matcher ready for its first mask (median of --compile-repeats fresh compiles, no
  cache); TTFM = that plus the first step (lazy work some engines leave to the first mask);
- one decoding step as the engine pays it: the allowed-token mask of the current state (packed int32 bits), its
  conversion to the bool [vocab] mask the engine consumes (the expression of runtime Matcher.allowed), and the
  advance of the state by the chosen token - mean / p50 / p99 microseconds over --seeds whole constrained
  generations of at most about --max-tokens tokens (a seeded random choice among the allowed tokens, steered to
  end the JSON in the second part so every run terminates), each run --runs times (per step the median run);
- correctness: every generation's text must parse as JSON and validate against the schema (a small validator of
  the keywords used here); along the reference engine's (llguidance's) tokens the engines' allowed sets are
  compared step by step; and a few strings (a raw control character, escapes, DEL, non-ASCII) are probed inside
  each schema's strings against RFC 8259.
"llguidance-inplace" is llguidance writing its mask into a preallocated tensor instead of the runtime's
compute_bitmask() -> bytearray path: what that path costs.

Whitespace: every engine is set to compact JSON with no free whitespace (llguidance x-guidance
whitespace_flexible false with "," and ":" separators; xgrammar any_whitespace=False, separators (",", ":");
outlines-core whitespace_pattern ""), so their languages can agree. The server itself uses ", " and ": " (one
space each); a fixed separator byte costs the same per step.

Each trial runs in a forked child process (a compile past --compile-timeout is killed and reported; the child's
address space is capped at --mem-limit-gb more than it starts with) with torch at 1 intra-op thread (steadier on
a shared 2-core machine; the masks here are 128k elements at most). The tokenizers are trained once and cached
in --workdir.

Usage: python bench/grammar_engines.py [--quick] [--engines llguidance,llguidance-inplace,xgrammar,outlines-core]
       [--vocab 4096,128000] [--schemas flat,nested,json_object] [--outdir DIR] [--json PATH]
--quick: the 4,096 vocab, the flat schema, one 60-token generation run once, one compile (seconds; what the
test runs); without --outdir it writes into a temporary folder, not over bench/results.
"""
from __future__ import annotations

import argparse
import gc
import glob
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
RESULTS = os.path.join(HERE, "results")
# HF tokenizers trains with rayon; the children fork afterwards and must not inherit a thread pool.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

EOS_TEXT = "<|endoftext|>"
ENGINES = ("llguidance", "llguidance-inplace", "xgrammar", "outlines-core")
MODULE = {"llguidance": "llguidance", "llguidance-inplace": "llguidance", "xgrammar": "xgrammar",
          "outlines-core": "outlines_core"}

SCHEMAS = {
    "flat": {"type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
             "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                            "role": {"enum": ["admin", "user", "guest"]}}},
    "nested": {"type": "object", "additionalProperties": False, "required": ["id", "items"],
               "properties": {
                   "id": {"type": "integer"},
                   "items": {"type": "array", "maxItems": 5, "items": {
                       "type": "object", "additionalProperties": False, "required": ["sku", "qty", "tags"],
                       "properties": {"sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer"},
                                      "tags": {"type": "array", "maxItems": 3,
                                               "items": {"type": "string", "maxLength": 8}}}}}}},
    "json_object": {"type": "object"},
}


# ---------------------------------------------------------------- the tokenizer

def _corpus(roots: list, cap_bytes: int) -> list:
    """The .py / .md files under roots, in a fixed order, until cap_bytes."""
    files, total = [], 0
    for r in roots:
        for dp, dn, fn in os.walk(r):
            dn[:] = sorted(d for d in dn if d not in (".git", "__pycache__", "node_modules")
                           and not (dp == ROOT and d == ".venv"))      # the venv comes last, as its own root
            for f in sorted(fn):
                if f.endswith((".py", ".md")):
                    p = os.path.join(dp, f)
                    try:
                        s = os.path.getsize(p)
                    except OSError:
                        continue
                    if total + s > cap_bytes:
                        return files
                    files.append(p)
                    total += s
    return files


def corpus_roots(large: bool) -> list:
    """The small tokenizer: this repository's own .py / .md (a clone has them); the large one adds the system
    Python's library and then the running interpreter's site-packages (capped at 64 MB in all)."""
    if not large:
        return [ROOT]
    import sysconfig
    return [ROOT] + sorted(glob.glob("/usr/lib/python3*/")) + [sysconfig.get_paths()["purelib"]]


def train_tokenizer(path: str, vocab_size: int) -> None:
    """A byte-level BPE (GPT-2 style: ByteLevel pre-tokenizer and decoder, all 256 bytes in the base alphabet,
    min_frequency 2) with <|endoftext|> as token 0, trained by HF tokenizers; written to path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    files = _corpus(corpus_roots(vocab_size > 8192), 64_000_000)

    def texts():
        for f in files:
            with open(f, encoding="utf-8", errors="replace") as fh:
                yield fh.read()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS_TEXT], show_progress=False,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), tr)
    tmp = path + ".tmp"
    tok.save(tmp)
    os.replace(tmp, path)
    with open(path + ".info", "w") as f:
        json.dump({"files": len(files), "bytes": sum(os.path.getsize(p) for p in files),
                   "roots": corpus_roots(vocab_size > 8192), "vocab": tok.get_vocab_size()}, f)


def _bytes_to_unicode() -> dict:
    from runtime.model.synthetic import bytes_to_unicode
    return bytes_to_unicode()


class Tok:
    """tokenizer.json as the bench sees it: the path, the vocab size, EOS and each token's bytes."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path) as f:
            d = json.load(f)
        inv = {c: b for b, c in _bytes_to_unicode().items()}
        vocab = d["model"]["vocab"]
        special = {t["content"]: t["id"] for t in d.get("added_tokens", [])}
        self.V = max(list(vocab.values()) + list(special.values())) + 1
        self.eos = special[EOS_TEXT]
        self.token_bytes = [b""] * self.V
        for s, i in vocab.items():
            if s not in special:
                self.token_bytes[i] = bytes(inv[c] for c in s)
        self.special = set(special.values())

    def text(self, ids: list) -> str:
        return b"".join(self.token_bytes[i] for i in ids).decode("utf-8", errors="replace")


# ---------------------------------------------------------------- JSON schema validation (the keywords used here)

KNOWN = {"type", "properties", "required", "additionalProperties", "items", "maxItems", "minItems", "maxLength",
         "minLength", "enum"}


def validate(v, s: dict, path: str = "$") -> list:
    """The ways v breaks schema s (empty: valid)."""
    unknown = set(s) - KNOWN
    if unknown:
        raise ValueError(f"validator does not know {sorted(unknown)}")
    errs = []
    if "enum" in s and not any(v == e and type(v) is type(e) for e in s["enum"]):
        errs.append(f"{path}: {v!r} not in enum")
    t = s.get("type")
    ok = {None: True, "object": isinstance(v, dict), "array": isinstance(v, list), "string": isinstance(v, str),
          "integer": isinstance(v, int) and not isinstance(v, bool),
          "number": isinstance(v, (int, float)) and not isinstance(v, bool), "boolean": isinstance(v, bool),
          "null": v is None}[t]
    if not ok:
        return errs + [f"{path}: {type(v).__name__} is not {t}"]
    if isinstance(v, str):
        if len(v) > s.get("maxLength", len(v)) or len(v) < s.get("minLength", 0):
            errs.append(f"{path}: string length {len(v)} outside [{s.get('minLength', 0)}, {s.get('maxLength')}]")
    if isinstance(v, list):
        if len(v) > s.get("maxItems", len(v)) or len(v) < s.get("minItems", 0):
            errs.append(f"{path}: {len(v)} items outside [{s.get('minItems', 0)}, {s.get('maxItems')}]")
        if "items" in s:
            for i, x in enumerate(v):
                errs += validate(x, s["items"], f"{path}[{i}]")
    if isinstance(v, dict):
        props = s.get("properties", {})
        errs += [f"{path}: missing {k!r}" for k in s.get("required", []) if k not in v]
        if s.get("additionalProperties", True) is False:
            errs += [f"{path}: extra property {k!r}" for k in v if k not in props]
        for k, x in v.items():
            if k in props:
                errs += validate(x, props[k], f"{path}.{k}")
    return errs


def check_output(text: str, schema: dict) -> list:
    """Parse (strict JSON: no NaN / Infinity) and validate; the problems found."""
    def no_const(c):
        raise ValueError(f"non-JSON constant {c}")
    try:
        v = json.loads(text, parse_constant=no_const)
    except ValueError as e:
        return [f"not JSON: {e}"]
    return validate(v, schema)


# ---------------------------------------------------------------- the engines

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


# ---------------------------------------------------------------- one trial (in a child process)

def _classes(tk: Tok):
    """Per-token bool [V] classes that steer the random choice (bytes of the token)."""
    import torch

    def cls(pred):
        return torch.tensor([bool(b) and pred(b) for b in tk.token_bytes], dtype=torch.bool)     # [V]
    return {"closer": cls(lambda b: set(b) <= set(b'"]}')),
            "no_open": cls(lambda b: not (set(b) & set(b"{[,"))),
            "has_close": cls(lambda b: bool(set(b) & set(b"]}"))),
            "ends_item": cls(lambda b: bool(set(b) & set(b'",'))),
            "structural": cls(lambda b: bool(set(b) & set(b'",:')) and not (set(b) & set(b"{["))),}


def pick(ok, eos: int, step: int, end_at: int, rng: random.Random, c: dict) -> int:
    """A seeded random allowed token, a function of the mask alone (engines that agree pick the same tokens).
    First part: uniform among the allowed, but 1 in 5 steps among tokens with a quote or a comma (ends a string or
    a number: short ones, as real JSON's are) and otherwise not closing a container (fuller objects and arrays);
    from end_at on, prefer tokens of closing chars only, then tokens with a separator and no opening bracket (a
    required next property), then tokens opening nothing (so the JSON ends). EOS once the grammar allows it.
    ok: bool [V]."""
    r = rng.random()                        # drawn every step, so the stream stays aligned across engines
    if ok[eos]:
        return eos
    if step >= end_at:
        prefs = (ok & c["closer"], ok & c["structural"], ok & c["no_open"])
    else:
        prefs = (ok & c["ends_item"],) if r < 0.2 else (ok & ~c["has_close"],)
    for p in prefs:
        if p.any():
            ok = p
            break
    ids = ok.nonzero().flatten()            # ids: [n allowed]
    return int(ids[rng.randrange(len(ids))])


# JSON string conformance: inside a string of the schema (bounded by maxLength in flat and nested, unbounded in
# json_object), is each of these accepted? RFC 8259: control characters U+0000-001F must be escaped; every other
# character may appear raw (DEL included); \n, \uXXXX and \/ are escapes every string may use. Accepting a raw
# control character is a bug (the output is not JSON); rejecting something else only narrows what the model may
# write (an engine may insist on one spelling: "A" rather than \u0041).
PROBE_PREFIX = {"flat": '{"name":"a', "nested": '{"id":1,"items":[{"sku":"a', "json_object": '{"k":"a'}
PROBES = {"raw \\x01": ("\x01", False), "raw DEL": ("\x7f", True), "é": ("é", True), "\\n": ("\\n", True),
          "\\u0001": ("\\u0001", True), "\\u0041": ("\\u0041", True), "\\/": ("\\/", True)}


def feed(eng, m, tk: "Tok", data: bytes) -> bool:
    """Whether the engine lets data be generated from m's state: at each point the longest allowed token that
    is a prefix of what is left (so an engine that allows only canonical tokens of forced text still gets it)."""
    by_bytes = getattr(tk, "_by_bytes", None)
    if by_bytes is None:
        by_bytes = tk._by_bytes = {b: i for i, b in enumerate(tk.token_bytes) if b and i not in tk.special}
    i = 0
    while i < len(data):
        ok = to_bool(eng.words(m, eng.mask(m)), tk.V)                       # ok: bool [V]
        for n in range(min(len(data) - i, 64), 0, -1):
            t = by_bytes.get(data[i:i + n])
            if t is not None and ok[t]:
                break
        else:
            return False
        eng.advance(m, t)
        i += n
    return True


def trial(job: dict, conn) -> None:
    """One (engine, vocab, schema): tokenizer setup, compiles, generations, replay of the reference tokens."""
    import resource
    import torch
    torch.set_num_threads(1)
    # A compile that blows up (outlines-core's per-state tables at 128k tokens) must not take the shared
    # machine's memory: past the limit its allocation fails and the trial is reported as failed.
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    lim = vm + int(job["mem_limit_gb"] * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    out: dict = {"status": "ok"}
    try:
        tk = Tok(job["tokenizer"])
        c = _classes(tk)
        t0 = time.perf_counter()
        eng = CLASSES[job["engine"]](tk)
        out["setup_ms"] = (time.perf_counter() - t0) * 1e3
        out["vocab_type"] = getattr(eng, "vocab_type", None)
        comp, compiled = [], None
        for i in range(job["compile_repeats"]):
            t0 = time.perf_counter()
            compiled = eng.compile(job["schema"])
            comp.append((time.perf_counter() - t0) * 1e3)
            conn.send(("compiled", comp[-1]))
            if comp[-1] > 5000:                 # an expensive compile (outlines-core at 128k): once is enough
                break
        out["compile_ms"] = comp
        # The server's torch is warm: the conversion's first calls in a fresh process (lazy op setup) are not its.
        for _ in range(50):
            to_bool(torch.zeros((tk.V + 31) // 32, dtype=torch.int32), tk.V)
        mask_us, conv_us, adv_us, outputs, tokens, ref_masks, step_idx, allowed = [], [], [], [], [], [], [], []
        ns = time.perf_counter_ns
        check_runtime = job["engine"] == "llguidance"
        for seed in range(job["seeds"]):
            # The same generation (same seed, so the same tokens) runs job["runs"] times, each on a fresh matcher;
            # per step the run with the median time counts: a stall of the shared machine in one run does not,
            # a step that is slow every time (an engine building tables lazily per request) does.
            runs = []
            for run in range(job["runs"]):
                # The very first generation uses the matcher the timed compile built (TTFM's first mask).
                m = compiled[1] if seed == 0 and run == 0 else eng.matcher(compiled[0])
                rng = random.Random(seed)
                ids, steps, masks, n_allowed = [], [], [], []
                gc.disable()
                for step in range(3 * job["max_tokens"]):
                    a = ns()
                    raw = eng.mask(m)
                    b = ns()
                    ok = to_bool(eng.words(m, raw), tk.V)                   # ok: bool [V]
                    d = ns()
                    if check_runtime:   # the conversion here is the runtime's own (untimed, once)
                        from runtime.engine.grammar import Matcher
                        shim = type("S", (), {"m": m, "gt": type("G", (), {"vocab_size": tk.V})})()
                        assert torch.equal(Matcher.allowed(shim), ok)
                        check_runtime = False
                    if seed == 0 and run == 0:
                        masks.append(eng.words(m, raw).numpy().tobytes())
                    t = pick(ok, tk.eos, step, job["end_at"], rng, c)
                    if t == tk.eos:
                        break
                    e = ns()
                    eng.advance(m, t)
                    f = ns()
                    steps.append((b - a, d - b, f - e))
                    ids.append(t)
                    if run == 0:
                        n_allowed.append(int(ok.sum()))
                gc.enable()
                if runs and ids != runs[0][0]:
                    raise AssertionError(f"seed {seed}: run {run} took other tokens than run 0 (not deterministic)")
                runs.append((ids, steps, t == tk.eos))
                if run == 0:
                    allowed += n_allowed
                if seed == 0 and run == 0:
                    out["first_step_us"] = sum(steps[0]) / 1e3 if steps else None
                    ref_masks = masks
            ids, _, ended = runs[0]
            for i in range(len(ids)):
                per_run = sorted((r[1][i] for r in runs), key=sum)
                st = per_run[len(per_run) // 2]
                mask_us.append(st[0] / 1e3)
                conv_us.append(st[1] / 1e3)
                adv_us.append(st[2] / 1e3)
                step_idx.append(i)
            text = tk.text(ids)
            outputs.append({"seed": seed, "tokens": len(ids), "text": text, "ended": ended,
                            "errors": check_output(text, job["schema"]) if ended else ["no EOS: unfinished"]})
            tokens.append(ids)
        out.update(mask_us=mask_us, convert_us=conv_us, advance_us=adv_us, outputs=outputs, tokens=tokens,
                   step_idx=step_idx, allowed=allowed,
                   ref_masks=ref_masks)
        if job.get("replay") is not None:       # the reference engine's seed-0 tokens: the masks along them
            m, masks, out["rejected_at"] = eng.matcher(compiled[0]), [], None
            for i, t in enumerate(job["replay"]):
                w = eng.words(m, eng.mask(m)).numpy().tobytes()
                masks.append(w)
                if not _allowed(w, t):
                    out["rejected_at"] = i
                    break
                eng.advance(m, t)
            else:
                masks.append(eng.words(m, eng.mask(m)).numpy().tobytes())    # after the last: EOS allowed?
            out["replay_masks"] = masks
        out["probes"] = {name: feed(eng, eng.matcher(compiled[0]), tk, (PROBE_PREFIX[job["schema_name"]]
                                                                       + body).encode())
                         for name, (body, _) in PROBES.items()}
    except Exception as e:  # noqa: BLE001 - an engine's failure is a row of the report
        out = {"status": "error", "reason": f"{type(e).__name__}: {e}".splitlines()[0][:300],
               "trace": traceback.format_exc()[-2000:]}
    conn.send(("done", out))
    conn.close()


def run_trial(job: dict, compile_timeout: float, run_timeout: float) -> dict:
    """trial() in a forked child; a compile past compile_timeout (or a run past run_timeout) is killed."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=trial, args=(job, child), daemon=True)
    p.start()
    child.close()
    deadline, compiled = time.time() + compile_timeout, False
    try:
        while True:
            left = deadline - time.time()
            if left <= 0 or not parent.poll(left):
                what = "run" if compiled else "compile"
                limit = run_timeout if compiled else compile_timeout
                return {"status": "timeout", "reason": f"{what} exceeded {limit:.0f} s"}
            kind, val = parent.recv()
            if kind == "done":
                return val
            if not compiled:        # the first compile finished: the rest of the trial gets run_timeout
                compiled, deadline = True, time.time() + run_timeout
    except EOFError:
        p.join()
        return {"status": "error", "reason": f"the child died (exit code {p.exitcode}; past the memory limit?)"}
    finally:
        if p.is_alive():
            p.kill()
        p.join()


# ---------------------------------------------------------------- comparison and report

def popcount(b: bytes) -> int:
    return int.from_bytes(b, "little").bit_count()


def compare(tk: Tok, ref: list, other: list, tokens: list, rejected_at) -> dict:
    """Step by step along the reference tokens: how the allowed sets relate (identical, the reference's a strict
    subset, a strict superset, or each allowing tokens the other forbids), with the first step of each kind."""
    n = min(len(ref), len(other))
    kinds = {"identical": 0, "ref_subset": 0, "ref_superset": 0, "both": 0}
    first: dict = {}
    for i in range(n):
        a, b = int.from_bytes(ref[i], "little"), int.from_bytes(other[i], "little")
        only_a, only_b = a & ~b, b & ~a
        k = ("identical" if a == b else "ref_subset" if not only_a else "ref_superset" if not only_b else "both")
        kinds[k] += 1
        if k != "identical" and k not in first:
            def show(bits: int) -> str:
                ids = [j for j in range(tk.V) if (bits >> j) & 1]
                return f"{len(ids)}: " + " ".join(repr(tk.token_bytes[j] if j != tk.eos else EOS_TEXT)[1:]
                                                  for j in ids[:4]) + (" ..." if len(ids) > 4 else "")
            first[k] = {"step": i, "after": tk.text(tokens[:i])[-24:], "only_ref": show(only_a),
                        "only_this": show(only_b)}
    return {"compared": n, **kinds, "rejected_at": rejected_at, "first": first}


def _allowed(mask: bytes, t: int) -> bool:
    return bool((mask[t // 8] >> (t % 8)) & 1)


def stats(xs: list) -> dict:
    import numpy as np
    if not xs:
        return {"mean": float("nan"), "p50": float("nan"), "p99": float("nan")}
    a = np.asarray(xs)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def fmt(x, nd=1) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    if isinstance(x, float):
        return f"{x:,.{nd}f}"
    return str(x)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4,096 vocab, the flat schema, one short run (seconds)")
    ap.add_argument("--outdir", default=None, help="where grammar_engines.md goes (default bench/results; --quick: "
                                                   "a temporary folder)")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--vocab", default=None, help="vocab sizes, comma-separated (default 4096,128000)")
    ap.add_argument("--schemas", default=None, help=f"of {', '.join(SCHEMAS)} (default all)")
    ap.add_argument("--seeds", type=int, default=None, help="generations per trial (default 5)")
    ap.add_argument("--max-tokens", type=int, default=None, help="about this many tokens per generation (200)")
    ap.add_argument("--runs", type=int, default=None, help="times each generation runs; per step the median "
                                                             "(default 3)")
    ap.add_argument("--compile-repeats", type=int, default=None, help="fresh compiles timed (default 3)")
    ap.add_argument("--compile-timeout", type=float, default=120.0, help="seconds before a compile is killed")
    ap.add_argument("--mem-limit-gb", type=float, default=8.0, help="address space a trial may add (GB)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "tiered-moe-grammar-bench"),
                    help="where the trained tokenizers are cached")
    a = ap.parse_args(argv)
    q = a.quick
    vocabs = [int(v) for v in (a.vocab or ("4096" if q else "4096,128000")).split(",")]
    schemas = (a.schemas or ("flat" if q else ",".join(SCHEMAS))).split(",")
    seeds = a.seeds or (1 if q else 5)
    max_tokens = a.max_tokens or (60 if q else 200)
    repeats = a.compile_repeats or (1 if q else 3)
    runs = a.runs or (1 if q else 3)
    outdir = a.outdir or (tempfile.mkdtemp(prefix="grammar-engines-") if q else RESULTS)
    cmd = "python bench/grammar_engines.py" + " ".join([""] + (argv if argv is not None else sys.argv[1:]))
    started = time.time()

    engines, skipped = [], {}
    for name in a.engines.split(","):
        why = importable(name)
        if why:
            skipped[name] = why
            print(f"skipping {name}: {why}", file=sys.stderr)
        else:
            engines.append(name)
    versions = {}
    for name in engines:
        versions[MODULE[name]] = engine_version(name)
    import importlib.metadata as md
    for p in ("torch", "tokenizers", "transformers", "apache-tvm-ffi"):
        try:
            versions[p] = md.version(p)
        except md.PackageNotFoundError:
            pass

    os.makedirs(a.workdir, exist_ok=True)
    toks, tok_info = {}, {}
    for V in vocabs:
        path = os.path.join(a.workdir, f"bpe{V}.json")
        if not os.path.exists(path):
            print(f"training the {V:,}-token byte-level BPE ...", file=sys.stderr)
            t0 = time.time()
            # Forked, so this process never holds rayon's threads when it forks the trials.
            p = mp.get_context("fork").Process(target=train_tokenizer, args=(path, V))
            p.start()
            p.join()
            if p.exitcode != 0:
                raise SystemExit(f"training the {V}-token tokenizer failed (exit {p.exitcode})")
            print(f"  {time.time() - t0:.1f} s", file=sys.stderr)
        toks[V] = Tok(path)
        with open(path + ".info") as f:
            tok_info[V] = json.load(f)

    jobs = [(V, s, e) for V in vocabs for s in schemas for e in engines]
    ref_engine = next((e for e in ("llguidance", "llguidance-inplace") if e in engines),
                      engines[0] if engines else None)
    try:
        from tqdm import tqdm
        bar = tqdm(total=len(jobs), desc="trials", unit="trial", file=sys.stderr)
    except ImportError:
        bar = None
    results, refs = [], {}
    for V, s, e in jobs:
        if bar is not None:
            bar.set_postfix_str(f"{e} V={V} {s}")
        else:
            print(f"[{len(results) + 1}/{len(jobs)}] {e} V={V} {s}", file=sys.stderr, flush=True)
        job = {"engine": e, "tokenizer": toks[V].path, "schema": SCHEMAS[s], "schema_name": s, "seeds": seeds,
               "max_tokens": max_tokens, "end_at": int(0.6 * max_tokens), "compile_repeats": repeats, "runs": runs,
               "mem_limit_gb": a.mem_limit_gb,
               "replay": None if e == ref_engine else (refs.get((V, s)) or {}).get("tokens")}
        r = run_trial(job, a.compile_timeout, 600.0)
        r.update(engine=e, vocab=V, schema=s)
        if e == ref_engine and r["status"] == "ok":
            refs[(V, s)] = {"tokens": r["tokens"][0], "masks": r["ref_masks"]}
        results.append(r)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()

    # ---- aggregate
    rows, agree_rows, bad = [], [], []
    for r in results:
        V, s, e = r["vocab"], r["schema"], r["engine"]
        if r["status"] != "ok":
            rows.append([V, s, e, r["status"] + ": " + r["reason"]] + ["-"] * 11)
            continue
        tot = [m + c + d for m, c, d in zip(r["mask_us"], r["convert_us"], r["advance_us"])]
        st = stats(tot)
        comp = statistics.median(r["compile_ms"])
        valid = sum(not o["errors"] for o in r["outputs"])
        for o in r["outputs"]:
            if o["errors"]:
                bad.append((V, s, e, o["seed"], o["errors"][:3], o["text"][:200]))
        ref = refs.get((V, s))
        same = "ref" if e == ref_engine else ("-" if ref is None else
                                             ("yes" if r["tokens"][0] == ref["tokens"] else "no"))
        r["summary"] = {"step": st, "mask_mean": stats(r["mask_us"])["mean"],
                        "convert_mean": stats(r["convert_us"])["mean"], "advance_mean": stats(r["advance_us"])["mean"],
                        "compile_ms": comp, "ttfm_ms": comp + (r["first_step_us"] or 0) / 1e3, "steps": len(tot),
                        "valid": valid, "runs": len(r["outputs"])}
        rows.append([V, s, e, fmt(r["setup_ms"], 0), fmt(comp, 2), fmt(r["summary"]["ttfm_ms"], 2), len(tot),
                     fmt(st["mean"]), fmt(st["p50"]), fmt(st["p99"]), fmt(r["summary"]["mask_mean"]),
                     fmt(r["summary"]["convert_mean"]), fmt(r["summary"]["advance_mean"]),
                     f"{valid}/{len(r['outputs'])}", same])
        if ref is not None and e != ref_engine and "replay_masks" in r:
            cmp = compare(toks[V], ref["masks"], r["replay_masks"], ref["tokens"], r["rejected_at"])
            r["agreement"] = cmp
            ex = "; ".join(f"{k} at step {f['step']} after {f['after']!r}: only {ref_engine} {f['only_ref']}; "
                           f"only {e} {f['only_this']}" for k, f in cmp["first"].items())
            agree_rows.append([V, s, e, cmp["compared"], cmp["identical"], cmp["ref_subset"], cmp["ref_superset"],
                               cmp["both"], "-" if cmp["rejected_at"] is None else cmp["rejected_at"],
                               "`" + ex.replace("`", "'").replace("|", "\\|") + "`" if ex else "-"])

    # ---- report
    L = ["# Structured-output grammar engines: per-token overhead", "",
         f"Command: `{cmd}`", "",
         f"Machine: {platform.machine()}, {os.cpu_count()} cores ({cpu_model()}, a shared VM), Python "
         f"{platform.python_version()}; torch at 1 intra-op thread in the trials.", "",
         "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".", ""]
    if skipped:
        L += ["Skipped (not importable here): " + "; ".join(f"{k}: {v}" for k, v in skipped.items()) + ".", ""]
    L += ["Tokenizers (the same tokenizer.json for every engine): a byte-level BPE trained here with HF tokenizers "
          "(GPT-2 style ByteLevel pre-tokenizer and decoder, the 256 bytes as base alphabet, min_frequency 2, "
          f"`{EOS_TEXT}` = token 0 = EOS) on the .py and .md files, in sorted order, of:"]
    for V in vocabs:
        i = tok_info[V]
        L.append(f"- {V:,} requested, {toks[V].V:,} tokens: {i['files']:,} files, {i['bytes'] / 1e6:.1f} MB "
                 f"from {', '.join(i['roots'])} (the repository without .venv/.git; capped at 64 MB)")
    vt = sorted({f"{r['vocab_type']} at {r['vocab']:,}" for r in results if r.get("vocab_type")})
    if vt:
        L.append(f"- xgrammar's TokenizerInfo.from_huggingface read them as {', '.join(vt)}; llguidance got the "
                 "tokenizer.json path (as the runtime passes it), outlines-core a Vocabulary of each token's bytes "
                 "(the byte-level strings decoded)")
    L += ["", f"Schemas: {', '.join(f'`{s}`' for s in schemas)} (in the script: SCHEMAS); every engine in compact "
          "JSON with no free whitespace (llguidance separators \",\" and \":\", xgrammar any_whitespace=False "
          "separators (\",\", \":\") strict_mode=False, outlines-core whitespace_pattern \"\"; the schemas say "
          "additionalProperties false themselves).", "",
          f"Per trial: {repeats} fresh compile(s) (median; xgrammar's cache off; one only when it takes over 5 s), "
          f"then {seeds} generation(s) (seeds 0..{seeds - 1}) of up to ~{max_tokens} tokens: a seeded random "
          f"allowed token, steered to close the JSON from token {int(0.6 * max_tokens)} on; a step = the engine's "
          "mask + conversion to bool [vocab] (runtime Matcher.allowed's expression) + advancing by the token. "
          f"Each generation runs {runs} time(s) on fresh matchers (the same tokens each time); per step the run "
          "with the median time counts (a stall of this shared machine in one run does not; a step slow every time "
          "does). Timed with perf_counter_ns, GC off during the loop; the EOS step is not counted.", "",
          "Columns: setup = the engine's tokenizer object (once per server); compile = schema -> matcher ready; "
          "TTFM = compile + the first step (time to first mask); step = mask + convert + advance (us per token); "
          "valid = generations that parse as JSON and validate; same tokens = the seed-0 generation is token for "
          f"token the reference's ({ref_engine}).", "",
          "| vocab | schema | engine | setup ms | compile ms | TTFM ms | steps | step mean us | p50 | p99 | "
          "mask us | convert us | advance us | valid | same tokens |",
          "|" + "---|" * 15]
    L += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    L.append("")

    # The headline: per vocab, over the schemas every engine completed (so engines are compared on the same
    # work), every step of every generation; "from step 10" leaves out each generation's first 10 steps (where an
    # engine that builds its tables lazily per request pays for that).
    summary: dict = {}
    common = {V: [s for s in schemas
                  if all(r["status"] == "ok" for r in results if (r["vocab"], r["schema"]) == (V, s))] for V in vocabs}
    for r in results:
        d = summary.setdefault((r["vocab"], r["engine"]), {"tot": [], "steady": [], "engine": [], "ttfm": {},
                                                            "wide": [], "narrow": [],
                                                            "invalid": [], "runs": 0, "failed": []})
        if r["status"] != "ok":
            d["failed"].append(f"{r['schema']} ({r['status']}: {r['reason']})")
            continue
        d["ttfm"][r["schema"]] = r["summary"]["ttfm_ms"]
        d["runs"] += len(r["outputs"])
        d["invalid"] += [f"{r['schema']} seed {o['seed']}: {o['errors'][0]}" for o in r["outputs"] if o["errors"]]
        if r["schema"] in common[r["vocab"]]:
            tot = [m + c + x for m, c, x in zip(r["mask_us"], r["convert_us"], r["advance_us"])]
            d["tot"] += tot
            d["steady"] += [t for t, i in zip(tot, r["step_idx"]) if i >= 10]
            d["engine"] += [m + x for m, x in zip(r["mask_us"], r["advance_us"])]
            # "wide" steps: more than half the vocab allowed (free text: inside a string); the rest "narrow"
            for t, n in zip(tot, r["allowed"]):
                d["wide" if n > r["vocab"] // 2 else "narrow"].append(t)
    L += ["Per token, per vocab, over the schemas every engine completed (every step of every generation); wide "
          "steps = more than half the vocab allowed (free text inside a string), narrow = the rest:", "",
          "| vocab | schemas | engine | steps | step mean us | p50 | p99 | mean from step 10 | wide steps: share, "
          "mean us | narrow steps: mean us | engine part (mask + advance) mean us | conversion mean us | "
          "worst TTFM ms (all schemas) | invalid outputs |",
          "|" + "---|" * 14]
    best = {}
    for (V, e), d in sorted(summary.items()):
        if not d["tot"]:
            continue
        st = stats(d["tot"])
        conv = st["mean"] - stats(d["engine"])["mean"]
        worst = max(d["ttfm"].values()) if d["ttfm"] else float("nan")
        L.append(f"| {V:,} | {', '.join(common[V])} | {e} | {len(d['tot'])} | {st['mean']:.1f} | {st['p50']:.1f} | "
                 f"{st['p99']:.1f} | {stats(d['steady'])['mean']:.1f} | "
                 f"{len(d['wide']) / len(d['tot']):.0%}, {fmt(stats(d['wide'])['mean'])} | "
                 f"{fmt(stats(d['narrow'])['mean'])} | {stats(d['engine'])['mean']:.1f} | "
                 f"{conv:.1f} | {fmt(worst, 1)}{' + failed: ' + '; '.join(d['failed']) if d['failed'] else ''} | "
                 f"{len(d['invalid'])}/{d['runs']} |")
        d["mean"] = st["mean"]
        if V not in best or st["mean"] < best[V][1]:
            best[V] = (e, st["mean"])
    L.append("")
    if agree_rows:
        L += [f"Allowed-token sets along the reference's ({ref_engine}) seed-0 tokens (the masks compared step by "
              f"step, the EOS step included): identical, {ref_engine}'s a strict subset (it forbids tokens this "
              "engine allows), a strict superset, or each allowing tokens the other forbids; 'rejected at' = the "
              "step whose reference token this engine forbids (the replay stops there); examples: the first step "
              "of each kind, the text before it, the tokens only one side allows (count: first few).", "",
              "| vocab | schema | engine | steps | identical | ref subset | ref superset | both | rejected at | "
              "first of each kind |", "|---|---|---|---|---|---|---|---|---|---|"]
        L += ["| " + " | ".join(str(x) for x in row) + " |" for row in agree_rows]
        L.append("")
    probe_rows = [[r["vocab"], r["schema"], r["engine"]] +
                  [("yes" if r["probes"][k] else "no") + ("" if r["probes"][k] == want else " (!)")
                   for k, (_, want) in PROBES.items()] for r in results if r.get("probes")]
    if probe_rows:
        L += ["JSON string conformance: inside a string of the schema (flat, nested: with maxLength; json_object: "
              "without), is this accepted (fed token by token, the longest allowed token first)? RFC 8259: "
              "control characters must be escaped, DEL and any other character may be raw, the escapes are "
              "valid in every string. (!) = differs from RFC 8259: accepting a raw control character lets the "
              "engine produce text that is not JSON (a bug); rejecting an escape or a character only narrows what "
              "the model may write (the same string may have another spelling: `A` for `\\u0041`, `/` for `\\/`; "
              "a newline has none but `\\n`).", "",
              "| vocab | schema | engine | " + " | ".join(f"`{k}`" for k in PROBES) + " |",
              "|" + "---|" * (3 + len(PROBES))]
        L += ["| " + " | ".join(str(x) for x in row) + " |" for row in probe_rows]
        L.append("")
    if bad:
        L += ["Invalid outputs:", ""] + [f"- {V} {s} {e} seed {sd}: {errs}: `{t!r}`" for V, s, e, sd, errs, t in bad]
        L.append("")
    L += ["## Conclusion", ""] + verdict(summary, best, vocabs, toks, common, results)
    L += ["", f"Run time: {time.time() - started:.0f} s.", ""]
    text = "\n".join(L)
    os.makedirs(outdir, exist_ok=True)
    path = os.path.join(outdir, "grammar_engines.md")
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}", file=sys.stderr)
    bulky = ("ref_masks", "replay_masks", "mask_us", "convert_us", "advance_us", "step_idx", "allowed")
    data = {"command": cmd, "versions": versions, "skipped": skipped, "vocabs": {V: toks[V].V for V in vocabs},
            "tokenizers": tok_info, "report": path,
            "results": [{k: v for k, v in r.items() if k not in bulky} for r in results]}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(data, f, indent=1, default=str)
    return data


def verdict(summary: dict, best: dict, vocabs: list, toks: dict, common: dict, results: list) -> list:
    """The conclusion, from the numbers: the lowest per-token overhead per vocab (overall and per schema), and
    what each engine faster than llguidance (as the runtime calls it) costs otherwise - time to first mask per
    new schema, invalid outputs, JSON strings it gets wrong (any vocab)."""
    ok = [r for r in results if r["status"] == "ok"]
    invalid, against = {}, {}
    for r in ok:
        invalid.setdefault(r["engine"], []).extend(f"vocab {r['vocab']:,} {r['schema']} seed {o['seed']}"
                                                   for o in r["outputs"] if o["errors"])
        for k, (_, want) in PROBES.items():
            if r.get("probes", {}).get(k, want) != want:
                against.setdefault(r["engine"], {}).setdefault(k, set()).add(r["schema"])
    out, extra, reasons = [], [], {}
    # A faster engine's drawback in any vocab counts (a wrong string grammar is wrong at every vocab size).
    drawbacks = {x: bool(invalid.get(x)) or any(not PROBES[k][1] for k in against.get(x, {})) for x in invalid}
    for V in vocabs:
        if V not in best:
            continue
        eng = {e: d for (v, e), d in summary.items() if v == V and d["tot"]}
        e, mean = best[V]
        line = (f"- vocab {toks[V].V:,} (schemas {', '.join(common[V])}): lowest per-token overhead: **{e}**, "
                f"{mean:.1f} us per step (mask + conversion + advance)")
        llg = eng.get("llguidance")
        if llg is not None and e != "llguidance":
            line += (f"; llguidance as the runtime calls it: {llg['mean']:.1f} us ({llg['mean'] / mean:.2f}x, "
                     f"{llg['mean'] - mean:.0f} us more per token)")
        per = []
        for s in common[V]:
            rs = {r["engine"]: r["summary"]["step"]["mean"] for r in ok if (r["vocab"], r["schema"]) == (V, s)}
            w = min(rs, key=rs.get)
            per.append(f"{s}: {w} {rs[w]:.1f} us" + (f" (llguidance {rs['llguidance']:.1f})"
                                                      if "llguidance" in rs and w != "llguidance" else ""))
        out.append(line + ". Per schema, the fastest: " + "; ".join(per) + ".")
        if llg is None:
            continue
        faster = [x for x in eng if not x.startswith("llguidance") and eng[x]["mean"] < llg["mean"]]
        for x in faster:
            d, why = eng[x], []
            worst_x = max(d["ttfm"].values()) if d["ttfm"] else float("nan")
            worst_l = max(llg["ttfm"].values()) if llg["ttfm"] else float("nan")
            if d["failed"]:
                why.append(f"failed on {'; '.join(d['failed'])}")
            if worst_x > 5 * worst_l and worst_x > 10:
                why.append(f"its time to first mask reaches {worst_x:,.0f} ms per new schema (llguidance "
                           f"{worst_l:,.1f} ms)")
            if invalid.get(x):
                why.append(f"{len(invalid[x])} invalid output(s) in this run ({', '.join(invalid[x][:3])})")
            if against.get(x):
                why.append("differs from RFC 8259 in strings: " + ", ".join(
                    f"{'accepts' if not PROBES[k][1] else 'rejects'} {k} ({', '.join(sorted(sch))})"
                    for k, sch in against[x].items()))
            reasons[x] = reasons.get(x, []) + why
            out.append(f"  - {x} is faster per token ({d['mean']:.1f} us); " +
                       ("but " + "; ".join(why) if why else "with no failure, invalid output or slow compile here")
                       + ".")
        if not faster:
            out.append("  - no other engine is faster per token here.")
        for x in faster:
            extra.append((V, x, llg["mean"] - eng[x]["mean"], bool(drawbacks.get(x)) or bool(reasons[x])))
        conv = {x: eng[x]["mean"] - stats(eng[x]["engine"])["mean"] for x in eng}
        fastest = min(eng, key=lambda x: eng[x]["mean"])
        out.append(f"  - the conversion to bool [vocab] (the runtime's expression, the same for every engine) costs "
                   f"{min(conv.values()):.0f}-{max(conv.values()):.0f} us per token here: "
                   f"{conv[fastest] / eng[fastest]['mean']:.0%} of {fastest}'s step.")
    if against.get("llguidance"):
        out.append("- llguidance differs from RFC 8259 in strings: " + ", ".join(
            f"{'accepts' if not PROBES[k][1] else 'rejects'} {k} ({', '.join(sorted(sch))})"
            for k, sch in against["llguidance"].items()) + ".")
    out += ["", "For scale: bench/results/decode_speed.md measures about 100 tokens/s at batch 1 for the demo model "
                "on this machine (about 10 ms a step); a real model's step is longer."]
    if extra:
        worst = max(extra, key=lambda x: x[2])
        clean = [f"{x} (vocab {V:,})" for V, x, _, bad in extra if not bad]
        out += ["", "**Verdict.** llguidance is not the fastest per token: " + "; ".join(
            f"{x} saves {d:.0f} us per token at vocab {V:,}" for V, x, d, _ in extra) + ". "
            + (f"Keeping llguidance is not justified by these numbers: {', '.join(clean)} is faster with none of "
               "the drawbacks measured here." if clean else
               f"Keeping llguidance is justified all the same: every faster engine has a drawback listed above (a "
               f"slow first mask for each new schema, JSON it gets wrong, or both), and the most llguidance costs "
               f"extra is {worst[2]:.0f} us per token "
               f"({worst[2] / 1e4:.1%} of a 10 ms decode step).")]
    elif summary:
        out += ["", "**Verdict.** No engine measured here is faster per token than llguidance: keeping it is "
                    "justified."]
    return out


if __name__ == "__main__":
    main()
