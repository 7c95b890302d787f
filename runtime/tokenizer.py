"""Text <-> token ids from the checkpoint's own tokenizer.json (the `tokenizers` package)."""
from __future__ import annotations

import os


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

    def encode(self, text: str) -> list:
        if self.tok is None:
            raise ValueError("this model has no tokenizer.json: pass --prompt-ids 1,2,3 instead of --prompt")
        return self.tok.encode(text).ids

    def decode(self, ids: list) -> str:
        if self.tok is None:
            return " ".join(str(i) for i in ids)
        return self.tok.decode(ids)
