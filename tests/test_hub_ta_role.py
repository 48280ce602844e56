"""The TA role (issue 36, item 4): `dashboard.tas` see the course's students on the class dashboard and nothing else,
and get 403 on every action.

Plain functions first (who is a course student, what a TA's snapshot holds), then a real local hub with an admin, an
instructor, two TAs, two students and a hub user outside the class list. Attack tests: a TA acting (on the dashboard
by token and by cookie with a valid XSRF token; on the hub's API, on a student's server), a TA reading staff or
non-course users, a student reading or acting on the dashboard.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import requests

from scalelab.course.release import release_lab
from scalelab.hub.dashboard import class_snapshot, course_students, render_page, viewer_role
from scalelab.hub.settings import load_settings
from scalelab.testing.hub import HubRunner

FIX = Path(__file__).parent / "fixtures" / "grading"
TA_REFUSAL = "Forbidden: teaching assistants may look, not act"
ACTIONS = ("", "api/class", "api/warm", "api/inject", "api/release", "api/collect", "api/grade", "api/return")


@pytest.fixture
def cfg(tmp_path):
    release_lab(FIX / "labs" / "90_fixture", tmp_path / "labs" / "90_fixture")
    return load_settings(overrides={
        "labs": {"source": str(tmp_path / "labs")}, "hub": {"state_dir": str(tmp_path / "state"),
                                                           "admin_users": ["prof"]},
        "servers": {"run_as": "hub-account", "home": str(tmp_path / "homes/{username}")},
        "auth": {"allowed_users": ["ann", "ben", "ina", "tom", "tia"]},
        "dashboard": {"instructors": ["ina"], "tas": ["tom", "tia"]}})


USERS = [{"name": n, "admin": n == "prof", "servers": {}} for n in ("ann", "ben", "ina", "tom", "tia", "prof",
                                                                    "gone", "root2")]
USERS[-1]["admin"] = True  # made admin in the hub's admin panel, not in the settings


def test_roles_follow_the_settings(cfg):
    assert viewer_role(cfg, {"name": "tom"}) == "ta"
    assert viewer_role(cfg, {"name": "ina"}) == viewer_role(cfg, {"name": "prof"}) == "instructor"
    assert viewer_role(cfg, {"name": "root2", "admin": True}) == "instructor"
    assert viewer_role(cfg, {"name": "ann"}) is viewer_role(cfg, {"name": "gone"}) is None
    cfg["dashboard"]["instructors"].append("tom")  # listed twice: the wider role
    assert viewer_role(cfg, {"name": "tom"}) == "instructor"


def test_a_tas_snapshot_holds_the_course_students_only(cfg):
    assert [u["name"] for u in course_students(cfg, USERS)] == ["ann", "ben"]
    ta = class_snapshot(cfg, USERS, role="ta")
    assert [s["name"] for s in ta["students"]] == ["ann", "ben"] and ta["view"] == "ta"
    assert not any(s["admin"] for s in ta["students"])
    assert "Teaching assistant's view" in render_page(ta)
    full = class_snapshot(cfg, USERS)  # the instructors' view is unchanged: every hub user
    assert {s["name"] for s in full["students"]} == {u["name"] for u in USERS}
    assert "Teaching assistant's view" not in render_page(full)
    cfg["auth"]["allowed_users"], cfg["auth"]["any_name"] = [], True  # a try-out hub with no class list
    assert [u["name"] for u in course_students(cfg, USERS)] == ["ann", "ben", "gone"]


# -- on a real hub -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    work = tmp_path_factory.mktemp("hub-ta")
    release_lab(FIX / "labs" / "90_fixture", work / "labs" / "90_fixture")
    runner = HubRunner(work, mode="local", admins=["prof"])
    u = runner.user
    runner.settings["auth"]["allowed_users"] = [u("ann"), u("ben"), u("ina"), u("tom"), u("tia")]
    runner.settings["dashboard"].update(instructors=[u("ina")], tas=[u("tom"), u("tia")])
    import yaml
    runner.config_path.write_text(yaml.safe_dump(runner.settings, sort_keys=False), encoding="utf-8")
    runner.start()
    yield runner
    runner.cleanup()


@pytest.fixture(scope="module")
def people(hub):
    got = {short: hub.login(short) for short in ("prof", "ina", "tom", "ann", "ben")}
    # a hub user outside the class list (an admin made them by hand): no TA may see them
    r = got["prof"].api("POST", f"/users/{hub.user('gone')}")
    assert r.status_code == 201, (r.status_code, r.text)
    return got


def _dash(hub: HubRunner) -> str:
    return f"{hub.url}/services/dashboard/"


def _names(data: dict) -> set[str]:
    return {s["name"] for s in data["students"]}


@pytest.mark.hub
@pytest.mark.slow
def test_a_ta_sees_the_course_students_and_nothing_else(hub, people):
    u = hub.user
    ta = hub.login("tom").session
    page = ta.get(_dash(hub), timeout=60)
    assert page.status_code == 200, (page.status_code, page.text[:300], hub.log_tail())
    assert "Teaching assistant's view" in page.text
    data = ta.get(_dash(hub) + "api/class", timeout=60).json()
    assert _names(data) == {u("ann"), u("ben")}, _names(data)
    assert not any(s["admin"] for s in data["students"])
    for other in ("prof", "ina", "tom", "tia", "gone"):
        assert f"<td>{u(other)}</td>" not in page.text and f"<td>{u(other)} (admin)</td>" not in page.text
    # the control: the instructor's view of the same hub holds everyone
    full = hub.login("ina").session.get(_dash(hub) + "api/class", timeout=60).json()
    assert {u(n) for n in ("ann", "ben", "ina", "tom", "tia", "prof", "gone")} <= _names(full)


@pytest.mark.hub
@pytest.mark.slow
def test_a_ta_gets_403_on_every_dashboard_action_by_token_and_by_cookie(hub, people):
    tom, ina = people["tom"], people["ina"]
    for path in ACTIONS:
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            r = requests.request(method, _dash(hub) + path, headers={"Authorization": f"token {tom.token}"},
                                 json={"users": [hub.user("ann")]}, timeout=30, allow_redirects=False)
            assert (r.status_code, r.reason) == (403, TA_REFUSAL), (method, path, r.status_code, r.reason)
    assert tom.get("/services/dashboard/api/class").status_code == 200  # the same token may read
    # the control: an instructor's POST passes the role gate (there is no such action: 405), so the TA's 403 is
    # the gate's, not the XSRF check's or the hub's
    r = requests.post(_dash(hub) + "api/class", headers={"Authorization": f"token {ina.token}"}, timeout=30)
    assert r.status_code == 405, (r.status_code, r.reason)
    # by cookie, with the dashboard's own XSRF token (what a page's form would send)
    ta = hub.login("tom").session
    assert ta.get(_dash(hub), timeout=60).status_code == 200
    xsrf = next((c.value for c in ta.cookies if c.name == "_xsrf" and c.path.startswith("/services/dashboard")),
                None)
    assert xsrf, [(c.name, c.path) for c in ta.cookies]
    r = ta.post(_dash(hub) + "api/warm", headers={"X-XSRFToken": xsrf}, data={"_xsrf": xsrf}, timeout=30,
                allow_redirects=False)
    assert (r.status_code, r.reason) == (403, TA_REFUSAL), (r.status_code, r.reason)


@pytest.mark.hub
@pytest.mark.slow
def test_a_ta_cannot_act_on_students_through_the_hub(hub, people):
    tom, ann = people["tom"], people["ann"]
    student = hub.user("ann")
    for method, path in (("POST", f"/users/{student}/server"), ("DELETE", f"/users/{student}/server"),
                         ("POST", f"/users/{student}/tokens"), ("PATCH", f"/users/{student}"),
                         ("DELETE", f"/users/{student}"), ("POST", f"/users/{hub.user('new')}")):
        r = tom.api(method, path, json={})
        assert r.status_code in (403, 404), (method, path, r.status_code, r.text[:200])
    r = tom.api("GET", "/users")
    assert r.status_code == 403 or {m["name"] for m in r.json()} == {hub.user("tom")}, (r.status_code, r.text[:200])
    assert tom.get("/hub/admin").status_code in (302, 403)  # no admin page (a redirect to the user's home, or 403)
    assert ann.model()["servers"] == {}  # nothing was started for the student


@pytest.mark.hub
@pytest.mark.slow
def test_a_student_can_neither_read_nor_act_on_the_dashboard(hub, people):
    ann = people["ann"]
    r = ann.session.get(_dash(hub), timeout=60)  # signed in by cookie, as in a browser
    assert r.status_code == 403 and "table id='class'" not in r.text, (r.status_code, r.url)
    for method in ("GET", "POST"):
        r = requests.request(method, _dash(hub) + "api/class", headers={"Authorization": f"token {ann.token}"},
                             timeout=30, allow_redirects=False)
        assert r.status_code == 403 and hub.user("ben") not in r.text, (method, r.status_code)
