"""HTTP calls from trillm to its own processes (the supervisor to its replicas, a replica to its
peers): straight to the address given, whatever the environment says.

urllib's default opener sends every call through a proxy named by `http_proxy` / `HTTP_PROXY`
(unless `no_proxy` lists the host), so a shell with a proxy set for the internet would route a
replica's loopback health check to the proxy, and a supervisor would wait on it forever. And
it follows redirects, which would carry a client's key to wherever a redirect points. So these
calls use an opener with no proxy and no redirects: an address that answers 3xx has answered.
"""
from __future__ import annotations

import urllib.request


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args):
        return None


OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirects())
PROXY_VARIABLES = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")


def open_direct(request: urllib.request.Request | str, timeout: float):
    """`urllib.request.urlopen`, through `OPENER`: the same errors, no proxy, no redirects."""
    return OPENER.open(request, timeout=timeout)
