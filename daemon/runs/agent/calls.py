"""One tool call per step, asked for in either of two ways, and read back from a hostile reply.

- **native**: OpenAI `tools` / `tool_calls` (llama.cpp with `--jinja` and a template that
  knows tools). The reply's first tool call is the step's call.
- **json**: `response_format` with a JSON schema that is a `oneOf` of
  `{"tool": <name>, "arguments": <that tool's input>}`, so any llama.cpp server (the embedded
  SmolLM2 included) is held to one well-formed call by its grammar.

Either way the text is rescue-parsed when the structured path fails (a server that ignores
the schema, a model that writes its call as prose): a code fence is opened, the first JSON
object is cut out of the text, and a few repairs are tried, bounded: trailing commas,
single-quoted strings, Python's True/False/None, and at most `MAX_CLOSERS` missing closing
braces or brackets. Past that the reply is malformed and the model is told exactly why.
(`json-repair` on PyPI repairs far more, which is the problem: it turns prose into a call.)
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from daemon.runs.agent.toolbox import TOOLS

Mode = Literal["native", "json"]
Parse = Literal["native", "parsed", "fenced", "object", "repaired"]

MAX_REPLY = 64 * 1024
"""Replies longer than this are not rescued (a model that ran on is malformed, not repaired)."""
MAX_CLOSERS = 3
_FENCE = re.compile(r"```[a-zA-Z]*\s*\n?(.*?)(?:```|$)", re.DOTALL)
_TRAILING = re.compile(r",(\s*[}\]])")
_PY_LITERALS = {"True": "true", "False": "false", "None": "null"}
_SCHEMA_KEYS_KEPT = {
    "type",
    "properties",
    "required",
    "items",
    "anyOf",
    "oneOf",
    "const",
    "enum",
    "description",
    "additionalProperties",
}
"""Keys of a pydantic schema sent to the server. Length and size bounds are left to the
validation after the reply: llama.cpp expands `maxLength: 4000` into a grammar of 4,000
copies of a rule."""


class Malformed(ValueError):
    """A reply that holds no usable tool call; the message is what the model is told."""


@dataclass(frozen=True)
class Call:
    tool: str
    arguments: dict[str, Any]
    parse: Parse
    id: str | None = None
    """The native call's id (its observation answers it)."""
    extra: int = 0
    """Further tool calls in the same reply, which were not run."""


def _wire(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {
            k: {name: _wire(sub) for name, sub in v.items()} if k == "properties" else _wire(v)
            for k, v in schema.items()
            if k in _SCHEMA_KEYS_KEPT
        }
    if isinstance(schema, list):
        return [_wire(item) for item in schema]
    return schema


def _parameters(name: str) -> dict[str, Any]:
    schema: dict[str, Any] = _wire(TOOLS[name].model_json_schema())
    schema.pop("description", None)  # the function's own description says it
    schema.setdefault("required", [])
    schema["additionalProperties"] = False
    return schema


def tool_specs() -> list[dict[str, Any]]:
    """The `tools` of a native request."""
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": (model.__doc__ or name).strip(),
                "parameters": _parameters(name),
            },
        }
        for name, model in TOOLS.items()
    ]


def call_schema() -> dict[str, Any]:
    """The JSON schema of one call in json mode: one branch per tool."""
    return {
        "oneOf": [
            {
                "type": "object",
                "properties": {"tool": {"const": name}, "arguments": _parameters(name)},
                "required": ["tool", "arguments"],
                "additionalProperties": False,
            }
            for name in TOOLS
        ]
    }


def response_format() -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": call_schema()}}


def native_supported(props: Mapping[str, Any]) -> bool:
    """Whether a llama.cpp server's `/props` says its chat template takes tools.

    Newer servers say it in `chat_template_caps`; older ones only show the template, whose
    Jinja mentions `tools` when it renders them. (A server started without `--jinja` still
    answers a request with tools with an error: the loop then falls back to json mode.)
    """
    caps = props.get("chat_template_caps")
    if isinstance(caps, Mapping) and isinstance(caps.get("supports_tool_calls"), bool):
        return bool(caps["supports_tool_calls"])
    template = props.get("chat_template")
    return isinstance(template, str) and "tools" in template and "tool_call" in template


# ---------------------------------------------------------------------------- rescue


def _scan(text: str) -> tuple[list[bool], bool]:
    """For each character: is it outside a double-quoted JSON string? And does the text end
    inside one?"""
    out: list[bool] = []
    in_string = escaped = False
    for ch in text:
        if in_string:
            out.append(False)
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        else:
            out.append(ch != '"')
            in_string = ch == '"'
    return out, in_string


def _single_quotes(text: str) -> str:
    """'a' → "a" outside double-quoted strings (a `"` inside a single-quoted one escaped)."""
    out: list[str] = []
    mode: str | None = None
    i = 0
    while i < len(text):
        ch = text[i]
        if mode is None:
            if ch in "\"'":
                mode = ch
                out.append('"')
            else:
                out.append(ch)
        elif ch == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            out.append("'" if mode == "'" and nxt == "'" else ch + nxt)
            i += 2
            continue
        elif ch == mode:
            mode = None
            out.append('"')
        elif ch == '"':
            out.append('\\"')
        else:
            out.append(ch)
        i += 1
    return "".join(out)


def _close(text: str) -> str | None:
    """`text` with what is missing at its end appended: a closing quote, and at most
    MAX_CLOSERS braces or brackets; None when more is missing or they do not nest."""
    stack: list[str] = []
    outside, open_string = _scan(text)
    for ch, out in zip(text, outside, strict=True):
        if not out:
            continue
        if ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]" and (not stack or stack.pop() != ch):
            return None
    if len(stack) > MAX_CLOSERS or (not stack and not open_string):
        return None
    return text + ('"' if open_string else "") + "".join(reversed(stack))


def _repairs(candidate: str) -> list[str]:
    fixed = _TRAILING.sub(r"\1", candidate)
    quoted = _single_quotes(candidate)
    literal = re.sub(r"\b(True|False|None)\b", lambda m: _PY_LITERALS[m.group(1)], quoted)
    tries = [fixed, quoted, _TRAILING.sub(r"\1", literal)]
    closed = [c for t in (candidate, *tries) if (c := _close(t)) is not None]
    return [*tries, *closed, *(_TRAILING.sub(r"\1", c) for c in closed)]


def _object_text(text: str) -> str | None:
    start = text.find("{")
    if start < 0:
        return None
    depth = 0
    outside, _ = _scan(text[start:])
    for i, (ch, out) in enumerate(zip(text[start:], outside, strict=True)):
        if not out:
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start : start + i + 1]
    return text[start:]  # unbalanced: the repairs may close it


def rescue(text: str) -> tuple[Any, Parse]:
    """The JSON value in a reply, and how it was found; Malformed otherwise."""
    if len(text) > MAX_REPLY:
        raise Malformed(f"the reply is {len(text):,} characters: reply with one short tool call")
    stripped = text.strip()
    try:
        return json.loads(stripped), "parsed"
    except (ValueError, RecursionError):  # RecursionError: nesting past json's limit
        pass
    for match in _FENCE.finditer(text):
        try:
            return json.loads(match.group(1).strip()), "fenced"
        except (ValueError, RecursionError):
            continue
    obj = _object_text(text)
    if obj is None:
        raise Malformed("the reply holds no JSON object")
    try:
        return json.loads(obj), "object"
    except RecursionError:
        raise Malformed("the JSON in the reply is nested too deep") from None
    except ValueError as err:
        first = err
    for attempt in _repairs(obj):
        try:
            return json.loads(attempt), "repaired"
        except (ValueError, RecursionError):
            continue
    raise Malformed(f"the JSON in the reply does not parse: {first}")


def _as_call(value: Any, parse: Parse) -> Call:
    """A parsed value as one call: {"tool", "arguments"} (or {"name", "arguments"})."""
    if isinstance(value, list) and value and isinstance(value[0], dict):
        value = value[0]
    if not isinstance(value, dict):
        raise Malformed('the reply is not a JSON object {"tool": ..., "arguments": {...}}')
    name = value.get("tool", value.get("name"))
    if isinstance(name, dict):  # {"function": {...}} shapes
        value, name = name, name.get("name")
    arguments = value.get("arguments", value.get("parameters", value.get("args", {})))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # RecursionError: nesting past json's limit
            raise Malformed('"arguments" is a string that is not a JSON object') from None
    if not isinstance(name, str):
        raise Malformed('the call names no tool: give "tool" as one of ' + ", ".join(TOOLS))
    if not isinstance(arguments, dict):
        raise Malformed(f"the arguments of {name[:80]} are not a JSON object")
    return Call(tool=name, arguments=arguments, parse=parse)


def check(call: Call) -> Call:
    """The call with its tool known and its arguments valid; Malformed with the exact error."""
    model = TOOLS.get(call.tool)
    if model is None:
        raise Malformed(f"there is no tool {call.tool[:80]!r}; the tools are " + ", ".join(TOOLS))
    try:
        model.model_validate(call.arguments)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'arguments'}: {e['msg']}"
            for e in err.errors()[:5]
        )
        raise Malformed(f"invalid arguments for {call.tool}: {problems}") from None
    return call


def from_text(text: str) -> Call:
    """The call written in a reply's text (json mode, or a native reply without tool_calls)."""
    value, how = rescue(text)
    return check(_as_call(value, how))


def from_native(tool_calls: list[dict[str, Any]], text: str) -> Call:
    """The first of a reply's `tool_calls`; the text is rescued if there are none."""
    if not tool_calls:
        if not text.strip():
            raise Malformed("the reply has no tool call and no text")
        return from_text(text)
    first = tool_calls[0]
    function = first.get("function") if isinstance(first, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise Malformed("the tool call names no function")
    raw = function.get("arguments") or "{}"
    if isinstance(raw, dict):
        arguments: Any = raw
    else:
        try:
            arguments, _ = rescue(str(raw))
        except Malformed as err:
            raise Malformed(f"the arguments of {function['name']} do not parse: {err}") from None
    if not isinstance(arguments, dict):
        raise Malformed(f"the arguments of {function['name']} are not a JSON object")
    call = Call(
        tool=function["name"],
        arguments=arguments,
        parse="native",
        id=str(first.get("id") or "")[:64] or None,
        extra=len(tool_calls) - 1,
    )
    return check(call)
