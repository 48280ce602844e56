"""Hub API handlers the course replaces: batchspawner's `POST /hub/api/batchspawner`, and a size bound on the
server routes (`install_body_limits`: user options are refused before JupyterHub stores or logs them).

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


def install_body_limits(handlers: list | None = None) -> list:
    """Put BoundedServerAPIHandler in JupyterHub's API handler list in place of its server handler."""
    handlers = apihandlers.default_handlers if handlers is None else handlers
    handlers[:] = [(route, BoundedServerAPIHandler if cls is users.UserServerAPIHandler else cls, *rest)
                   for route, cls, *rest in handlers]
    return handlers
