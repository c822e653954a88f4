"""The approvals inbox in a browser (``agentfast ui``; docs/ui.md): runs, the calls awaiting a
person, the transcript, and approve / deny / complete / reply forms, updated live.

A Starlette app with Jinja2 templates (``runner/inbox_pages``), served by uvicorn. What it shows and
does comes from an inbox (runner/inbox.py), chosen per request by :class:`Access`:

- one inbox for every request: the local store, or the cluster as the kubeconfig's user. Then the
  server listens on a loopback address only (``agentfast ui`` refuses others): whoever reaches it
  decides as that user.
- ``token``: the cluster as the person whose bearer token the request carries (an
  ``Authorization: Bearer`` header from an authenticating proxy, or the cookie the login page sets
  from a token they pasted). The server's own service account is never used for AgentRuns.

Defences, because a page that approves refunds is a target:

- Text from models, tools and people is data. Templates autoescape, and the Content-Security-Policy
  allows only this server's own script and style (no inline script), so markup in a transcript
  neither renders nor runs. The ``markup`` case (tests/cases) applies to HTML too.
- A form post needs a CSRF token bound to the person's credentials (:meth:`Access.csrf_token`),
  and an ``Origin``, when the browser sends one, of this server's host.
- Only allowed ``Host`` headers are served (TrustedHostMiddleware: no DNS rebinding onto the loopback
  inbox). ``frame-ancestors 'none'``: no clickjacking of the approve button.
- The token cookie is HttpOnly, SameSite=Strict, and Secure over HTTPS.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import os
import re
import sys
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import jinja2
from cryptography.fernet import Fernet, InvalidToken
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.templating import Jinja2Templates

from .errors import AgentfastError
from .inbox import KubeInbox, LocalInbox, Refused, pretty_json, visible
from .names import format_run_id
from .output import age

if TYPE_CHECKING:
    from .store import Store

Inbox = LocalInbox | KubeInbox

#: The cookie of the person's credential (the token pasted into the login page, or the shared
#: inbox's secret), sent back only to this server.
TOKEN_COOKIE = "agentfast_token"
#: How long a pasted token is kept by the browser (seconds); the token's own expiry still applies.
TOKEN_COOKIE_MAX_AGE_S = 8 * 3600
#: How often a live page's server checks for a change (seconds).
LIVE_POLL_S = 1.0
#: Live pages served at once by one process (each is checked every LIVE_POLL_S).
MAX_LIVE_STREAMS = 64
#: Per-token inboxes kept (each holds an HTTP connection pool to the API server).
TOKEN_INBOXES = 64

#: What a bearer token may hold (RFC 6750's b64token is narrower; JWTs and ServiceAccount tokens
#: fit): printable ASCII, no space, at most 16 KiB, so nothing else rides into the header it goes in.
BEARER_TOKEN = re.compile(r"[\x21-\x7e]{1,16384}")
#: A namespace's name (RFC 1123 label, as Kubernetes validates it).
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
#: An object's name (RFC 1123 subdomain).
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-.a-z0-9]{0,251}[a-z0-9])?")
#: The largest form a page posts (bytes): a reason is at most 1 KiB, a result or reply 4 KiB.
MAX_FORM_BYTES = 64 * 1024
#: Live pages one person may keep open on one process.
MAX_LIVE_STREAMS_PER_PERSON = 8

_PAGES = resources.files("agentfast.runner") / "inbox_pages"

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self';"
    " form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)


class NoCredentials(AgentfastError):
    """A request without the credential its inbox needs: the person's token (they log in first),
    or the shared inbox's secret (they open the address ``agentfast ui`` printed)."""


@dataclass
class Access:
    """How a request gets its inbox, and who it acts for.

    ``shared``: one inbox for every request (the local store, or the kubeconfig's user), given to
    a request that carries ``secret``: in the address ``agentfast ui`` prints (``?token=``, then
    in an HttpOnly cookie), like a Jupyter server's token. Loopback is not per user: without it,
    any local account could decide as the one who started the inbox. Else ``token_inbox(token)``
    makes the inbox of a bearer token's person (kept, up to :data:`TOKEN_INBOXES`, by the
    token's hash)."""

    shared: Inbox | None = None
    secret: str = ""
    token_inbox: Callable[[str], KubeInbox] | None = None
    cookie_key: bytes = field(default_factory=Fernet.generate_key)
    _by_token: OrderedDict[str, KubeInbox] = field(default_factory=OrderedDict)

    @property
    def cookie(self) -> str:
        """The credential cookie's name. The shared inbox's is its own (cookies are per host, not
        per port: two inboxes on 127.0.0.1 must not overwrite each other's)."""
        if self.shared is None:
            return TOKEN_COOKIE
        return f"{TOKEN_COOKIE}_{hashlib.sha256(self.secret.encode()).hexdigest()[:12]}"

    def cookie_value(self, token: str) -> str:
        """The login cookie of ``token``: encrypted and timestamped (Fernet) under
        :attr:`cookie_key`. Cookies go to every port of a host (a port-forwarded inbox on
        localhost shares them with any local server): what leaks is good only at this inbox,
        for :data:`TOKEN_COOKIE_MAX_AGE_S`, never at the API server."""
        return Fernet(self.cookie_key).encrypt(token.encode()).decode()

    def credential(self, request: Request) -> str | None:
        """The request's credential: for the shared inbox its secret (the cookie), from this
        machine's user who started it (:func:`_same_user`); else the bearer token (its
        Authorization header, else the login cookie, decrypted). None when it has none."""
        if self.shared is not None:
            sent = request.cookies.get(self.cookie, "")
            ok = self.secret and hmac.compare_digest(sent.encode(), self.secret.encode()) and _same_user(request)
            return sent if ok else None
        auth = request.headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            token = auth[7:].strip()
        else:
            try:
                token = (
                    Fernet(self.cookie_key).decrypt(request.cookies.get(TOKEN_COOKIE, ""), ttl=TOKEN_COOKIE_MAX_AGE_S).decode()
                )
            except (InvalidToken, UnicodeDecodeError):
                return None
        return token if BEARER_TOKEN.fullmatch(token) else None

    def inbox(self, request: Request) -> Inbox:
        """The inbox this request acts through. Raises NoCredentials, also for a token the API
        server does not accept (so an expired one leads to the login page)."""
        credential = self.credential(request)
        if not credential:
            raise NoCredentials()
        if self.shared is not None:
            return self.shared
        assert self.token_inbox is not None
        key = hashlib.sha256(credential.encode()).hexdigest()
        inbox = self._by_token.get(key)
        if inbox is None:
            inbox = self.token_inbox(credential)
            try:
                inbox.user  # noqa: B018 (a SelfSubjectReview: only a token the API server accepts is kept)
            except Refused:
                raise NoCredentials() from None
            self._by_token[key] = inbox
            while len(self._by_token) > TOKEN_INBOXES:
                self._by_token.popitem(last=False)
        self._by_token.move_to_end(key)
        return inbox

    def csrf_token(self, request: Request) -> str:
        """The CSRF token of this request's person: an HMAC under their credential, which only they
        hold (so it needs no state, and the inbox's replicas agree on it)."""
        return hmac.new((self.credential(request) or "").encode(), b"agentfast-ui-csrf", hashlib.sha256).hexdigest()


def create_app(access: Access, *, allowed_hosts: list[str]) -> Starlette:
    """The inbox's ASGI app. ``allowed_hosts``: Host header values served (``["*"]``: any)."""
    live = asyncio.Semaphore(MAX_LIVE_STREAMS)
    live_by_person: Counter[str] = Counter()
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(_PAGES)), autoescape=True)
    env.filters["pretty_json"] = pretty_json
    env.filters["visible"] = visible
    env.filters["age"] = age
    templates = Jinja2Templates(env=env)

    def csrf_token(request: Request) -> str:
        return access.csrf_token(request)

    def secure(request: Request) -> bool:
        return request.url.scheme == "https" or request.headers.get("x-forwarded-proto") == "https"

    def entered_with_token(request: Request) -> Response | None:
        """For the shared inbox opened at the printed address (``?token=``): the cookie, and the
        same page without the token in its address. None for any other request."""
        sent = request.query_params.get("token")
        if access.shared is None or sent is None:
            return None
        if not (hmac.compare_digest(sent.encode(), access.secret.encode()) and _same_user(request)):
            return no_credentials(request)
        response = RedirectResponse(request.url.path, status_code=303)
        response.set_cookie(access.cookie, access.secret, httponly=True, samesite="strict", secure=secure(request))
        return response

    def no_credentials(request: Request) -> Response:
        if access.shared is not None:
            message = "open the address `agentfast ui` printed: it carries this inbox's token"
            return page(request, "error.html", {"inbox": None, "message": message}, 401)
        if request.method == "GET":
            return RedirectResponse("/login", status_code=303)
        return PlainTextResponse("log in first", status_code=401)

    def page(request: Request, name: str, context: dict[str, Any], status_code: int = 200) -> Response:
        inbox = context.get("inbox")
        context = {
            "csrf": csrf_token(request),
            "mode": inbox.mode if inbox is not None else "kube",
            "login": access.shared is None,
            "user": None,
            **context,
        }
        return templates.TemplateResponse(request, name, context, status_code=status_code)

    def enter(request: Request) -> Inbox | Response:
        """The request's inbox, or the response that lets the person in: the printed address's
        token exchanged for the cookie, the login page, or a 401."""
        entered = entered_with_token(request)
        if entered is not None:
            return entered
        try:
            return access.inbox(request)
        except NoCredentials:
            return no_credentials(request)

    async def index(request: Request) -> Response:
        inbox = enter(request)
        if isinstance(inbox, Response):
            return inbox
        namespace = request.query_params.get("namespace") or (inbox.namespace if isinstance(inbox, KubeInbox) else None)
        if namespace is not None and not DNS_LABEL.fullmatch(namespace):
            return page(
                request, "error.html", {"inbox": inbox, "message": f"not a namespace name (a DNS label): {namespace!r}"}, 400
            )
        try:
            # The version first: a change after it and before the read only costs a refresh.
            version = await run_in_threadpool(inbox.version, None, namespace)
            runs = await run_in_threadpool(inbox.runs, namespace)
            user = await run_in_threadpool(lambda: inbox.user)
        except Refused as e:
            return page(request, "error.html", {"inbox": inbox, "message": str(e)}, 403)
        waiting = [r for r in runs if r.pending]
        return page(
            request,
            "index.html",
            {
                "inbox": inbox,
                "runs": runs,
                "waiting": waiting,
                "namespace": namespace,
                "user": user,
                "version": version,
            },
        )

    async def run_page(request: Request) -> Response:
        inbox = enter(request)
        if isinstance(inbox, Response):
            return inbox
        return await _render_run(request, inbox, None, 200)

    async def _render_run(request: Request, inbox: Inbox, outcome: tuple[bool, str] | None, status_code: int) -> Response:
        run_key = _run_key_of(request)
        if run_key is None:
            return page(request, "error.html", {"inbox": inbox, "message": "not a run's address"}, 404)
        try:
            version = await run_in_threadpool(inbox.version, run_key)  # first, as on the index
            view = await run_in_threadpool(inbox.run, run_key)
            user = await run_in_threadpool(lambda: inbox.user)
        except Refused as e:
            return page(request, "error.html", {"inbox": inbox, "message": str(e)}, 403)
        if view is None:
            return page(request, "error.html", {"inbox": inbox, "message": f"no run {run_key}"}, 404)
        return page(
            request,
            "run.html",
            {"inbox": inbox, "view": view, "outcome": outcome, "user": user, "version": version},
            status_code,
        )

    async def decide(request: Request) -> Response:
        try:
            inbox = access.inbox(request)
        except NoCredentials:
            return no_credentials(request)
        run_key = _run_key_of(request)
        if run_key is None:
            return PlainTextResponse("not a run's address", status_code=404)
        form = await _small_form(request)
        refused = _refuse_forgery(request, str(form.get("csrf", "")), csrf_token(request))
        if refused is not None:
            return refused
        decision = str(form.get("decision", ""))
        text = str(form.get("text", ""))
        reason = text if decision in ("approve", "deny") else None
        result = text if decision in ("complete", "reply") else None
        try:
            said = await run_in_threadpool(
                inbox.decide,
                run_key,
                str(form.get("call_id", "")),
                decision,
                reason=reason,
                result=result,
                uid=str(form.get("uid", "")) or None,
                digest=str(form.get("digest", "")) or None,  # G13: of the arguments this page showed
            )
        except Refused as e:
            return await _render_run(request, inbox, (False, str(e)), 409)
        if isinstance(inbox, LocalInbox):
            said += await run_in_threadpool(_local_next_step, inbox.store, run_key)
        return await _render_run(request, inbox, (True, said), 200)

    async def events(request: Request) -> Response:
        """Server-Sent Events: ``changed`` whenever what the page at ``?page=`` shows differs from
        the version ``?since=`` it was rendered at (its ``data-version``)."""
        try:
            inbox = access.inbox(request)
        except NoCredentials:
            return no_credentials(request)
        target = request.query_params.get("page", "/")
        namespace = request.query_params.get("namespace")
        if namespace is not None and not DNS_LABEL.fullmatch(namespace):
            return PlainTextResponse("not a namespace name", status_code=400)
        parts = urlsplit(target).path.strip("/").split("/")
        run_key = None
        if len(parts) == 3 and parts[0] == "runs":
            if not (DNS_LABEL.fullmatch(parts[1]) and DNS_SUBDOMAIN.fullmatch(parts[2])):
                return PlainTextResponse("not a run's address", status_code=400)
            run_key = format_run_id(parts[1], parts[2])
        person = hashlib.sha256((access.credential(request) or "").encode()).hexdigest()

        def fingerprint() -> str:
            try:
                return inbox.version(run_key, namespace)
            except Refused as e:
                return f"refused: {e}"

        async def stream(now: str) -> AsyncIterator[dict[str, str]]:
            # Compared from the version the page was rendered at, not from the first look here:
            # what changed between the render and this connection is a change too.
            last = request.query_params.get("since", "")
            live_by_person[person] += 1
            try:
                async with live:
                    while True:
                        if now != last:
                            last = now
                            yield {"event": "changed", "data": now}
                        if now.startswith("refused: "):
                            return  # the page, fetched again, says why; no polling of a refusal
                        await asyncio.sleep(LIVE_POLL_S)
                        now = await run_in_threadpool(fingerprint)
            finally:
                live_by_person[person] -= 1

        if live.locked() or live_by_person[person] >= MAX_LIVE_STREAMS_PER_PERSON:
            return PlainTextResponse("busy: too many live pages; reload later", status_code=503)
        first = await run_in_threadpool(fingerprint)
        if first.startswith("refused: "):
            return Response(status_code=204)  # 204 tells EventSource not to reconnect (HTML's SSE spec)
        return EventSourceResponse(stream(first), ping=15)

    async def login(request: Request) -> Response:
        if access.shared is not None:
            return RedirectResponse("/", status_code=303)
        if request.method == "GET":
            return page(request, "login.html", {"message": None})
        # Login CSRF (a site logging a person in as itself): a same-origin post only.
        if request.headers.get("origin") is None and request.headers.get("sec-fetch-site", "same-origin") != "same-origin":
            return PlainTextResponse("refused: a login posted from another site", status_code=403)
        refused = _refuse_forgery(request, None, None)
        if refused is not None:
            return refused
        form = await _small_form(request)
        token = str(form.get("token", "")).strip()
        if token and not BEARER_TOKEN.fullmatch(token):
            return page(request, "login.html", {"message": "that is not a bearer token (printable characters, no spaces)"}, 401)
        assert access.token_inbox is not None
        try:
            user = await run_in_threadpool(lambda: access.token_inbox(token).user) if token else None  # type: ignore[misc]
        except Refused as e:
            return page(request, "login.html", {"message": str(e)}, 401)
        if user is None:
            return page(request, "login.html", {"message": "paste a token (e.g. from `kubectl create token`)"}, 401)
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(
            TOKEN_COOKIE,
            access.cookie_value(token),
            max_age=TOKEN_COOKIE_MAX_AGE_S,
            httponly=True,
            samesite="strict",
            secure=secure(request),
        )
        return response

    async def logout(request: Request) -> Response:
        if access.credential(request) is None:
            return RedirectResponse("/login", status_code=303)
        form = await _small_form(request)
        refused = _refuse_forgery(request, str(form.get("csrf", "")), csrf_token(request))
        if refused is not None:
            return refused
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(TOKEN_COOKIE)
        return response

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok")

    async def security_headers(request: Request, call_next: Callable[[Request], Any]) -> Response:
        response: Response = await call_next(request)
        response.headers["Content-Security-Policy"] = CSP
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["X-Frame-Options"] = "DENY"  # for browsers without CSP frame-ancestors
        response.headers["Referrer-Policy"] = "same-origin"  # not no-referrer: with it Chromium posts forms with Origin: null
        response.headers.setdefault("Cache-Control", "no-store")
        return response

    return Starlette(
        routes=[
            Route("/", index),
            Route("/runs/{namespace}/{name}", run_page),
            Route("/runs/{namespace}/{name}/decide", decide, methods=["POST"]),
            Route("/events", events),
            Route("/login", login, methods=["GET", "POST"]),
            Route("/logout", logout, methods=["POST"]),
            Route("/healthz", healthz),
            Route("/static/inbox.js", _asset("inbox.js", "text/javascript")),
            Route("/static/inbox.css", _asset("inbox.css", "text/css")),
        ],
        middleware=[
            Middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts, www_redirect=False),
            Middleware(BaseHTTPMiddleware, dispatch=security_headers),
        ],
    )


def _same_user(request: Request) -> bool:
    """Whether the connection comes from a socket of this process's own OS user (Linux: the
    ``uid`` column of /proc/net/tcp[6] for the client's end, :func:`_socket_uid_is_ours`). Other
    accounts of the machine reach loopback too, and a cookie leaks to every port of a host; this
    makes a leaked one useless to them. True where /proc/net is not there to ask (the secret still
    holds). Asked once per request (the kernel writes the table out anew at each read: ~50 us a
    socket on the host)."""
    if "agentfast.same_user" not in request.scope:
        request.scope["agentfast.same_user"] = _socket_uid_is_ours(request.scope.get("client"), request.scope.get("server"))
    return bool(request.scope["agentfast.same_user"])


_TIME_WAIT = "06"  # include/net/tcp_states.h: a closed socket's leftover, owned by no one (uid 0)


def _socket_uid_is_ours(client: Any, server: Any) -> bool:
    """Whether the client's socket of the connection ``client`` -> ``server`` (each ``(host,
    port)`` as the ASGI scope has them) belongs to this process's effective uid.

    The client's socket is the one row whose local end is ``client`` and whose remote end is
    ``server``: the whole 4-tuple, addresses and ports. Ports alone are not one connection:
    another account can bind 127.0.0.2 (all of 127/8 is loopback) to the port of our own
    connection, and its row then matched ours. An IPv4 client of a dual-stack listener is
    ``::ffff:a.b.c.d`` in the scope and may be a plain IPv4 row: ends are compared unmapped, in
    /proc/net/tcp, then /proc/net/tcp6. False when no live row matches; True when neither table
    can be read (not Linux)."""
    if not client or not server:
        return False
    try:
        want = (_end(str(client[0]), int(client[1])), _end(str(server[0]), int(server[1])))
    except ValueError:
        return False
    tables = ("/proc/net/tcp6",) if want[0][0].version == 6 else ("/proc/net/tcp", "/proc/net/tcp6")
    asked = False
    for table in tables:
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        asked = True
        for line in lines:
            cols = line.split()
            if cols[3] == _TIME_WAIT:
                continue
            if (_proc_end(cols[1]), _proc_end(cols[2])) == want:
                return int(cols[7]) == os.geteuid()
    return not asked


def _end(host: str | bytes, port: int) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """``(address, port)``, the address text or packed bytes, an IPv4-mapped IPv6 one as its
    IPv4 address. Raises ValueError."""
    address = ipaddress.ip_address(host)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address, port


def _proc_end(text: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """An end as /proc/net/tcp[6] writes it (``0100007F:1F90``: the address's 32-bit words in
    the host's byte order, then the port, in hex) as :func:`_end` returns one."""
    address, port = text.split(":")
    raw = bytes.fromhex(address)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return _end(raw, int(port, 16))


async def _small_form(request: Request) -> Any:
    """The request's form, refused (HTTPException 413/411) above :data:`MAX_FORM_BYTES` or
    without a length, before anything is read: forms here are a few fields of text."""
    length = request.headers.get("content-length")
    if length is None or not length.isdigit():
        raise HTTPException(411, "a form needs a Content-Length")
    if int(length) > MAX_FORM_BYTES:
        raise HTTPException(413, f"a form here is at most {MAX_FORM_BYTES} bytes")
    return await request.form(max_files=0, max_fields=8, max_part_size=MAX_FORM_BYTES)


def _run_key_of(request: Request) -> str | None:
    """The run key of a ``/runs/{namespace}/{name}`` path, or None when either part is not a
    Kubernetes name (so nothing else reaches the API server's paths or the store's keys)."""
    ns, name = request.path_params["namespace"], request.path_params["name"]
    return format_run_id(ns, name) if DNS_LABEL.fullmatch(ns) and DNS_SUBDOMAIN.fullmatch(name) else None


def _asset(name: str, media_type: str) -> Callable[[Request], Any]:
    """A handler serving the page asset ``static/NAME`` (read once): two fixed files, no file server."""
    body = (_PAGES / "static" / name).read_bytes()

    async def serve(request: Request) -> Response:
        return Response(body, media_type=media_type, headers={"Cache-Control": "max-age=300"})

    return serve


def _refuse_forgery(request: Request, sent: str | None, expected: str | None) -> Response | None:
    """403 for a cross-site post: an ``Origin`` of another host than the request's, or (when
    ``expected``) a CSRF token that is not the person's."""
    origin = request.headers.get("origin")
    if origin is not None and urlsplit(origin).netloc != request.headers.get("host", ""):
        return PlainTextResponse(f"refused: a form posted from {origin}, not from this inbox", status_code=403)
    if expected is not None and not hmac.compare_digest((sent or "").encode(), expected.encode()):
        return PlainTextResponse("refused: the form's CSRF token is missing or not yours; reload the page", status_code=403)
    return None


def _local_next_step(store: Store, key: str) -> str:
    """For a local run: what happens next, now that a decision is recorded."""
    from .liveness import runner_state

    if store.awaiting(key):
        return "; other calls of its batch still await a decision"
    if runner_state(store, key).alive:
        return "; its runner goes on"
    return f"; no runner holds it now: go on with `agentfast resume {key.removeprefix('default/')}`"
