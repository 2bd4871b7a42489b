"""Binding defaults: 127.0.0.1 without a token; anything else needs one, and then every request
(websockets included) must carry it.

The security middleware's checks run on the app in-process (``api_factory``); a real server
process is kept where the process is the point: ``serve`` refusing to start, and uvicorn's
logs (one server for the module, at ``--log-level debug``: its access log, and the websockets
library's handshake headers; each test reads the lines written since it began)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import httpx
import pytest
from backend_helpers import REPO, Server, assert_error_body, free_port, wait_for
from inprocess import ws_url
from starlette.websockets import WebSocketDisconnect
from websockets.sync.client import connect

TOKEN = "s3cret-token-for-tests"


def test_other_address_without_token_refuses_to_start(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "workbench.cli",
            "serve",
            "--host",
            "127.0.0.2",
            "--port",
            str(free_port()),
            "--data-dir",
            str(tmp_path),
            "--no-browser",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "token" in proc.stderr and "127.0.0.2" in proc.stderr
    assert not (tmp_path / "workbench.db").exists()


class LoggedServer:
    """The module's real server (bound to 127.0.0.2 with a token, ``--log-level debug``) as one
    test sees it: ``log()``, what the server logged since the test began."""

    def __init__(self, srv: Server) -> None:
        self.srv, self.url, self.host, self.port = srv, srv.url, srv.host, srv.port
        self.start = srv.log.stat().st_size

    def log(self) -> str:
        """The lines since the test began, once a request sent now is logged: uvicorn logs on
        one event loop, so what the test's requests made it log comes before that request's
        access line (the server ran to its end before the test read the log when each test
        had a server of its own)."""
        barrier = f"barrier-{uuid.uuid4().hex}"
        httpx.get(f"{self.url}/api/runs?{barrier}=1")  # 401, logged

        def written() -> str | None:
            with open(self.srv.log, "rb") as f:
                f.seek(self.start)
                text = f.read().decode("utf-8", "replace")
            return text if barrier in text else None

        return wait_for(written, 30, 0.05, "the server's log line of a request")


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory):
    srv = Server(
        tmp_path_factory.mktemp("guarded") / "data",
        host="127.0.0.2",
        env={"STAGEHAND_WORKBENCH_TOKEN": TOKEN},
        args=("--log-level", "debug"),
    ).start()
    yield srv
    srv.stop()
    assert TOKEN not in srv.log.read_text()  # nor in what the server logged on its way out


@pytest.fixture
def guarded(guarded_server) -> LoggedServer:
    """The module's real server bound to 127.0.0.2 with a token, its access log on."""
    return LoggedServer(guarded_server)


@pytest.fixture
def guarded_api(api_factory, tmp_path):
    """The app in-process as served on 127.0.0.2 with a token."""
    return api_factory(data_dir=tmp_path / "guarded", host="127.0.0.2", token=TOKEN)


def test_token_required_everywhere(guarded_api):
    client = guarded_api
    assert client.base_url.host == "127.0.0.2"
    for path in ("/api/runs", "/api/presets", "/api/system", "/", "/docs", "/openapi.json"):
        err = assert_error_body(client.get(path), 401)
        assert err["code"] == "unauthorized"
    assert_error_body(client.get("/api/runs", headers={"Authorization": "Bearer nope"}), 401)
    assert_error_body(client.post("/api/runs", json={"preset": "tiny-ci"}), 401)
    ok = client.get("/api/runs", headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200 and ok.json() == {"data": [], "count": 0}
    assert (
        client.get("/api/runs", headers={"Cookie": f"workbench_token={TOKEN}"}).status_code == 200
    )

    # /?token= sets the cookie once, so the dashboard works from a link.
    resp = client.get("/", params={"token": TOKEN}, follow_redirects=False)
    assert resp.status_code == 303 and "workbench_token" in resp.headers["set-cookie"]
    assert "HttpOnly" in resp.headers["set-cookie"] and resp.headers["location"] == "/"
    client.cookies.clear()  # the client kept it; the websocket below must go without

    with client.websocket_connect(ws_url(client, "/api/runs/1/stream")) as ws:
        frame = ws.receive_json()
        assert frame["error"]["code"] == "unauthorized"
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_text()
        assert closed.value.code == 4401
    with client.websocket_connect(
        ws_url(client, "/api/runs/1/stream"), headers={"Authorization": f"Bearer {TOKEN}"}
    ) as ws:
        frame = ws.receive_json()
        assert frame["error"]["code"] == "not_found"  # past the token check


def test_loopback_default_needs_no_token_and_serves_the_dashboard(api):
    assert api.base_url.host == "127.0.0.1" and api.app.state.settings.token is None
    assert api.get("/api/runs").status_code == 200
    page = api.get("/")
    assert page.status_code == 200
    assert "<html" in page.text.lower() or "<!doctype" in page.text.lower()
    js = api.get("/static/vendor/plotly.min.js")
    assert js.status_code == 200 and len(js.content) > 1_000_000
    assert "javascript" in js.headers["content-type"]
    # Served compressed to a client that accepts gzip (httpx does; it decodes for us).
    assert js.headers["content-encoding"] == "gzip"
    assert js.num_bytes_downloaded < len(js.content) / 2
    plain = api.get("/static/vendor/plotly.min.js", headers={"accept-encoding": ""})
    assert "content-encoding" not in plain.headers and plain.content == js.content


def test_settings_rule():
    from workbench.services.settings import Settings, needs_token

    assert not needs_token("127.0.0.1") and not needs_token("localhost") and not needs_token("::1")
    assert needs_token("0.0.0.0") and needs_token("127.0.0.2") and needs_token("192.168.1.5")
    with pytest.raises(ValueError, match="token"):
        Settings(host="0.0.0.0", token=None, data_dir="/tmp/x").check_bind()
    Settings(host="0.0.0.0", token="t", data_dir="/tmp/x").check_bind()


def test_browser_borne_requests_from_other_sites_are_refused(api):
    url = str(api.base_url).rstrip("/")
    # DNS rebinding: a page on evil.example resolved to 127.0.0.1 sends its own Host.
    err = assert_error_body(api.get("/api/runs", headers={"Host": "evil.example"}), 403)
    assert err["code"] == "forbidden"
    foreign = {"Origin": "http://evil.example"}
    assert_error_body(api.post("/api/presets", json={}, headers=foreign), 403)
    same = {"Origin": url}
    resp = api.post("/api/presets/tiny-ci/duplicate", json={"name": "x1"}, headers=same)
    assert resp.status_code == 201
    assert api.get("/api/runs", headers=foreign).status_code == 200  # reads are fine
    with api.websocket_connect(ws_url(api, "/api/runs/1/stream"), headers=foreign) as ws:
        assert ws.receive_json()["error"]["code"] == "forbidden"
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_text()
        assert closed.value.code == 4403


def test_token_in_a_link_stays_out_of_every_log(guarded):
    assert httpx.get(guarded.url + "/", params={"token": TOKEN}).status_code == 303
    httpx.get(guarded.url + "/api/runs", params={"x": "1", "token": TOKEN})  # 401, also logged
    # A percent-encoded name is the same parameter to the server: accepted, and redacted.
    encoded = httpx.get(f"{guarded.url}/?%74oken={TOKEN}")
    assert encoded.status_code == 303 and "workbench_token" in encoded.headers["set-cookie"]
    # A websocket with the token in its query (refused: only the header or cookie count) is
    # logged by uvicorn's error log, not the access log.
    ws = f"ws://{guarded.host}:{guarded.port}/api/runs/1/stream?since=-1&token={TOKEN}"
    with connect(ws) as conn:
        assert json.loads(conn.recv(timeout=10))["error"]["code"] == "unauthorized"
    log = guarded.log()
    assert '"GET /?token=[redacted] HTTP/1.1" 303' in log  # the access log is on, and redacted
    assert "/api/runs?x=1&token=[redacted]" in log
    assert '"WebSocket /api/runs/1/stream?since=-1&token=[redacted]"' in log
    assert '"GET /?%74oken=[redacted] HTTP/1.1" 303' in log
    assert TOKEN not in log


def test_writes_from_opaque_or_cross_site_origins_need_the_bearer_token(api, guarded_api):
    url = str(api.base_url).rstrip("/")
    for headers in (
        {"Origin": "null"},  # a sandboxed iframe on any page
        {"Origin": "null", "Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "cross-site"},  # no Origin, but the browser says cross-site
        {"Origin": "http://127.0.0.1:1"},  # another port of the same host is another origin
    ):
        resp = api.post("/api/presets/tiny-ci/duplicate", json={"name": "x"}, headers=headers)
        err = assert_error_body(resp, 403)
        assert err["code"] == "forbidden", headers
        assert_error_body(api.delete("/api/runs/1", headers=headers), 403)
    assert (
        "opaque origin"
        in assert_error_body(api.post("/api/runs/1/cancel", headers={"Origin": "null"}), 403)[
            "message"
        ]
    )
    # Same-origin pages and clients without an Origin keep working; reads are not refused.
    same = {"Origin": url, "Sec-Fetch-Site": "same-origin"}
    assert (
        api.post("/api/presets/tiny-ci/duplicate", json={"name": "a"}, headers=same).status_code
        == 201
    )
    assert api.post("/api/presets/tiny-ci/duplicate", json={"name": "b"}).status_code == 201
    assert api.get("/api/presets", headers={"Origin": "null"}).status_code == 200

    # With a token: the cookie (ambient, sent by the browser) does not let an opaque origin
    # write; the Authorization header (which a page cannot add cross-site) does.
    g = guarded_api
    null = {"Origin": "null", "Sec-Fetch-Site": "cross-site"}
    cookie = {"Cookie": f"workbench_token={TOKEN}"}
    body = {"name": "c"}
    resp = g.post("/api/presets/tiny-ci/duplicate", json=body, headers={**null, **cookie})
    assert_error_body(resp, 403)
    bearer = {**null, "Authorization": f"Bearer {TOKEN}"}
    resp = g.post("/api/presets/tiny-ci/duplicate", json=body, headers=bearer)
    assert resp.status_code == 201
    wrong = {**null, "Authorization": "Bearer nope"}
    resp = g.post("/api/presets/tiny-ci/duplicate", json={"name": "d"}, headers=wrong)
    assert_error_body(resp, 403)


REFUSED_FORMS = (
    "/?token[]={}",
    "/?token%5B%5D={}",
    "/api/runs?x=1;token={}",
    "/?token%00={}",
    "/?%2574oken={}",
    "/?TOKEN%20={}",
    "/?x_token={}",
    "/?a=1&&token={}",
)
"""Query spellings of the token the server does not take (only ``?token=`` on ``/``): still a
secret in the log line uvicorn writes for them."""


def test_every_form_of_the_token_is_redacted_from_a_log_record():
    import logging

    from workbench.services.redaction import RedactToken

    def shown(msg, args, token=TOKEN):
        record = logging.LogRecord("uvicorn.error", logging.DEBUG, __file__, 1, msg, args, None)
        RedactToken(token).filter(record)
        return record.getMessage(), record.args

    # The websockets library at debug: one record per handshake header.
    assert shown("< %s: %s", ("authorization", f"Bearer {TOKEN}"))[0] == (
        "< authorization: [redacted]"
    )
    assert shown("< %s: %s", ("Cookie", f"a=1; workbench_token={TOKEN}"), None)[0] == (
        "< Cookie: [redacted]"
    )
    assert shown("< %s: %s", ("host", "127.0.0.2:8000"))[0] == "< host: 127.0.0.2:8000"
    # An ASGI message's headers, and a header dump in one text.
    msg, _ = shown("%s", ({"headers": [(b"cookie", b"workbench_token=T1x"), (b"a", b"b")]},))
    assert "T1x" not in msg and "(b'a', b'b')" in msg
    assert shown(f"set-cookie: workbench_token={TOKEN}; HttpOnly", ())[0] == (
        "set-cookie: [redacted]"
    )
    # uvicorn's access log: the arguments keep their places and types (its formatter unpacks
    # them), each refused query form redacted, with or without the server's token known.
    for form in REFUSED_FORMS:
        path = form.format("typo-4242")
        for token in (TOKEN, None):
            line = ("1.2.3.4:5", "GET", path, "1.1", 401)
            msg, args = shown('%s - "%s %s HTTP/%s" %d', line, token)
            assert "typo-4242" not in msg and "[redacted]" in msg, (form, msg)
            assert args[0] == "1.2.3.4:5" and args[4] == 401
    assert shown("GET /?x=1&y=2", ())[0] == "GET /?x=1&y=2"  # nothing else is touched
    # The server's own token, wherever it stands.
    assert shown("got %r", (f"weird:{TOKEN}",))[0] == "got 'weird:[redacted]'"


def test_token_stays_out_of_the_debug_log(guarded):
    """At ``--log-level debug`` the websockets library logged the handshake's headers
    (``< authorization: Bearer T``, ``< cookie: workbench_token=T``)."""
    srv = guarded
    stream = f"ws://{srv.host}:{srv.port}/api/runs/1/stream?since=-1"
    for headers in ({"Authorization": f"Bearer {TOKEN}"}, {"Cookie": f"workbench_token={TOKEN}"}):
        with connect(stream, additional_headers=headers, open_timeout=10) as conn:
            assert json.loads(conn.recv(timeout=10))["error"]["code"] == "not_found"
    for form in REFUSED_FORMS:
        for token in (TOKEN, "typo-4242"):
            httpx.get(srv.url + form.format(token))
    log = srv.log()
    assert TOKEN not in log and "typo-4242" not in log
    assert "< authorization: [redacted]" in log.lower()  # the headers were logged, redacted
    assert "< cookie: [redacted]" in log.lower()
    assert "x_token=[redacted]" in log  # and the access log is on
