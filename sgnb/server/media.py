"""Images and videos from HTTP clients: data URLs and base64 only (no files, no fetches); the engine decodes
them from memory (videos only in known containers, which open nothing they name: engine/image_io.py)."""

from __future__ import annotations

import base64
import binascii
from typing import TYPE_CHECKING, Any

from sgnb.server.protocol import APIError

if TYPE_CHECKING:
    from sgnb.engine import Engine


# ---- images and videos from clients ------------------------------------------------------------------------------
class _Media:
    """Turns a request's images and videos into what the engine takes, refusing what the server must not do for
    a client: read a local file or fetch a URL. An image becomes a data: URL (the engine decodes it) or the
    bytes of a plain base64 string; a video its bytes (the engine opens them in memory, never as a file)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def check_model(self, kind: str, param: str) -> str:
        """The engine's image (video) token; a 400 when the model takes none."""
        token = self.engine.image_token if kind == "image" else self.engine.video_token
        if token is None:
            name = self.engine.model_name
            raise APIError(400, f"{name} is a text-only model: it takes no images or videos"
                           if self.engine.image_token is None else f"{name} takes images but no videos", param=param)
        return token

    def prompts(self, value: Any, kind: str, param: str, batched: bool, count: int) -> list[list[Any] | None]:
        """SGLang's image_data / video_data -> one list of engine items (or None) per prompt."""
        if value is None:
            return [None] * count
        self.check_model(kind, param)
        if batched:
            entries = value if isinstance(value, list) else [value] * count  # one item for the whole batch
            if len(entries) != count:
                raise APIError(400, f"{param} has {len(entries)} entries for {count} prompts: give one entry (an "
                                    "item or a list) per prompt", param=param)
        else:
            entries = [value]
        out: list[list[Any] | None] = []
        for i, entry in enumerate(entries):
            items = entry if isinstance(entry, list) else [] if entry is None else [entry]
            where = f"{param}[{i}]" if batched else param
            out.append([self.item(x, kind, f"{where}[{j}]" if isinstance(entry, list) else where)
                        for j, x in enumerate(items)] or None)
        return out

    def item(self, value: Any, kind: str, where: str) -> Any:
        """One image (video) from the wire -> what the engine takes for it."""
        frames = None
        if kind == "video" and isinstance(value, dict):
            unknown = set(value) - {"url", "data", "num_frames"}
            if unknown or not (("url" in value) ^ ("data" in value)):
                raise APIError(400, f"{where}: a video given as an object is {{\"url\" (or \"data\"): data: URL or "
                                    f"base64, \"num_frames\": n}}, got the keys {sorted(value)}", param=where)
            frames = value.get("num_frames", 8)
            if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
                raise APIError(400, f"{where}.num_frames must be an int >= 1, got {frames!r}", param=where)
            value = value.get("url", value.get("data"))
        if not isinstance(value, str):
            shape = "a string (a data: URL or base64)" + (" or {url, num_frames}" if kind == "video" else "")
            raise APIError(400, f"{where} must be {shape}, got {type(value).__name__}", param=where)
        text = value.strip()
        low = text.lower()
        if not text:
            raise APIError(400, f"{where} is an empty string", param=where)
        if low.startswith(("http://", "https://", "ftp://")):
            raise APIError(400, f"{where}: the {kind} URL {text[:80]!r} was not fetched: this server fetches no URLs "
                                f"for clients; send the {kind} as a data: URL or base64", param=where)
        if low.startswith("file:"):
            raise APIError(400, f"{where}: {text[:80]!r} names a local file, which this server does not read for "
                                f"clients; send the {kind}'s bytes as a data: URL or base64", param=where)
        if low.startswith("data:"):
            if kind == "image":
                return text  # the engine decodes it (a corrupt payload is its ValueError: a 400)
            header, _, payload = text.partition(",")
            if not header.lower().endswith(";base64"):
                raise APIError(400, f"{where}: a data: URL must be base64 ('data:video/mp4;base64,...'), got "
                                    f"{text[:40]!r}", param=where)
            raw = self._b64(payload, where, kind, "the data: URL's base64 payload is corrupt")
        else:
            raw = self._b64(text, where, kind, None)
        if kind == "image":
            return raw
        return {"data": raw, "num_frames": 8 if frames is None else frames}

    @staticmethod
    def _b64(text: str, where: str, kind: str, corrupt: str | None) -> bytes:
        try:
            return base64.b64decode("".join(text.split()), validate=True)
        except (binascii.Error, ValueError) as e:
            if corrupt is not None:
                raise APIError(400, f"{where}: {corrupt}: {e}", param=where) from None
            raise APIError(400, f"{where} is neither a data: URL nor base64 ({text[:60]!r}): this server reads no "
                                f"local files and fetches no URLs for clients; send the {kind}'s bytes as base64",
                           param=where) from None
