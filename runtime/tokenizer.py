"""Text <-> token ids from the checkpoint's own tokenizer.json (the `tokenizers` package)."""
from __future__ import annotations

import os
import re


def bytes_to_unicode() -> dict:
    """GPT-2's byte -> printable character table (what a byte-level BPE's vocabulary strings are written in):
    printable bytes map to themselves, the rest to code points from 256 on."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


class Tokenizer:
    def __init__(self, model_dir: str) -> None:
        path = os.path.join(model_dir, "tokenizer.json")
        self.tok = None
        if os.path.exists(path):
            from tokenizers import Tokenizer as HFTokenizer
            try:
                self.tok = HFTokenizer.from_file(path)
            except Exception as e:  # noqa: BLE001 - the tokenizers error names no file
                raise ValueError(f"{path}: not a readable tokenizer ({e})") from None

    @property
    def available(self) -> bool:
        return self.tok is not None

    def encode(self, text: str, special: bool = True) -> list:
        """``special``: with the tokens the tokenizer's post-processor adds (a BOS)."""
        if self.tok is None:
            raise ValueError("this model has no tokenizer.json: pass --prompt-ids 1,2,3 instead of --prompt")
        if len(text) > 2048:
            # encode holds the GIL throughout (0.36 s for 260,000 characters: a server's event loop frozen that
            # long); encode_batch releases it while it works - the same ids
            return self.tok.encode_batch([text], add_special_tokens=special)[0].ids
        return self.tok.encode(text, add_special_tokens=special).ids

    def decode(self, ids: list, keep: "frozenset | set" = frozenset()) -> str:
        """Text of ``ids`` without special tokens (EOS, chat-turn markers), except those in ``keep`` (a tool-call
        format's markers, which its parser reads)."""
        if self.tok is None:
            return " ".join(str(i) for i in ids)
        if not keep:
            return self.tok.decode(ids)
        special = self.special_ids
        return self.tok.decode([i for i in ids if i not in special or i in keep], skip_special_tokens=False)

    def token_bytes(self, tid: int) -> bytes:
        """The bytes token ``tid`` stands for - part of a character where the tokenizer splits one (OpenAI's
        logprobs ``bytes``: a client joins them to rebuild such characters): a byte-fallback piece ``<0xAB>``, a
        byte-level BPE piece in GPT-2's byte alphabet, else the token's text."""
        text = self.decode([tid])
        if self.tok is None or "\ufffd" not in text:
            return text.encode("utf-8")
        piece = self.tok.id_to_token(tid) or ""
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        if m:
            return bytes([int(m.group(1), 16)])
        inv = {c: b for b, c in bytes_to_unicode().items()}
        if piece and all(c in inv for c in piece):
            return bytes(inv[c] for c in piece)
        return text.encode("utf-8")

    def token_id(self, text: str) -> "int | None":
        """The id of the one token whose text this is (an added / special token, or a vocabulary entry); None."""
        return None if self.tok is None else self.tok.token_to_id(text)

    @property
    def special_ids(self) -> frozenset:
        """Ids of the added tokens marked special (their bytes are not text)."""
        if getattr(self, "_special", None) is None:
            self._special = frozenset(i for i, t in self.tok.get_added_tokens_decoder().items() if t.special) \
                if self.tok is not None else frozenset()
        return self._special
