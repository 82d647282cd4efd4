"""The API's interactive reference (``/docs``, Swagger UI) and its reading view (``/redoc``), served by the
instance itself.

FastAPI's own pages load their scripts from a CDN (jsDelivr), so they are blank where the browser cannot
reach one: a lock service often runs on a private network. The scripts come from ``fastapi-offline``, a
package made to carry them, and are served from ``/docs/assets/``; like ``/openapi.json`` the pages need
no token (they hold no data: the document states the API and this instance's limits only).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

#: Where the pages' scripts and styles are served from.
ASSETS = "/docs/assets"


def install(app: FastAPI) -> None:
    """Serve ``/docs`` and ``/redoc`` with their assets from this instance (create the app with
    ``docs_url=None, redoc_url=None`` so that FastAPI's CDN-loading pages are not served as well)."""
    # StaticFiles answers HEAD, and If-None-Match / If-Modified-Since with a 304: a browser asks once.
    app.mount(ASSETS, StaticFiles(packages=[("fastapi_offline", "static")]), name="reference-assets")

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")  # behind a proxy that serves the instance under a prefix
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} API",
            swagger_js_url=f"{root}{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS}/favicon.png",
            swagger_ui_parameters=app.swagger_ui_parameters,
        )

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} API",
            redoc_js_url=f"{root}{ASSETS}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{ASSETS}/favicon.png",
            with_google_fonts=False,  # fonts.googleapis.com is another site it would need
        )
