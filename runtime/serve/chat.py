"""Chat messages -> prompt text: the checkpoint's own chat template, or a documented fallback.

Template: ``chat_template`` of ``tokenizer_config.json`` (a string, or a list of named templates
whose ``default`` is used), rendered with Jinja2 in a sandbox as Hugging Face does, with
``messages``, ``add_generation_prompt=True``, ``bos_token`` and ``eos_token``.
Fallback (no template): each message as ``<|role|>\\ncontent\\n``, then ``<|assistant|>\\n``.
"""
from __future__ import annotations

import json
import os

FALLBACK = "fallback: <|role|>\\ncontent\\n per message, then <|assistant|>\\n"


class ChatFormatter:
    def __init__(self, model_dir: str) -> None:
        self.template = None
        self.bos = self.eos = ""
        self.template_source = None
        self.template_text = None       # the template's source (tool_parsers picks the tool-call format by its markers)
        t = None
        path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.exists(path):
            try:
                with open(path) as f:
                    tc = json.load(f)
            except ValueError as e:
                raise ValueError(f"{path}: not valid JSON ({e})") from None
            t = tc.get("chat_template")
            if isinstance(t, list):
                t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
            if t is not None and not isinstance(t, str):
                raise ValueError(f"{path}: chat_template is neither a string nor a list of named templates")
            self.bos = _token_text(tc.get("bos_token"))
            self.eos = _token_text(tc.get("eos_token"))
            if t:
                self.template_source = "tokenizer_config.json chat_template"
        jpath = os.path.join(model_dir, "chat_template.jinja")
        if os.path.exists(jpath):   # newer checkpoints (gpt-oss) ship it as its own file; it takes precedence
            try:
                with open(jpath, encoding="utf-8") as f:
                    t = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"{jpath}: not readable ({e})") from None
            path, self.template_source = jpath, "chat_template.jinja"
        if t:
            self.template_text = t
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            from jinja2.ext import loopcontrols
            # as transformers renders templates: its extensions and its tojson (no HTML escaping, non-ASCII kept)
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = _strftime_now   # as transformers provides it (gpt-oss's template uses it)
            try:
                self.template = env.from_string(t)
            except TemplateError as e:
                raise ValueError(f"{path}: chat_template does not compile ({e})") from None

    @property
    def source(self) -> str:
        return self.template_source if self.template is not None else FALLBACK

    def render(self, messages: list, tools: "list | None" = None) -> str:
        """``tools``: OpenAI's tool objects, given to the template as Hugging Face does (``tools``); the fallback
        lists them as JSON in a first system message."""
        if self.template is None:
            head = f"<|system|>\nTools: {json.dumps(tools)}\n" if tools else ""
            return head + "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"
        from jinja2 import TemplateError
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos,
                                        eos_token=self.eos, tools=tools)
        except TemplateError as e:
            raise ValueError(f"the model's chat template rejected these messages: {e}") from None


def _token_text(t) -> str:
    if isinstance(t, dict):
        return t.get("content", "") or ""
    return t or ""


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    import datetime
    return datetime.datetime.now().strftime(fmt)


def _raise(msg):
    from jinja2 import TemplateError
    raise TemplateError(msg)
