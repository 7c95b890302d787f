"""The llama.cpp side of bench/vs_llama_cpp.py: its source tree (the llama-cpp-python sdist's vendor/llama.cpp,
built CPU-only), GGUF files converted and quantized from a transformers checkpoint, llama-bench / llama-batched-bench
runs, and the checkpoints both sides read (built with transformers, a trained byte-level BPE tokenizer)."""
import json
import os
import random
import shlex
import subprocess
import sys
import tarfile
import time

import torch

from decode_speed import NEW, PROMPT

SDIST = "0.3.36"
TARGETS = ("llama-bench", "llama-quantize", "llama-batched-bench")
CMAKE_FLAGS = ["-DGGML_CUDA=OFF", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DCMAKE_BUILD_TYPE=Release",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"]

# ours -> (llama.cpp type, our --quantize, llama.cpp bits per routed weight)
FORMATS = {"bf16": ("BF16", None, 16.0), "int4": ("Q4_0", "int4", 4.5), "mxfp4": ("MXFP4_MOE", "mxfp4", 4.25),
           # The same bytes on both sides: llama.cpp's routed experts 4-bit, every other weight left bf16, as
           # our 4-bit stores hold them (stock Q4_0 quantizes attention and the head too; MXFP4_MOE makes them Q8_0)
           "int4-x": ("Q4_0", "int4", 4.5), "mxfp4-x": ("MXFP4_MOE", "mxfp4", 4.25)}
EXPERTS_ONLY = {"int4-x", "mxfp4-x"}
# Every block tensor but the routed experts (*_exps) bf16: attention, MLA's factors, Gated DeltaNet's projections,
# shared experts and dense MLPs (llama-quantize matches --tensor-type as an ECMAScript regex; 1-D tensors and the
# router stay float32 as it leaves them), and the head and embedding.
KEEP_BF16 = ["--tensor-type", r"^blk\.[0-9]+\.(?!ffn_[a-z]+_exps)=bf16", "--output-tensor-type", "bf16",
             "--token-embedding-type", "bf16"]


# Run convert_hf_to_gguf.py with an unknown BPE pre-tokenizer named "qwen2" instead of refused.
CONVERT_SHIM = r"""
import runpy, sys
tree = sys.argv[1]
sys.path[:0] = [tree, tree + "/gguf-py"]
from conversion.base import TextModel
orig = TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return orig(self, tokenizer)
    except NotImplementedError:
        print("vs_llama_cpp: unrecognized BPE pre-tokenizer hash -> 'qwen2'", flush=True)
        return "qwen2"
TextModel.get_vocab_base_pre = pre
# Llama-family converters (Mixtral) try a SentencePiece tokenizer first and fall back on FileNotFoundError, but
# import sentencepiece before looking for tokenizer.model: without the package, say the file is not there
orig_sp = TextModel._create_vocab_sentencepiece
def create_sp(self):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError(self.dir_model / "tokenizer.model")
    return orig_sp(self)
TextModel._create_vocab_sentencepiece = create_sp
sys.argv = [tree + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sh(cmd: list, env=None, quiet=True) -> str:
    """Run a command, raise with its output tail on failure; returns stdout."""
    p = subprocess.run(cmd, capture_output=quiet, text=True, env=env)
    if p.returncode:
        tail = ((p.stdout or "") + (p.stderr or ""))[-3000:]
        raise RuntimeError(f"failed ({p.returncode}): {shlex.join(cmd)}\n{tail}")
    return p.stdout or ""


# -- llama.cpp -----------------------------------------------------------------------------------
def llama_tree(llama_dir: "str | None", cache: str) -> tuple:
    """(source tree, bin dir): the sdist downloaded and extracted into ``cache`` unless ``llama_dir``
    is given; the three targets built unless present."""
    if llama_dir:
        tree = os.path.abspath(llama_dir)
    else:
        tree = os.path.join(cache, f"llama_cpp_python-{SDIST}", "vendor", "llama.cpp")
        if not os.path.isfile(os.path.join(tree, "CMakeLists.txt")):
            os.makedirs(cache, exist_ok=True)
            sdist = os.path.join(cache, f"llama_cpp_python-{SDIST}.tar.gz")
            if not os.path.exists(sdist):
                log(f"downloading the llama-cpp-python {SDIST} sdist into {cache}")
                sh([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={SDIST}", "-d", cache], quiet=False)
            log("extracting the sdist")
            with tarfile.open(sdist) as tf:
                tf.extractall(cache, filter="data")
    build = os.path.join(tree, "build")
    bindir = os.path.join(build, "bin")
    missing = [t for t in TARGETS if not os.path.exists(os.path.join(bindir, t))]
    if missing:
        if not os.path.exists(os.path.join(build, "CMakeCache.txt")):
            log(f"configuring llama.cpp in {build}")
            sh(["cmake", "-S", tree, "-B", build] + CMAKE_FLAGS, quiet=False)
        log(f"building {', '.join(missing)} (-j2; takes a while on 2 cores)")
        sh(["cmake", "--build", build, "-j2", "--target", *missing], quiet=False)
    return tree, bindir


def ggufs(tree: str, bindir: str, hf: str, work: str, shape: str, formats: list) -> dict:
    """fmt -> GGUF path: bf16 from the converter, the others quantized from it (cached)."""
    bf16 = os.path.join(work, f"{shape}-BF16.gguf")
    if not os.path.exists(bf16):
        log(f"{shape}: convert_hf_to_gguf.py --outtype bf16 -> {bf16}")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, os.path.join(tree, "gguf-py")])}
        with open(os.path.join(hf, "config.json")) as f:
            archs = json.load(f).get("architectures") or []
        # Qwen3-Next's converter expects MTP layers unless told there are none (ours have none)
        extra = ["--no-mtp"] if "Qwen3NextForCausalLM" in archs else []
        sh([sys.executable, "-c", CONVERT_SHIM, tree, hf, "--outtype", "bf16", "--outfile", bf16 + ".part", *extra],
           env=env)
        os.replace(bf16 + ".part", bf16)
    out = {}
    for f in formats:
        kind = FORMATS[f][0]
        tag = kind + ("-experts-only" if f in EXPERTS_ONLY else "")
        path = os.path.join(work, f"{shape}-{tag}.gguf")
        if not os.path.exists(path):
            log(f"{shape}: llama-quantize {tag} -> {path}")
            extra = KEEP_BF16 if f in EXPERTS_ONLY else []
            sh([os.path.join(bindir, "llama-quantize"), *extra, bf16, path + ".part", kind, "2"])
            os.replace(path + ".part", path)
        out[f] = path
    return out


def gguf_dense_bytes(tree: str, gguf: str) -> int:
    """Bytes of a GGUF's tensors a decode token reads besides the routed experts (the token embedding is
    a row lookup; the output head is read whole, or the embedding when tied)."""
    sys.path.insert(0, os.path.join(tree, "gguf-py"))
    import gguf as g
    ts = {t.name: int(t.n_bytes) for t in g.GGUFReader(gguf).tensors}
    n = sum(v for k, v in ts.items() if "_exps" not in k and k != "token_embd.weight")
    return n if "output.weight" in ts else n + ts["token_embd.weight"]


def llama_rate(bindir: str, gguf: str, batch: int, threads: int) -> tuple:
    """Decode tokens/s of one llama.cpp run: (rate, build string)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if batch == 1:
        rows = json.loads(sh([os.path.join(bindir, "llama-bench"), "-m", gguf, "-p", "0", "-n", str(NEW),
                              "-t", str(threads), "-r", "1", "-o", "json"], env=env))
        row = next(r for r in rows if r["n_gen"] == NEW)
        return float(row["avg_ts"]), f"{row.get('build_commit', '?')} (build {row.get('build_number', '?')})"
    text = sh([os.path.join(bindir, "llama-batched-bench"), "-m", gguf, "-c", "2048", "-b", "2048", "-ub", "512",
               "-npp", str(PROMPT), "-ntg", str(NEW), "-npl", str(batch), "-t", str(threads),
               "--output-format", "jsonl"], env=env)
    rows = [json.loads(x) for x in text.splitlines() if x.startswith("{") and '"speed_tg"' in x]
    return float(rows[-1]["speed_tg"]), None


# -- checkpoints ---------------------------------------------------------------------------------
def build_tokenizer(hf: str, vocab: int) -> None:
    """A byte-level BPE of exactly ``vocab`` tokens (all 256 bytes, so any text encodes) trained on a
    seeded synthetic corpus, saved as a Qwen2Tokenizer the GGUF converter reads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    rng = random.Random(0)
    syl = [a + b for a in "bcdfghjklmnprstvwz" for b in "aeiou"] + list("aeiou")
    words = ["".join(rng.choice(syl) for _ in range(rng.randint(1, 4))) for _ in range(20000)]
    corpus = [" ".join(rng.choice(words) for _ in range(12)) + rng.choice([".", ",", "!", "?", "\n", " 123", " 42."])
              for _ in range(20000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    if tok.get_vocab_size() != vocab:
        raise RuntimeError(f"trained tokenizer has {tok.get_vocab_size()} tokens, want {vocab}")
    tok.save(os.path.join(hf, "tokenizer.json"))
    cfg = {"tokenizer_class": "Qwen2Tokenizer", "model_max_length": 32768, "bos_token": None,
           "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "unk_token": None,
           "add_bos_token": False, "add_prefix_space": False, "errors": "replace",
           "clean_up_tokenization_spaces": False}
    with open(os.path.join(hf, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)


def build_hf(cfg: dict, hf: str) -> None:
    """decode_speed.build_mid's recipe for any shape, plus the tokenizer (cached by config.json)."""
    if os.path.exists(os.path.join(hf, "tokenizer_config.json")):
        return
    if cfg.get("_synthetic"):
        # Too big to build as a transformers module on this machine: runtime/model/synthetic.py writes it (Mixtral
        # names, bf16) layer by layer, as bench/bigger_than_memory.py does
        from runtime.model.synthetic import SyntheticModelSpec, build_checkpoint
        log(f"writing the synthetic Mixtral checkpoint {hf} layer by layer")
        build_checkpoint(hf, SyntheticModelSpec(**cfg["_synthetic"]), dtype=torch.bfloat16, shard_by_layer=True)
        build_tokenizer(hf, cfg["vocab_size"])
        return
    import transformers
    cfg = dict(cfg)
    arch = cfg.pop("_arch", "Qwen3Moe")
    log(f"building the {arch} checkpoint {hf}")
    torch.manual_seed(0)
    m = getattr(transformers, arch + "ForCausalLM")(getattr(transformers, arch + "Config")(**cfg)).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" not in n and not n.endswith(("A_log", "dt_bias")):    # decay parameters keep their init range
                p.mul_(4.0)
    m.to(torch.bfloat16).save_pretrained(hf)
    del m
    build_tokenizer(hf, cfg["vocab_size"])


def llama_prefill(bindir: str, gguf: str, threads: int, n: int) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    rows = json.loads(sh([os.path.join(bindir, "llama-bench"), "-m", gguf, "-p", str(n), "-n", "0", "-t", str(threads),
                          "-r", "1", "-o", "json"], env=env))
    return float(next(r for r in rows if r["n_prompt"] == n)["avg_ts"])
