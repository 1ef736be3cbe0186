"""OpenAI's chat messages as mlxcel's: 'developer' is a system message, text parts stay, an
image_url part becomes an image file the vision stage reads (a data: URL's bytes written to the
request's temporary folder; a local path only inside serve.image_dirs). The server fetches
nothing: an http(s) URL is a 400."""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path
from typing import Any

from mlxcel.openai_protocol import ApiError

IMAGE_SUFFIXES = {
    "image/png": ".png",
    "image/jpeg": ".jpg",
    "image/jpg": ".jpg",
    "image/webp": ".webp",
    "image/gif": ".gif",
}


def convert_messages(messages: list, folder: Path | None, image_dirs: list[Path]) -> list[dict]:
    """OpenAI's chat messages as our Message dicts: 'developer' is a system message, image_url
    parts become image files (data: URLs written to `folder`, local paths under serve.image_dirs)."""
    from pydantic import ValidationError

    from mlxcel.config import Message

    if not messages:
        raise ApiError(400, "messages must not be empty", "messages")
    converted = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, f"messages[{i}] must be an object", f"messages.{i}")
        check_types(message, i)
        message = {k: v for k, v in message.items() if k != "name" or message.get("role") == "tool"}
        if message.get("tool_calls") is not None:
            message["tool_calls"] = read_tool_calls(message["tool_calls"], i)
        if message.get("role") == "developer":
            message["role"] = "system"
        content = message.get("content")
        if isinstance(content, list):
            message["content"] = [
                convert_part(part, folder, f"messages.{i}.content.{j}", image_dirs) for j, part in enumerate(content)
            ]
        try:
            converted.append(Message.model_validate(message).to_dict())
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"] if not str(p).startswith(("function-", "tagged-")))
            detail = first.get("ctx", {}).get("mlxcel")
            text = detail[1] if detail else first["msg"]
            raise ApiError(400, f"messages[{i}].{where}: {text}", f"messages.{i}.{where}") from None
    return converted


def read_tool_calls(calls: Any, i: int) -> list:
    """An assistant message's tool calls with their arguments as objects: OpenAI sends them as JSON
    text, templates render them as objects (`arguments | tojson`), as vLLM and transformers do."""
    where = f"messages.{i}.tool_calls"
    if not isinstance(calls, list):
        raise ApiError(400, f"messages[{i}].tool_calls: expected an array, got {name_type(calls)}", where)
    read = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(400, f"messages[{i}].tool_calls[{j}] needs function.name", f"{where}.{j}")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError:
                message = f"messages[{i}].tool_calls[{j}].function.arguments: not valid JSON"
                raise ApiError(400, message, f"{where}.{j}.function.arguments") from None
        read.append({**call, "function": {**function, "arguments": arguments}})
    return read


def check_types(message: dict, i: int) -> None:
    """JSON types as OpenAI's API takes them: our Message schema turns a number into text (a
    config's `content: 123` is meant), which a request's `"content": 123` is not."""
    for key in ("role", "name", "tool_call_id"):
        value = message.get(key)
        if value is not None and not isinstance(value, str):
            raise ApiError(
                400, f"messages[{i}].{key}: expected a string, got {name_type(value)}", f"messages.{i}.{key}"
            )
    content = message.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise ApiError(
            400,
            f"messages[{i}].content: expected a string or an array of content parts, got {name_type(content)}",
            f"messages.{i}.content",
        )


def name_type(value: Any) -> str:
    """A JSON value's type as an error names it."""
    if value is None:
        return "null"
    for kind, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string")):
        if isinstance(value, kind):
            return name
    return "an array" if isinstance(value, list) else "an object"


def convert_part(part: Any, folder: Path | None, where: str, image_dirs: list[Path]) -> dict:
    if not isinstance(part, dict):
        raise ApiError(400, f"{where} must be an object", where)
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise ApiError(400, f"{where}.text: expected a string, got {name_type(text)}", f"{where}.text")
        return {"type": "text", "text": text}
    if kind != "image_url":
        raise ApiError(400, f"{where}: content part type '{kind}' is not supported (text, image_url)", f"{where}.type")
    url = part.get("image_url", {})
    url = url.get("url") if isinstance(url, dict) else None
    if not isinstance(url, str):
        raise ApiError(400, f"{where}: image_url.url must be a string", f"{where}.image_url.url")
    return {"type": "image", "path": str(find_image(url, folder, where, image_dirs))}


def find_image(url: str, folder: Path | None, where: str, image_dirs: list[Path]) -> Path:
    param = f"{where}.image_url.url"
    if url.startswith(("http://", "https://")):
        raise ApiError(400, "image URLs are not fetched: send the image as a data: URL", param)
    if url.startswith("data:"):
        header, _, data = url.partition(",")
        media = header[5:].split(";")[0].lower()
        if ";base64" not in header or media not in IMAGE_SUFFIXES:
            raise ApiError(400, f"a data: URL of a base64 image ({', '.join(IMAGE_SUFFIXES)}) is expected", param)
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, "the data: URL's base64 does not decode", param) from None
        path = folder / f"image-{len(list(folder.iterdir()))}{IMAGE_SUFFIXES[media]}"
        path.write_bytes(raw)
        return path
    path = Path(url.removeprefix("file://")).expanduser()
    if not image_dirs:
        raise ApiError(400, "local image paths are off (serve.image_dirs is empty): send a data: URL", param)
    resolved = path.resolve()
    if not any(resolved.is_relative_to(d) for d in image_dirs) or not resolved.is_file():
        raise ApiError(400, f"{url} is not a file under serve.image_dirs", param)
    return resolved


def has_data_urls(messages: list) -> bool:
    """Whether any image part is a data: URL (its bytes go to a temporary file for the processor)."""
    return any(
        isinstance(part, dict) and str((part.get("image_url") or {}).get("url", "")).startswith("data:")
        for message in messages
        if isinstance(message, dict) and isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and isinstance(part.get("image_url"), dict)
    )
