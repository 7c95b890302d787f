"""Tool calls (OpenAI's ``tools`` / ``tool_choice``): what a request offers, how the output is constrained or
parsed into ``tool_calls`` - one module per format, as vLLM's ``tool_parsers/``.

* ``tool_choice`` "required" / a named function (``required``): the output is constrained
  (runtime/engine/grammar.py) to JSON naming the call(s), so the calls always parse and their arguments validate
  against the function's parameters.
* "auto": the tools are rendered into the chat template (the ``tools`` variable Hugging Face templates read) and
  the model's text is parsed by its family's tool-call format (``registry.FORMATS``, picked by the markers its
  chat template writes). The model is free until it samples the token that opens its family's calls; from there
  on the output is constrained (``ToolFormat.grammar``: a Lark grammar for llguidance) to well-formed calls of
  offered tools whose arguments validate against their parameters, ending with the format's closing marker -
  what llguidance calls a lazy grammar and vLLM / SGLang a structural tag. The family's marker tokens are special
  tokens in its tokenizer: they are kept in the text (``ToolFormat.tokens``; vLLM keeps special tokens when tools
  are offered) so the parser sees them. The formats: ``hermes`` (Hermes / Qwen3), ``qwen3_coder`` (Qwen3.5 /
  Qwen3-Coder XML), ``glm45`` (GLM-4.5), ``kimi_k2`` (Kimi K2), ``deepseek_v3`` (DeepSeek-V3), ``harmony``
  (gpt-oss); each module writes its format out.
* "none" (or no tools): plain text.

Modules: ``request`` (the request's ``Tools``), ``base`` (``ToolFormat``, the call object, grammar and streaming
helpers), ``named_args`` (shared by GLM-4.5 and Qwen3-Coder), one per format, ``registry`` (``FORMATS`` and what
the server does with a format)."""
from .base import ToolFormat, call
from .harmony import HARMONY_TOKENS
from .registry import (FORMATS, cut_reply, keep_tokens, new_calls, parse_auto, stream_spans, streamable_arguments,
                       tool_format, trigger)
from .request import Tools, parse_tools
from .required import constrained_calls

__all__ = ["FORMATS", "HARMONY_TOKENS", "ToolFormat", "Tools", "call", "constrained_calls", "cut_reply", "keep_tokens",
           "new_calls", "parse_auto", "parse_tools", "stream_spans", "streamable_arguments", "tool_format", "trigger"]
