"""Images and documents in a harness's history.

Every harness has a tool that can return an image (Claude Code ``Read``, Codex ``view_image``, Qwen
Code and Gemini CLI ``read_file``, Pi and OpenCode ``read``), and the image then stays in every
later request of the session. The translators turn each image or document into a chat content
part (``image_url`` with a data URL when the harness sent the bytes) that also carries what it is
(``MEDIA_KEY``: kind, media type, size). The core then ``settle``s the request for the served
model: a text-only model gets a short placeholder text in its place (one translation note per
kind); a model that reads images (``polar_media=pass``) gets the image parts, the marker removed.
Messages without media keep plain string content, so their rendering never changes.
"""

from __future__ import annotations

import base64
from typing import Any

from .base import NormalizedCall

#: Key of the description a translator attaches to a media part (removed before the engine).
MEDIA_KEY = "_polar_media"
MODES = ("placeholder", "pass")


def _size(data: Any) -> int | None:
    """Decoded size of base64 data (without decoding it)."""
    if not isinstance(data, str) or not data:
        return None
    n = len(data.rstrip("="))
    return n * 3 // 4


def media_part(kind: str, media_type: str | None, data: str | None = None, url: str | None = None) -> dict[str, Any]:
    """A chat content part for an image or document: bytes (base64 ``data``) or a ``url``."""
    media_type = media_type or "application/octet-stream"
    if url is None and data is not None:
        url = f"data:{media_type};base64,{data}"
    info = {"kind": kind, "media_type": media_type, "bytes": _size(data)}
    if kind == "image" and url:
        return {"type": "image_url", "image_url": {"url": url}, MEDIA_KEY: info}
    # documents, audio, video: no chat part a text engine could take; the placeholder stands in
    return {"type": "text", "text": placeholder(info), MEDIA_KEY: {**info, "text_only": True}}


def placeholder(info: dict[str, Any]) -> str:
    size = f", {info['bytes']} bytes" if info.get("bytes") else ""
    return f"[{info.get('kind', 'media')}: {info.get('media_type')}{size}; not shown: the served model reads text only]"


def join(items: list[Any], separator: str) -> str | list[dict[str, Any]]:
    """Texts (str) and media parts (dict) of one message: a string when there is no media (the
    rendering of text-only histories never changes), else a part array."""
    if all(isinstance(i, str) for i in items):
        return separator.join(items)
    parts: list[dict[str, Any]] = []
    for i in items:
        parts.append({"type": "text", "text": i} if isinstance(i, str) else i)
    return parts


def settle(call: NormalizedCall, mode: str = "placeholder") -> int:
    """Make the request fit the served model (in place); returns the number of media parts.

    ``placeholder``: each media part becomes its placeholder text and the message's parts are
    joined with ``"\\n"`` (as the translators join text parts); ``pass``: images stay as
    ``image_url`` parts, documents as their placeholder text."""
    count = 0
    kinds: dict[str, int] = {}
    for msg in call.chat_request.get("messages") or ():
        content = msg.get("content")
        if not isinstance(content, list) or not any(isinstance(p, dict) and MEDIA_KEY in p for p in content):
            continue
        texts: list[str] = []
        parts: list[dict[str, Any]] = []
        for part in content:
            info = part.get(MEDIA_KEY) if isinstance(part, dict) else None
            if info is None:
                texts.append(part.get("text", "") if isinstance(part, dict) else str(part))
                parts.append(part)
                continue
            count += 1
            kinds[info["kind"]] = kinds.get(info["kind"], 0) + 1
            if mode == "pass" and not info.get("text_only"):
                parts.append({k: v for k, v in part.items() if k != MEDIA_KEY})
                texts.append(placeholder(info))
            else:
                parts.append({"type": "text", "text": placeholder(info)})
                texts.append(placeholder(info))
        if mode == "pass" and any(p.get("type") != "text" for p in parts):
            msg["content"] = parts
        else:
            msg["content"] = "\n".join(texts)
    for kind, n in kinds.items():
        note = (f"{kind} passed to the served model" if mode == "pass" and kind == "image"
                else f"{kind} replaced by a text placeholder (text-only model)")
        call.notes.append(note if n == 1 else f"{note} (x{n})")
    return count


def decode_size(data: str) -> int:
    """Exact decoded size of base64 data (tests)."""
    return len(base64.b64decode(data))


def _data_url(url: Any) -> tuple[str | None, str | None]:
    """(media type, base64 data) of a ``data:`` URL, or (None, None)."""
    if isinstance(url, str) and url.startswith("data:") and ";base64," in url:
        head, data = url[5:].split(";base64,", 1)
        return head or None, data
    return None, None


def openai_media(part: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI Chat / Responses media part (image_url, input_image, input_file, file,
    input_audio, audio, video_url) as a media part."""
    kind = part.get("type")
    if kind in ("image_url", "input_image"):
        url = part.get("image_url")
        if isinstance(url, dict):
            url = url.get("url")
        media_type, data = _data_url(url)
        if data is not None:
            return media_part("image", media_type, data)
        return media_part("image", media_type or "image/*", url=url if isinstance(url, str) else None)
    if kind in ("input_file", "file"):
        src = part.get("file") if isinstance(part.get("file"), dict) else part
        media_type, data = _data_url(src.get("file_data"))
        return media_part("document", media_type or "application/octet-stream", data)
    if kind in ("input_audio", "audio"):
        src = part.get("input_audio") if isinstance(part.get("input_audio"), dict) else part
        fmt = src.get("format")
        return media_part("audio", f"audio/{fmt}" if fmt else "audio/*", src.get("data"))
    return media_part("video", "video/*")


def anthropic_media(block: dict[str, Any]) -> dict[str, Any] | str:
    """An Anthropic image / document block as a media part (a plain-text document: its text)."""
    src = block.get("source") if isinstance(block.get("source"), dict) else {}
    kind = "image" if block.get("type") == "image" else "document"
    stype = src.get("type")
    if stype == "base64":
        return media_part(kind, src.get("media_type"), src.get("data"))
    if stype == "url":
        return media_part(kind, src.get("media_type") or f"{kind}/*", url=src.get("url"))
    if stype == "text" and isinstance(src.get("data"), str):
        return src["data"]  # a text document is text
    if stype == "content" and isinstance(src.get("content"), list):
        return "\n".join(p.get("text", "") for p in src["content"] if isinstance(p, dict))
    return media_part(kind, src.get("media_type") or f"{kind}/*")


def google_media(part: dict[str, Any]) -> dict[str, Any]:
    """A Gemini ``inlineData`` / ``fileData`` part as a media part."""
    inline = part.get("inlineData") or part.get("inline_data")
    if isinstance(inline, dict):
        mime = inline.get("mimeType") or inline.get("mime_type")
        kind = "image" if str(mime).startswith("image/") else "document"
        return media_part(kind, mime, inline.get("data"))
    f = part.get("fileData") or part.get("file_data") or {}
    mime = f.get("mimeType") or f.get("mime_type")
    kind = "image" if str(mime).startswith("image/") else "document"
    return media_part(kind, mime, url=f.get("fileUri") or f.get("file_uri"))


def as_text(content: Any) -> Any:
    """Content that must be text (system prompts, assistant turns): media parts as placeholders."""
    if not isinstance(content, list):
        return content
    return "\n".join(placeholder(p[MEDIA_KEY]) if isinstance(p, dict) and MEDIA_KEY in p
                     else (p.get("text", "") if isinstance(p, dict) else str(p)) for p in content)
