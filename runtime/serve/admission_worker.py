"""An admission worker (admission.py starts it): ``python -m runtime.serve.admission_worker TOKENIZER VOCAB EOS
PARENT``. One JSON line in ({"fmt", "text"}), one out ({"ok", "error", "seconds"}) per grammar; a first line
({"ready"}) once its tokenizer is indexed. It imports llguidance and runtime/engine/grammar.py alone - not the engine
package, whose import pulls torch and the model (a second and a half of CPU at each start; a worker killed for its
budget is replaced) - and runs at a lower priority than the engine (``NICE``)."""
from __future__ import annotations

import json
import os
import sys
import time

from ..proc import watch_parent

NICE = 10                       # the worker's priority below the engine's
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load_grammar():
    """runtime/engine/grammar.py on its own."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "tiered_moe_grammar", os.path.join(_ROOT, "runtime", "engine", "grammar.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def worker_main(argv: list) -> int:
    """Compiles each grammar it is sent; answers whether it compiled."""
    from llguidance import LLTokenizer
    tokenizer_json, vocab, eos, parent = argv[0], int(argv[1]), json.loads(argv[2]), int(argv[3])
    watch_parent(parent)
    try:
        os.nice(NICE)
    except OSError:
        pass
    grammar = _load_grammar()
    tok = LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos or [0])
    out = sys.stdout.buffer
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        job = json.loads(line)
        t0 = time.process_time()
        try:
            grammar.compile_grammar(tok, job["fmt"], job["text"])
            reply = {"ok": True}
        except ValueError as e:
            reply = {"ok": False, "error": grammar.short(e)}
        reply["seconds"] = time.process_time() - t0
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
