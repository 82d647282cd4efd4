"""The API's interactive reference (``/docs``, Swagger UI) and its reading view (``/redoc``), served by the
instance itself.

FastAPI's own pages load their scripts from a CDN (jsDelivr), so they are blank where the browser cannot
reach one: a lock service often runs on a private network. The scripts come from ``fastapi-offline``, a
package made to carry them, and are served from ``/docs/assets/``; like ``/openapi.json`` the pages need
no token (they hold no data: the document states the API and this instance's limits only).
"""

from __future__ import annotations

from fastapi import FastAPI, HTTPException, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

#: Where the pages' scripts and styles are served from.
ASSETS = "/docs/assets"
#: The files of fastapi-offline's that the pages load; nothing else of the package is served.
_FILES = frozenset({"swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js", "favicon.png"})
#: The pages run only their own scripts and the instance's, and ask nothing of another site: not even
#: ReDoc's logo, from cdn.redoc.ly. Swagger UI's page starts it with an inline script, and both pages style
#: inline; ReDoc searches in a worker it makes from a blob. The dashboard's token may be in this origin's
#: storage, which is why no other site's script may run here.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; worker-src 'self' blob:; connect-src 'self'; frame-ancestors 'none'; "
    "base-uri 'none'; form-action 'self'"
)
_HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff"}


def install(app: FastAPI) -> None:
    """Serve ``/docs`` and ``/redoc`` with their assets from this instance (create the app with
    ``docs_url=None, redoc_url=None`` so that FastAPI's CDN-loading pages are not served as well)."""
    # Routes, not a mount: each is counted under its route in the metrics, and a 405 lists its methods.
    # StaticFiles still answers: with validators, and a 304 to a browser that has the file.
    files = StaticFiles(packages=[("fastapi_offline", "static")])

    @app.get(f"{ASSETS}/{{name}}", include_in_schema=False)
    async def asset(name: str, request: Request) -> Response:
        if name not in _FILES:
            raise HTTPException(status_code=404, detail="no such file of the API reference")
        response = await files.get_response(name, request.scope)
        response.headers.update(_HEADERS)
        return response

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")  # behind a proxy that serves the instance under a prefix
        page = get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} API",
            swagger_js_url=f"{root}{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS}/favicon.png",
            swagger_ui_parameters=app.swagger_ui_parameters,
        )
        page.headers.update(_HEADERS)
        return page

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        page = get_redoc_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} API",
            redoc_js_url=f"{root}{ASSETS}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{ASSETS}/favicon.png",
            with_google_fonts=False,  # fonts.googleapis.com is another site it would need
        )
        page.headers.update(_HEADERS)
        return page
