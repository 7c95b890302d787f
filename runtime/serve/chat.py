"""Chat messages -> prompt text: the checkpoint's own chat template, or a documented fallback.

Template: ``chat_template`` of ``tokenizer_config.json`` (a string, or a list of named templates
whose ``default`` is used), rendered with Jinja2 in a sandbox as Hugging Face does, with
``messages``, ``add_generation_prompt`` (default true), ``bos_token``, ``eos_token`` and the request's
``chat_template_kwargs`` (e.g. Qwen3's ``enable_thinking``). ``continue_final_message`` renders without the
generation prompt and cuts the text after the last message's content, so the model continues that message (as
transformers' ``apply_chat_template`` does).
Fallback (no template): each message as ``<|role|>\\ncontent\\n``, then ``<|assistant|>\\n``.
"""
from __future__ import annotations

import json
import os

from .params import ApiError

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

    def render(self, messages: list, tools: "list | None" = None, *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, kwargs: "dict | None" = None) -> str:
        """``tools``: OpenAI's tool objects, given to the template as Hugging Face does (``tools``); the fallback
        lists them as JSON in a first system message. ``kwargs``: more variables for the template (the request's
        ``chat_template_kwargs``; the names above are the server's, never a client's)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.template is None:
            head = f"<|system|>\nTools: {json.dumps(tools)}\n" if tools else ""
            text = head + "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
            return _continued(text, messages) if continue_final_message else \
                text + ("<|assistant|>\n" if add_generation_prompt else "")
        from jinja2 import TemplateError
        try:
            text = self.template.render(**(kwargs or {}), messages=messages,
                                        add_generation_prompt=add_generation_prompt, bos_token=self.bos,
                                        eos_token=self.eos, tools=tools)
        except TemplateError as e:
            raise ValueError(f"the model's chat template rejected these messages: {e}") from None
        except Exception as e:  # noqa: BLE001 - the template ran on a client's values (chat_template_kwargs)
            raise ValueError(f"the model's chat template failed on these messages: {type(e).__name__}: {e}") \
                from None
        return _continued(text, messages) if continue_final_message else text


def reply_tail(text: str, messages: list, continue_final_message: bool) -> str:
    """The end of a rendered prompt that the reply follows on from: the final message's content when it is
    continued, else what the template wrote after it (the generation prompt) - where a thinking block may have been
    opened or closed for the reply (reasoning.think_state), which a message's own text (a user quoting <think>)
    must not decide. The whole text where the template rewrote the final message."""
    last = (messages[-1]["content"] if messages else "").strip()
    at = text.rfind(last) if last else -1
    if at < 0:
        return text
    return text[at:] if continue_final_message else text[at + len(last):]


# the template's variables the server sets: a request's chat_template_kwargs may not name them
RESERVED = frozenset({"messages", "add_generation_prompt", "continue_final_message", "bos_token", "eos_token",
                      "tools"})


def template_options(body: dict) -> dict:
    """A chat request's template fields, as vLLM takes them: ``add_generation_prompt`` (default true, false when
    ``continue_final_message`` is set; both true is a 400), ``continue_final_message`` (default false) and
    ``chat_template_kwargs`` (an object of more variables), as ``ChatFormatter.render``'s keywords."""
    cont = body.get("continue_final_message")
    cont = False if cont is None else cont
    if not isinstance(cont, bool):
        raise ApiError(400, "'continue_final_message' must be a boolean", param="continue_final_message")
    gen = body.get("add_generation_prompt")
    gen = not cont if gen is None else gen
    if not isinstance(gen, bool):
        raise ApiError(400, "'add_generation_prompt' must be a boolean", param="add_generation_prompt")
    if gen and cont:
        raise ApiError(400, "'continue_final_message' and 'add_generation_prompt' cannot both be true: the final "
                            "message is continued, or a new one is started", param="continue_final_message")
    kw = body.get("chat_template_kwargs")
    if kw is None:
        kw = {}
    if not isinstance(kw, dict):
        raise ApiError(400, "'chat_template_kwargs' must be an object of the chat template's variables",
                       param="chat_template_kwargs")
    taken = sorted(RESERVED & kw.keys())
    if taken:
        raise ApiError(400, f"'chat_template_kwargs' may not set {', '.join(taken)}: the request's own fields do",
                       param="chat_template_kwargs")
    return {"add_generation_prompt": gen, "continue_final_message": cont, "kwargs": kw}


def _continued(text: str, messages: list) -> str:
    """The rendered chat cut right after the final message's content (transformers' continue_final_message: the
    end-of-turn the template wrote after it goes; a template that trims the content's spaces is allowed for)."""
    final = messages[-1]["content"] if messages else ""
    if not final.strip():
        raise ValueError("continue_final_message: the final message is empty, there is nothing to continue "
                         "(send add_generation_prompt for a new reply)")
    at = text.rfind(final.strip())
    if at < 0:
        raise ValueError("continue_final_message: the final message's content is not in the rendered chat "
                         "(the chat template drops or rewrites it)")
    if text[at:at + len(final.lstrip())] == final.lstrip():
        return text[:at + len(final.lstrip())]
    return text[:at + len(final.strip())]


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
