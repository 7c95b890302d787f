"""Chat templates shipped as ``chat_template.jinja`` (gpt-oss and newer checkpoints), rendered as
transformers renders them."""
import json
import os

from runtime.model.synthetic import write_byte_tokenizer
from runtime.serve.chat import ChatFormatter

# A template in the style of gpt-oss's harmony format, with the strftime_now global HF provides.
TEMPLATE = ("{{ '<|start|>system<|message|>date ' + strftime_now('%Y') + '<|end|>' }}"
            "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant{% endif %}")


def test_chat_template_jinja_takes_precedence_and_matches_transformers(tmp_path):
    from transformers import AutoTokenizer
    d = str(tmp_path)
    write_byte_tokenizer(d, 300)
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
        f.write(TEMPLATE)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    fmt = ChatFormatter(d)
    assert fmt.source == "chat_template.jinja"
    want = AutoTokenizer.from_pretrained(d).apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert fmt.render(msgs) == want
    assert want.endswith("<|start|>user<|message|>Hi<|end|><|start|>assistant")
    # without the file, tokenizer_config.json's template is used
    os.remove(os.path.join(d, "chat_template.jinja"))
    assert ChatFormatter(d).source == "tokenizer_config.json chat_template"
    assert json.load(open(os.path.join(d, "tokenizer_config.json")))["chat_template"]
