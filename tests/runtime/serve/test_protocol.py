import msgpack
import pytest

from runtime.serve.protocol import ProtocolError, decode, encode


def test_round_trip_is_plain_msgpack():
    frame = encode("add", rid="r1", prompt=[1, 2, 3], params={"max_tokens": 4})
    # A plain msgpack map any language can read - not a pickle.
    assert msgpack.unpackb(frame) == {"type": "add", "v": 3, "rid": "r1", "prompt": [1, 2, 3], "params": {"max_tokens": 4}}
    assert decode(frame)["prompt"] == [1, 2, 3]


@pytest.mark.parametrize("frame, match", [
    (b"\xc1garbage", "undecodable"),
    (msgpack.packb([1, 2]), "not a known message"),
    (msgpack.packb({"type": "launch"}), "not a known message"),
    (msgpack.packb({"type": "abort", "v": 99, "rid": "x"}), "protocol version 99"),
    (msgpack.packb({"type": "add", "v": 3, "rid": "x", "prompt": "text", "params": {}}), "'prompt'"),
    (__import__("pickle").dumps({"type": "abort"}), "undecodable|not a known"),
])
def test_malformed_frames_name_the_problem(frame, match):
    with pytest.raises(ProtocolError, match=match):
        decode(frame)


def test_unknown_type_cannot_be_sent():
    with pytest.raises(ProtocolError):
        encode("exec", code="rm -rf /")
