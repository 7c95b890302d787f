"""The bench's tokenizers: byte-level BPEs trained here on text at hand (this repository's .py / .md, then the
system Python's library), and ``Tok``, a tokenizer.json as the bench sees it."""
from __future__ import annotations

import glob
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EOS_TEXT = "<|endoftext|>"


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

