"""Shared-password sign-in with per-student passwords and throttling: JupyterHub's SharedPasswordAuthenticator,
plus a roster (`roster_passwords`: a student listed with a password of their own signs in with that password only,
never the shared one), the class list checked on every sign-in (`class_list`: the course settings' names, not
JupyterHub's allowed_users, which its database's users join) and a limit on failures.

Upstream a script may try passwords as fast as the hub answers (40 a second here) and then sign in with the right
one. Here, `max_failures` failed sign-ins within `window_s` for one name, or `max_address_failures` from one
address (higher: a classroom may share one address), lock that name or address for `lockout_s`: every attempt in
that time is refused with 429 and a message saying how long to wait, the right password included. The address is
the connection's, or the one a trusted proxy forwarded (`addresses.client_address`), never a header a client
wrote. A success clears the name's count. Counts live in the hub's memory (a restart
forgets them) and are pruned, so a flood of made-up names cannot grow them without bound.
"""
from __future__ import annotations

import time
from collections import deque
from hmac import compare_digest

from jupyterhub.authenticators.shared import SharedPasswordAuthenticator
from jupyterhub.utils import maybe_future
from tornado import web
from traitlets import Dict, Float, Integer, List, Set, Unicode

from .addresses import OWN_PROXY, client_address

MAX_TRACKED = 10_000  # names + addresses remembered at once


class CourseSharedPasswordAuthenticator(SharedPasswordAuthenticator):
    """SharedPasswordAuthenticator that locks a name or an address after repeated failures."""

    max_failures = Integer(5, help="Failed sign-ins (per name and per address) within window_s before a lock."
                           ).tag(config=True)
    max_address_failures = Integer(50, help="Failed sign-ins from one address within window_s before a lock."
                                   ).tag(config=True)
    window_s = Float(60.0, help="Seconds over which failures are counted.").tag(config=True)
    lockout_s = Float(60.0, help="Seconds a locked name or address is refused, whatever the password.").tag(config=True)

    trusted_proxies = List(Unicode(), [OWN_PROXY], help="Proxies whose X-Forwarded-For is believed: 'own-proxy' (the "
                           "hub's own configurable-http-proxy) and addresses or networks (hub.trusted_proxies)."
                           ).tag(config=True)

    class_list = Set(Unicode(), None, allow_none=True,
                     help="The names that may sign in (the class list and the admins), as the course settings say: "
                          "checked on every sign-in, whatever JupyterHub's allowed_users grew to from its database or "
                          "the admin panel. None: the allowed_users and admin_users configured at construction."
                     ).tag(config=True)

    roster_passwords = Dict(help="Per-student passwords {name: password} from the course roster; those students "
                            "sign in with their own password only.").tag(config=True)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if self.class_list is None:  # before JupyterHub adds its database's users to allowed_users
            self.class_list = {*self.allowed_users, *self.admin_users}
        self._failures: dict[tuple[str, str], deque] = {}
        self._locked: dict[tuple[str, str], float] = {}

    async def authenticate(self, handler, data):
        """Refuse while locked; otherwise check the password and count a failure."""
        now = time.monotonic()
        keys = [("name", self.normalize_username(str(data.get("username", ""))[:64]))]
        if handler is not None and getattr(handler, "request", None) is not None:
            # never Tornado's remote_ip (any client sets it with X-Real-IP): the connection's own peer, or what a
            # trusted proxy says it saw; the request's log lines name that address too
            address = client_address(handler.request, self.trusted_proxies)
            handler.request.remote_ip = address
            keys.append(("address", address))
        for key in keys:
            until = self._locked.get(key, 0.0)
            if until > now:
                self.log.warning("Sign-in refused: %s %r locked for %.0f s more", key[0], key[1], until - now)
                raise web.HTTPError(429, f"Too many failed sign-ins for this {key[0]}: wait {until - now:.0f} s, "
                                         "then try again (ask your instructor if you forgot the password)")
        result = await self._check_password(handler, data)
        if result is None:
            for key in keys:
                self._fail(key, now)
            return None
        self._failures.pop(keys[0], None)
        name = result["name"]
        # the class list is the whole gate: JupyterHub's allowed_users also holds every user of its database (added
        # by an admin, dropped from the list, left from a try-out), so it is not what the course settings list
        listed = self.allow_all or name in self.class_list
        if not listed or not await maybe_future(self.check_allowed(name, result)):
            # Only someone who knows the course's password learns this (no list of names for strangers to probe);
            # "Invalid username or password" made students think the password was wrong.
            self.log.warning("Sign-in with the right password under a name off the list: %r", name[:64])
            raise web.HTTPError(403, f"The name {name[:64]!r} is not on this course's class list (the password was "
                                     "right): sign in with the name your instructor gave you")
        return result

    async def _check_password(self, handler, data):
        name = self.normalize_username(str(data.get("username", "")))
        own = self.roster_passwords.get(name)
        if own and name not in self.admin_users:  # admins keep the admin password
            ok = compare_digest(str(data.get("password", "")).encode(), own.encode())
            return {"name": name, "admin": False, "groups": []} if ok else None
        return await super().authenticate(handler, data)

    def _fail(self, key: tuple[str, str], now: float) -> None:
        if len(self._failures) >= MAX_TRACKED:
            self._prune(now)
        times = self._failures.setdefault(key, deque())
        times.append(now)
        while times and times[0] < now - self.window_s:
            times.popleft()
        if len(times) >= (self.max_failures if key[0] == "name" else self.max_address_failures):
            self._locked[key] = now + self.lockout_s
            self.log.warning("Sign-in locked: %s %r for %.0f s after %d failures", key[0], key[1][:64],
                             self.lockout_s, len(times))
            times.clear()

    def _prune(self, now: float) -> None:
        for key in [k for k, t in self._failures.items() if not t or t[-1] < now - self.window_s]:
            del self._failures[key]
        for key in [k for k, until in self._locked.items() if until <= now]:
            del self._locked[key]
        while len(self._failures) >= MAX_TRACKED:  # all recent: forget the oldest
            del self._failures[next(iter(self._failures))]
