import msgpack
import pytest

from runtime.serve.protocol import PROTOCOL_VERSION, ProtocolError, decode, encode


def test_round_trip_is_plain_msgpack():
    frame = encode("add", rid="r1", prompt=[1, 2, 3], params={"max_tokens": 4})
    # A plain msgpack map any language can read - not a pickle.
    assert msgpack.unpackb(frame) == {"type": "add", "v": PROTOCOL_VERSION, "rid": "r1", "prompt": [1, 2, 3],
                                    "params": {"max_tokens": 4}}
    assert decode(frame)["prompt"] == [1, 2, 3]


@pytest.mark.parametrize("frame, match", [
    (b"\xc1garbage", "undecodable"),
    (msgpack.packb([1, 2]), "not a known message"),
    (msgpack.packb({"type": "launch"}), "not a known message"),
    (msgpack.packb({"type": "abort", "v": 99, "rid": "x"}), "protocol version 99"),
    (msgpack.packb({"type": "add", "v": PROTOCOL_VERSION, "rid": "x", "prompt": "text", "params": {}}), "'prompt'"),
    (msgpack.packb({"type": "add", "v": PROTOCOL_VERSION, "rid": "x", "prompt": [1], "params": {}, "cache_salt": 5}),
     "'cache_salt' missing or not str or NoneType"),
    (__import__("pickle").dumps({"type": "abort"}), "undecodable|not a known"),
])
def test_malformed_frames_name_the_problem(frame, match):
    with pytest.raises(ProtocolError, match=match):
        decode(frame)


def test_unknown_type_cannot_be_sent():
    with pytest.raises(ProtocolError):
        encode("exec", code="rm -rf /")
