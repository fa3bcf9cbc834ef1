"""Renders chat requests the way the engines do, as the reference for the router's renderer.

Hugging Face's chat-template environment (jinja2's immutable sandbox with `trim_blocks`,
`lstrip_blocks` and loop controls; `tojson` as `json.dumps(..., ensure_ascii=False)`;
`raise_exception`), fed as vLLM feeds it: assistant `tool_calls` arguments parsed from their
JSON text (missing or empty as `{}`), `tools`, `add_generation_prompt` (default true), the
special tokens, and the template kwargs (`reasoning_effort`, then `chat_template_kwargs`).

Reads one JSON object per line on stdin: {"template", "bos_token", "eos_token", "request"};
writes one JSON line per request: {"text": RENDERED} or {"error": MESSAGE}.
"""

import json
import sys

from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def raise_exception(message):
    raise TemplateError(message)


def render(job):
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    request = job["request"]
    messages = request["messages"]
    for message in messages:
        if isinstance(message.get("content"), list):
            message["content"] = "\n".join(p["text"] for p in message["content"])
        if message.get("content") is None:
            message["content"] = ""
        if message.get("role") == "assistant" and isinstance(message.get("tool_calls"), list):
            for call in message["tool_calls"]:
                arguments = call["function"].get("arguments")
                call["function"]["arguments"] = (
                    json.loads(arguments) if arguments else {}
                ) if not isinstance(arguments, dict) else arguments
    kwargs = {}
    if request.get("reasoning_effort") is not None:
        kwargs["reasoning_effort"] = request["reasoning_effort"]
    kwargs.update(request.get("chat_template_kwargs") or {})
    add_generation_prompt = request.get("add_generation_prompt")
    return env.from_string(job["template"]).render(
        messages=messages,
        tools=request.get("tools"),
        add_generation_prompt=True if add_generation_prompt is None else add_generation_prompt,
        bos_token=job["bos_token"],
        eos_token=job["eos_token"],
        **kwargs,
    )


for line in sys.stdin:
    try:
        out = {"text": render(json.loads(line))}
    except Exception as e:  # noqa: BLE001 - the caller compares the failure too
        out = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out), flush=True)
