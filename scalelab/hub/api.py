"""Hub API handlers the course replaces: batchspawner's `POST /hub/api/batchspawner`, and bounds on what a user
makes the hub store (`install_body_limits`: user options refused before JupyterHub stores or logs them; a token's
note, its request body and the number of tokens a user holds).

batchspawner's own handler (batchspawner/api.py) sets *any* spawner attribute named in the request body, and the
token that authorises the call is the student's own server token, readable inside their job. With it a student can
overwrite e.g. `batch_cancel_cmd`, which the hub then runs in a shell. This handler accepts exactly one thing: the
body ``{"port": <integer 1..65535>}``, from the token of a server that is starting and waiting for its port.
Everything else is refused with 400/403/409 and changes nothing.
"""
from __future__ import annotations

import hmac
import json

from jupyterhub import apihandlers
from jupyterhub.apihandlers import APIHandler, users
from tornado import web

ROUTE = r"/api/batchspawner"


class PortReportHandler(APIHandler):
    """POST /hub/api/batchspawner: a starting server reports the port it listens on; nothing else."""

    def _spawner_for_token(self):
        user = self.current_user
        token = self.get_auth_token() or ""
        spawners = getattr(user, "spawners", None) or {}
        for spawner in spawners.values():
            if spawner.api_token and hmac.compare_digest(str(spawner.api_token), token):
                return spawner
        return None

    @web.authenticated
    def post(self):
        """Accept {"port": N} from a starting server's own token; refuse anything else."""
        try:
            body = json.loads(self.request.body or b"null")
        except ValueError:
            raise web.HTTPError(400, "body must be JSON: {\"port\": <integer>}")
        if not isinstance(body, dict) or set(body) != {"port"}:
            keys = sorted(body) if isinstance(body, dict) else type(body).__name__
            raise web.HTTPError(400, f"only {{\"port\": <integer>}} is accepted, got {keys}")
        port = body["port"]
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise web.HTTPError(400, f"port must be an integer 1..65535, got {port!r}")
        spawner = self._spawner_for_token()
        if spawner is None:
            raise web.HTTPError(403, "only a server's own token may report its port")
        report = getattr(spawner, "report_port", None)
        if report is None or not spawner._spawn_pending:
            raise web.HTTPError(409, "this server is not waiting for a port")
        report(port)
        self.set_status(201)
        self.finish(json.dumps({"message": f"port {port} recorded"}))


def install_port_handler(handlers: list | None = None) -> list:
    """Put PortReportHandler in JupyterHub's API handler list in place of batchspawner's; return the list."""
    handlers = apihandlers.default_handlers if handlers is None else handlers
    handlers[:] = [h for h in handlers if h[0] != ROUTE]
    handlers.append((ROUTE, PortReportHandler))
    return handlers


#: Largest request body the hub accepts on a server route (user options, display name): checked before JupyterHub
#: stores options in its database or writes them to its log.
MAX_SERVER_BODY_BYTES = 4096


class BoundedServerAPIHandler(users.UserServerAPIHandler):
    """JupyterHub's start/stop/update-a-server API, refusing an oversized body before it is stored or logged."""

    async def prepare(self):
        size = len(self.request.body or b"")
        if size > MAX_SERVER_BODY_BYTES:
            raise web.HTTPError(413, f"request body of {size} bytes; a server request takes at most "
                                     f"{MAX_SERVER_BODY_BYTES} (a profile name and a walltime)")
        await super().prepare()


#: What a token request stores: a note a person reads in the token list, a few scopes, an expiry.
MAX_TOKEN_BODY_BYTES = 4096
MAX_TOKEN_NOTE_CHARS = 200
#: Live (unexpired) tokens one user may hold: each is a database row; a loop of requests must not grow it forever.
MAX_TOKENS_PER_USER = 100


class BoundedTokenListAPIHandler(users.UserTokenListAPIHandler):
    """JupyterHub's create-a-token API with its stored fields bounded: the body, the note, the number of tokens."""

    async def prepare(self):
        if self.request.method == "POST":
            size = len(self.request.body or b"")
            if size > MAX_TOKEN_BODY_BYTES:
                raise web.HTTPError(413, f"request body of {size} bytes; a token request takes at most "
                                         f"{MAX_TOKEN_BODY_BYTES} (a note, scopes, an expiry)")
            try:
                note = (json.loads(self.request.body or b"{}") or {}).get("note")
            except (ValueError, AttributeError):
                note = None  # JupyterHub's own handler answers malformed bodies
            if isinstance(note, str) and len(note) > MAX_TOKEN_NOTE_CHARS:
                raise web.HTTPError(400, f"a token note of {len(note)} characters; at most {MAX_TOKEN_NOTE_CHARS}")
        await super().prepare()

    async def post(self, user_name):
        from datetime import datetime, timezone
        user = self.find_user(user_name)
        if user is not None:
            now = datetime.now(timezone.utc).replace(tzinfo=None)
            live = [t for t in user.api_tokens if t.expires_at is None or t.expires_at > now]
            if len(live) >= MAX_TOKENS_PER_USER:
                raise web.HTTPError(403, f"{user_name} already holds {len(live)} tokens, the most a user may hold "
                                         f"({MAX_TOKENS_PER_USER}): delete some (Token page) first")
        return await super().post(user_name)


def install_body_limits(handlers: list | None = None) -> list:
    """Put the bounded handlers in JupyterHub's API handler list in place of its server and token-list handlers."""
    handlers = apihandlers.default_handlers if handlers is None else handlers
    bounded = {users.UserServerAPIHandler: BoundedServerAPIHandler,
               users.UserTokenListAPIHandler: BoundedTokenListAPIHandler}
    handlers[:] = [(route, bounded.get(cls, cls), *rest) for route, cls, *rest in handlers]
    return handlers
