"""The service mounted under a path of a proxy's (``root_path``): its live answers are still never to be
stored by a cache. In process, through httpx's ASGI transport, which sets the root path as a proxy's
server would."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from permits.server import ServerConfig, create_app


def test_live_answers_under_a_root_path_say_no_store(tmp_path: Path) -> None:
    async def scenario() -> dict[str, str | None]:
        config = ServerConfig(database_url=f"sqlite:///{tmp_path / 'p.db'}", maintenance={"enabled": False})
        app = create_app(config)
        seen: dict[str, str | None] = {}
        async with app.router.lifespan_context(app):
            for root in ("", "/permits"):
                transport = httpx.ASGITransport(app=app, root_path=root)
                async with httpx.AsyncClient(transport=transport, base_url="http://permits.test") as http:
                    for path in ("/v1/semaphores", "/healthz"):
                        answer = await http.get(root + path)
                        assert answer.status_code == 200, (root, path, answer.text)
                        seen[root + path] = answer.headers.get("cache-control")
        return seen

    assert set(asyncio.run(scenario()).values()) == {"no-store"}
