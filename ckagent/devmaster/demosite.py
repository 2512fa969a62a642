"""A small, deterministic demo shop the example spiders crawl (mounted at ``/demo-site/``, no auth).

Five listing pages of six products each (30 products). Product ``i`` (1..30) has the title
``"Product {i:02d}"``, the price ``f"{i * 3 + 0.99:.2f}"`` and the sku ``"SKU-{i:04d}"``::

    /demo-site/                 page 1
    /demo-site/page/{n}/        page n (1..5): <ul class="products"> of <li class="product">, then a
                                <a class="next"> link except on the last page
    /demo-site/product/{i}/     detail page: h1.title, span.price, span.sku, p.description

Anything else under /demo-site/ is a 404. The example spiders and their tests depend on this exact
HTML: change it only together with them.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import BaseRoute, Route

__all__ = ["PAGES", "PER_PAGE", "PRODUCTS", "expected_products", "page_html", "product_html", "routes"]

PAGES = 5
PER_PAGE = 6
PRODUCTS = PAGES * PER_PAGE


def _title(i: int) -> str:
    return f"Product {i:02d}"


def _price(i: int) -> str:
    return f"{i * 3 + 0.99:.2f}"


def _sku(i: int) -> str:
    return f"SKU-{i:04d}"


def expected_products() -> list[dict[str, Any]]:
    """What a spider that crawls the whole site should yield: ``[{title, price, sku, url}]`` in order.

    ``price`` is the string shown on the page; ``url`` is the detail page path (relative to the host).
    """
    return [
        {"title": _title(i), "price": _price(i), "sku": _sku(i), "url": f"/demo-site/product/{i}/"}
        for i in range(1, PRODUCTS + 1)
    ]


def page_html(n: int) -> str:
    """The HTML of listing page ``n`` (1..PAGES). Raises ValueError outside that range."""
    if not 1 <= n <= PAGES:
        raise ValueError(f"no page {n}")
    parts = [
        f"<html><head><title>Demo shop – page {n}</title></head><body>",
        '<ul class="products">',
    ]
    for i in range((n - 1) * PER_PAGE + 1, n * PER_PAGE + 1):
        parts.append(
            f'<li class="product"><a class="title" href="/demo-site/product/{i}/">{_title(i)}</a>'
            f' <span class="price">{_price(i)}</span> <span class="sku">{_sku(i)}</span></li>'
        )
    parts.append("</ul>")
    if n < PAGES:
        parts.append(f'<a class="next" href="/demo-site/page/{n + 1}/">next</a>')
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def product_html(i: int) -> str:
    """The HTML of product ``i``'s detail page (1..PRODUCTS). Raises ValueError outside that range."""
    if not 1 <= i <= PRODUCTS:
        raise ValueError(f"no product {i}")
    return (
        f"<html><head><title>{_title(i)}</title></head><body>\n"
        f'<h1 class="title">{_title(i)}</h1>\n'
        f'<span class="price">{_price(i)}</span> <span class="sku">{_sku(i)}</span>\n'
        f'<p class="description">Description of product {i:02d}.</p>\n'
        "</body></html>\n"
    )


def _not_found() -> Response:
    return HTMLResponse("<html><body><h1>404 Not Found</h1></body></html>\n", status_code=404)


async def _home(request: Request) -> Response:
    return HTMLResponse(page_html(1))


async def _page(request: Request) -> Response:
    n: int = request.path_params["n"]
    return HTMLResponse(page_html(n)) if 1 <= n <= PAGES else _not_found()


async def _product(request: Request) -> Response:
    i: int = request.path_params["i"]
    return HTMLResponse(product_html(i)) if 1 <= i <= PRODUCTS else _not_found()


def routes() -> list[BaseRoute]:
    """The demo site's routes, to include in the dev master's app."""
    return [
        Route("/demo-site/", _home, methods=["GET"]),
        Route("/demo-site/page/{n:int}/", _page, methods=["GET"]),
        Route("/demo-site/product/{i:int}/", _product, methods=["GET"]),
    ]
