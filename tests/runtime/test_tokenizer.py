"""Token bytes (OpenAI's logprobs ``bytes``): what a token stands for where it is part of a character."""
from tokenizers import Tokenizer as HF
from tokenizers import decoders, models

from runtime.tokenizer import Tokenizer


def _wrap(hf) -> Tokenizer:
    t = Tokenizer.__new__(Tokenizer)
    t.tok = hf
    return t


def test_byte_level_pieces(tmp_path):
    from runtime.model.synthetic import write_byte_tokenizer
    write_byte_tokenizer(str(tmp_path), 260)
    t = Tokenizer(str(tmp_path))
    ids = t.encode("é€")                       # 2 + 3 bytes, one token each
    assert len(ids) == 5 and all(t.decode([i]) == "\ufffd" for i in ids)
    assert b"".join(t.token_bytes(i) for i in ids) == "é€".encode()
    assert t.token_bytes(t.encode("a")[0]) == b"a"


def test_byte_fallback_pieces():
    """SentencePiece-style byte fallback: <0xAB> pieces (Llama, Mistral, DeepSeek-V2)."""
    vocab = {"<unk>": 0, "a": 1, "<0xC3>": 2, "<0xA9>": 3}
    hf = HF(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    hf.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    t = _wrap(hf)
    ids = hf.encode("aé").ids
    assert ids == [1, 2, 3]
    assert [t.token_bytes(i) for i in ids] == [b"a", b"\xc3", b"\xa9"]
