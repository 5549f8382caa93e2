"""Pushes a config to every ready engine through `PATCH /admin/config`, verified with `GET`.

Idempotent: an engine already running the config gets no PATCH, so calling `ensure` every interval is
cheap and re-tunes a pod that restarted from the spec's values.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import httpx

from .types import LiveSettings, TunedConfig

logger = logging.getLogger("specfleet.tuner")


class ConfigRefused(Exception):
    """An engine answered 400: the value is outside a ceiling fixed at its start (e.g. k with method none)."""


@dataclass
class ApplyResult:
    config: TunedConfig
    unchanged: list[str] = field(default_factory=list)  # already in force
    patched: list[str] = field(default_factory=list)  # patched and verified
    failed: dict[str, str] = field(default_factory=dict)  # url -> error (unreachable, 401, not verified)
    refused: dict[str, str] = field(default_factory=dict)  # url -> the engine's 400 message

    @property
    def ok(self) -> bool:
        return not self.failed and not self.refused


def admin_on_port(port: int) -> Callable[[str], str]:
    """Engine URL -> the same host on the admin port (pods serve the admin API apart from the API)."""

    def mapped(url: str) -> str:
        parts = urlsplit(url)
        host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
        return urlunsplit((parts.scheme, f"{host}:{port}", parts.path, "", ""))

    return mapped


class AdminActuator:
    """`admin_url` maps an engine's URL (the one in `ensure`'s list, also used for scraping) to where its
    admin API listens; by default the same URL."""

    def __init__(
        self, token: str, timeout_s: float = 5.0, admin_url: Callable[[str], str] = lambda url: url
    ) -> None:
        if not token:
            raise ValueError(
                "the admin token is empty; the engines' SPECFLEET_ADMIN_TOKEN is needed to tune them"
            )
        self._client = httpx.AsyncClient(timeout=timeout_s, headers={"Authorization": f"Bearer {token}"})
        self._admin_url = admin_url

    async def read(self, url: str) -> TunedConfig:
        return TunedConfig.from_admin(await self.settings(url))

    async def settings(self, url: str) -> dict[str, int]:
        """Every live setting of one engine, as `GET /admin/config` answers."""
        response = await self._client.get(f"{self._admin_url(url)}/admin/config")
        _raise_for(response, url)
        return response.json()

    async def _ensure_one(self, url: str, body: dict[str, int], result: ApplyResult) -> None:
        def differs(now: dict[str, int]) -> dict[str, int | None]:
            return {key: now.get(key) for key, value in body.items() if now.get(key) != value}

        try:
            if not differs(await self.settings(url)):
                result.unchanged.append(url)
                return
            response = await self._client.patch(f"{self._admin_url(url)}/admin/config", json=body)
            if response.status_code == 400:
                message = response.json().get("error", {}).get("message", response.text)
                raise ConfigRefused(message)
            _raise_for(response, url)
            wrong = differs(await self.settings(url))
            if wrong:
                wanted = {key: body[key] for key in wrong}
                result.failed[url] = f"PATCH answered but GET reads {wrong}, not {wanted}"
                return
            result.patched.append(url)
            logger.info("event=tuner_applied url=%s %s", url, " ".join(f"{k}={v}" for k, v in body.items()))
        except ConfigRefused as error:
            result.refused[url] = str(error)
        except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as error:
            result.failed[url] = f"{type(error).__name__}: {error}"

    async def ensure(self, urls: list[str], settings: TunedConfig | LiveSettings) -> ApplyResult:
        """Make every engine in `urls` run `settings` (a config, or a config with the knobs a policy rule
        sets, such as the guard); report per engine what happened."""
        if isinstance(settings, TunedConfig):
            settings = LiveSettings(settings)
        result = ApplyResult(settings.config)
        body = settings.as_admin()
        await asyncio.gather(*(self._ensure_one(u, body, result) for u in urls))
        return result

    async def close(self) -> None:
        await self._client.aclose()


def _raise_for(response: httpx.Response, url: str) -> None:
    if response.status_code in (401, 403):
        raise RuntimeError(
            f"{url}/admin/config answered {response.status_code}: the admin token does not match "
            "the engine's SPECFLEET_ADMIN_TOKEN (or the engine has none set)"
        )
    response.raise_for_status()
