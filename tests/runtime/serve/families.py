"""Checkpoints of real families for the serving tests: a model built from the family's transformers config class
(the model tests' fixture, tests/runtime/model/conftest.py), a tokenizer with the family's special tokens (a
byte-level base: ids 0-255 are bytes, then the family's added tokens with their special flags as released), and a
chat template that writes the family's turns and tool calls in its released format (the formats written out
here, from the families' released chat templates: what the tool-call parsers read back)."""
import importlib.util
import json
import os

_MODEL_FIXTURES = os.path.join(os.path.dirname(__file__), "..", "model", "conftest.py")

# Qwen3's and Qwen3.5's templates end alike: tool results as a user turn in <tool_response>, then the prompt
_QWEN_TAIL = """{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

QWEN3_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content or '' }}{% for tc in m.tool_calls or [] %}{% if m.content or not loop.first %}{{ '\\n' }}{% endif %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
""" + _QWEN_TAIL

# Qwen3 with its thinking, as released: the generation prompt writes an empty <think> block when the request's
# chat_template_kwargs say enable_thinking false (the model does not think), else the model opens one itself; a past
# assistant turn is rendered without its thinking
QWEN3_THINK_TEMPLATE = QWEN3_TEMPLATE.replace(
    "{{ m.content or '' }}", "{{ (m.content or '').split('</think>')[-1].lstrip('\\n') }}").replace(
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is "
    "false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")

QWEN35_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools

You have access to the following functions:

<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

If you choose to call a function ONLY reply in the following format with NO suffix:

<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' or m.role == 'system' %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content or '' }}{% for tc in m.tool_calls or [] %}{% if m.content or not loop.first %}{{ '\\n' }}{% endif %}<tool_call>
<function={{ tc.function.name }}>
{% for k, v in tc.function.arguments.items() %}<parameter={{ k }}>
{{ v | tojson if v is mapping or (v is sequence and v is not string) else v | string }}
</parameter>
{% endfor %}</function>
</tool_call>{% endfor %}<|im_end|>
""" + _QWEN_TAIL

# gpt-oss: harmony messages; a call is a commentary message to the function, its arguments JSON, ended by <|call|>
HARMONY_TEMPLATE = """{%- if tools %}<|start|>developer<|message|># Tools

{{ tools | tojson }}<|end|>{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}{% for tc in m.tool_calls %}<|start|>assistant<|channel|>commentary to=functions.{{ tc.function.name }} <|constrain|>json<|message|>{{ tc.function.arguments | tojson }}<|call|>{% endfor %}
{%- elif m.role == 'tool' %}<|start|>functions.{{ m.name or 'tool' }} to=assistant<|channel|>commentary<|message|>{{ m.content | tojson }}<|end|>
{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""

GLM45_TEMPLATE = """[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}
<arg_key>{arg-key-1}</arg_key>
<arg_value>{arg-value-1}</arg_value>
...
</tool_call>{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' %}<|user|>
{{ m.content }}
{%- elif m.role == 'assistant' %}<|assistant|>
{{ m.content or '' }}
{%- for tc in m.tool_calls or [] %}
<tool_call>{{ tc.function.name }}
{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key>
<arg_value>{{ v | tojson if v is not string else v }}</arg_value>
{% endfor %}</tool_call>{% endfor %}
{%- elif m.role == 'tool' %}<|observation|>
<tool_response>
{{ m.content }}
</tool_response>
{%- elif m.role == 'system' %}<|system|>
{{ m.content }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|assistant|>
{% endif %}"""

KIMI_K2_TEMPLATE = """{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>
{%- elif m.role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>{{ m.content or '' }}
{%- if m.tool_calls -%}<|tool_calls_section_begin|>{%- for tc in m.tool_calls -%}<|tool_call_begin|>functions.{{ tc.function.name }}:{{ loop.index0 }}<|tool_call_argument_begin|>{{ tc.function.arguments | tojson }}<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}<|im_end|>
{%- elif m.role == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of {{ m.tool_call_id }}
{{ m.content }}<|im_end|>
{%- elif m.role == 'system' -%}<|im_system|>system<|im_middle|>{{ m.content }}<|im_end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"""

DEEPSEEK_V3_TEMPLATE = """{{ bos_token }}{%- for m in messages -%}
{%- if m.role == 'system' -%}{{ m.content }}
{%- elif m.role == 'user' -%}<｜User｜>{{ m.content }}
{%- elif m.role == 'assistant' -%}<｜Assistant｜>{{ m.content or '' }}
{%- if m.tool_calls -%}<｜tool▁calls▁begin｜>{%- for tc in m.tool_calls -%}{% if not loop.first %}{{ '\\n' }}{% endif %}<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ tc.function.name }}
```json
{{ tc.function.arguments | tojson }}
```<｜tool▁call▁end｜>{%- endfor -%}<｜tool▁calls▁end｜>{%- endif -%}<｜end▁of▁sentence｜>
{%- elif m.role == 'tool' -%}<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜><｜tool▁outputs▁end｜>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<｜Assistant｜>{%- endif -%}"""

# family -> (architecture fixture, added tokens [(text, special)], EOS token, BOS token or None, chat template).
# Qwen3 ships <tool_call> / </tool_call> as added tokens that are not special (their text is text); the others'
# tool markers are special tokens.
FAMILIES = {
    "qwen3": ("qwen3_moe", [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
                            ("<tool_call>", False), ("</tool_call>", False)], "<|im_end|>", None, QWEN3_TEMPLATE),
    # Qwen3 with thinking: <think> and </think> are added tokens that are not special (their text is text)
    "qwen3_think": ("qwen3_moe", [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
                                  ("<tool_call>", False), ("</tool_call>", False), ("<think>", False),
                                  ("</think>", False)], "<|im_end|>", None, QWEN3_THINK_TEMPLATE),
    # Qwen3.5 (as Qwen3-Coder): XML calls, <function=name> and <parameter=key> as text
    "qwen35": ("qwen3_5_moe_text", [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
                                    ("<tool_call>", False), ("</tool_call>", False)], "<|im_end|>", None,
               QWEN35_TEMPLATE),
    "gpt_oss": ("gpt_oss", [("<|startoftext|>", True), ("<|endoftext|>", True), ("<|start|>", True),
                            ("<|end|>", True), ("<|message|>", True), ("<|channel|>", True), ("<|constrain|>", True),
                            ("<|return|>", True), ("<|call|>", True)], "<|return|>", None, HARMONY_TEMPLATE),
    "glm45": ("glm4_moe", [("<|endoftext|>", True), ("[gMASK]", True), ("<sop>", True), ("<|system|>", True),
                           ("<|user|>", True), ("<|assistant|>", True), ("<|observation|>", True),
                           ("<tool_call>", True), ("</tool_call>", True), ("<arg_key>", True), ("</arg_key>", True),
                           ("<arg_value>", True), ("</arg_value>", True)], "<|user|>", None, GLM45_TEMPLATE),
    "kimi_k2": ("deepseek_v3", [("[BOS]", True), ("[EOS]", True), ("<|im_end|>", True), ("<|im_user|>", True),
                                ("<|im_assistant|>", True), ("<|im_system|>", True), ("<|im_middle|>", True),
                                ("<|tool_calls_section_begin|>", True), ("<|tool_calls_section_end|>", True),
                                ("<|tool_call_begin|>", True), ("<|tool_call_argument_begin|>", True),
                                ("<|tool_call_end|>", True)], "<|im_end|>", "[BOS]", KIMI_K2_TEMPLATE),
    "deepseek_v3": ("deepseek_v3", [("<｜begin▁of▁sentence｜>", True), ("<｜end▁of▁sentence｜>", True),
                                    ("<｜User｜>", True), ("<｜Assistant｜>", True), ("<｜tool▁calls▁begin｜>", True),
                                    ("<｜tool▁calls▁end｜>", True), ("<｜tool▁call▁begin｜>", True),
                                    ("<｜tool▁call▁end｜>", True), ("<｜tool▁sep｜>", True),
                                    ("<｜tool▁outputs▁begin｜>", True), ("<｜tool▁outputs▁end｜>", True),
                                    ("<｜tool▁output▁begin｜>", True), ("<｜tool▁output▁end｜>", True)],
                    "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>", DEEPSEEK_V3_TEMPLATE),
}


def write_tokenizer(out_dir: str, family: str) -> int:
    """The family's tokenizer.json and tokenizer_config.json; returns the vocabulary size."""
    from tokenizers import AddedToken, Tokenizer

    from runtime.model.synthetic import write_byte_tokenizer
    _, added, eos, bos, template = FAMILIES[family]
    os.makedirs(out_dir, exist_ok=True)
    write_byte_tokenizer(out_dir, 256)
    path = os.path.join(out_dir, "tokenizer.json")
    tok = Tokenizer.from_file(path)
    for text, special in added:           # one at a time: ids in the listed order, after the bytes
        tok.add_tokens([AddedToken(text, special=special, normalized=False)])
    tok.save(path)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": template, "eos_token": eos, "bos_token": bos,
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=1, ensure_ascii=False)
    return tok.get_vocab_size()


def build_family(out_dir: str, family: str) -> str:
    """A checkpoint folder of ``family``: its architecture's fixture model (transformers, random weights) with the
    vocabulary grown to the tokenizer's, its EOS token as config.json names it."""
    spec = importlib.util.spec_from_file_location("model_fixtures", _MODEL_FIXTURES)
    mf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mf)
    import torch
    import transformers
    arch = FAMILIES[family][0]
    V = write_tokenizer(out_dir, family)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    c = mf.hf_config(arch)
    c.vocab_size = V
    c.max_position_embeddings = 4096     # byte-level: a prompt with tools is ~1,000 tokens
    c.eos_token_id = tok.token_to_id(FAMILIES[family][2])
    torch.manual_seed(0)
    m = getattr(transformers, mf.ARCHS[arch][1])(c).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" not in n:
                p.mul_(4.0)
    m.save_pretrained(out_dir)
    return out_dir


def serve_family(tmp_path_factory, family: str):
    """A started server (the tests' API key) of the family's checkpoint, converted from its Hugging Face folder as
    `serve --model` does; ``srv.family`` and ``srv.hf`` (that folder) set. The caller closes it."""
    from runtime.model.convert import convert
    from runtime.serve.api import Server
    from runtime.serve.engine_proc import EngineConfig
    from servehelp import KEY
    d = tmp_path_factory.mktemp(family)
    build_family(str(d / "hf"), family)
    convert(str(d / "hf"), str(d / "store"))
    srv = Server(EngineConfig(model=str(d / "store"), max_batch=4), port=0, api_key=KEY).start()
    srv.family, srv.hf = family, str(d / "hf")
    return srv
