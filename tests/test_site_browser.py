"""The course website in a real headless Chromium: every page of the built site opens, no internal link is broken,
no image is missing, each lab page shows its notebook's plots and no exercise solution, and nothing is loaded
from outside the site.

The site is built by `build_site()` as `make site` builds it (site/_build/html): a lab whose files did not change
since its executed copy was made is not executed again (build/executed/<lab>/). In a test run those copies are the
references the grader ran (`lab_gradings`), so this test only runs Sphinx and the browser. Playwright drives
Debian's /usr/bin/chromium.
"""
from __future__ import annotations

import functools
import http.server
import json
import threading
from pathlib import Path
from urllib.parse import urldefrag, urlparse

import pytest

from scalelab.course import site as sb
from scalelab.course.solutions import solution_blocks

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(3600)]

# Wait for every image (lazy ones too) to load or fail, then report the ones that did not decode.
IMAGES_JS = """async () => {
  const imgs = Array.from(document.images);
  imgs.forEach(img => { img.loading = 'eager'; });
  await Promise.all(imgs.map(img => img.complete ? null :
    new Promise(done => { img.addEventListener('load', done); img.addEventListener('error', done); })));
  return imgs.map(img => ({src: img.currentSrc || img.src, width: img.naturalWidth,
                           output: !!img.closest('div.cell_output')}));
}"""
PAGE_JS = """() => ({
  hrefs: Array.from(document.querySelectorAll('a[href]')).map(a => a.href),
  ids: Array.from(document.querySelectorAll('[id]')).map(e => e.id)
    .concat(Array.from(document.querySelectorAll('a[name]')).map(a => a.name)),
  inputs: Array.from(document.querySelectorAll('div.cell_input')).map(e => e.innerText),
})"""


@pytest.fixture(scope="module")
def site(lab_gradings):
    """The real site, built into site/_build/html from the run's graded references (each lab's reference that graded
    to the end is its executed copy: build/executed/<lab>/; a lab whose did not is executed by the build):
    (report, html folder)."""
    from labtests import LABS
    for lab in LABS:
        lab_gradings.batch(lab)
    report = sb.build_site()
    return report, report.html


def test_the_site_shows_the_references_the_grader_ran(site):
    # one execution per lab per run: the pages are the graded references, not a third run of each lab
    report, _ = site
    assert report.labs and all(lab.reused for lab in report.labs), [(lab.name, lab.reused) for lab in report.labs]
    for lab in report.labs:
        stamp = json.loads((lab.notebook.parent / sb.STAMP).read_text())
        assert "grader" in stamp["executed_by"], stamp


@pytest.fixture(scope="module")
def server(site):
    """site/_build/html over HTTP on 127.0.0.1 (a free port); yields its base URL."""
    handler = functools.partial(_QuietHandler, directory=str(site[1]))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # one line per request would drown pytest's output
        pass


@pytest.fixture(scope="module")
def crawl(site, server):
    """Open every HTML page of the site in Chromium once; what each page showed and requested."""
    from browser import chromium

    html = site[1]
    pages = sorted(p.relative_to(html).as_posix() for p in html.rglob("*.html")
                   if p.relative_to(html).parts[0] != "_static")
    results, outside = {}, []
    with chromium() as browser:
        page = browser.new_page()
        page.set_default_timeout(30_000)
        page.on("request", lambda r: outside.append((page.url, r.url)) if not _local(r.url, server) else None)
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        for rel in pages:
            errors.clear()
            response = page.goto(server + rel, wait_until="load")
            info = page.evaluate(PAGE_JS)
            info.update(status=response.status if response else None, images=page.evaluate(IMAGES_JS),
                        errors=list(errors))
            results[rel] = info
    return {"pages": results, "outside": outside, "server": server}


def _local(url: str, server: str) -> bool:
    return url.startswith(server) or url.startswith(("data:", "blob:", "about:"))


def _status(url: str) -> int:
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_every_page_opens_without_script_errors(crawl, site):
    pages = crawl["pages"]
    expected = {"index.html", "schedule.html", "setup.html", "instructors.html", "admin.html", "labs/index.html"}
    expected |= {f"labs/{lab.name}.html" for lab in site[0].labs}
    assert expected <= set(pages), f"pages missing from the build: {sorted(expected - set(pages))}"
    bad = {rel: (p["status"], p["errors"]) for rel, p in pages.items() if p["status"] != 200 or p["errors"]}
    assert not bad, f"pages that did not open cleanly (status, script errors): {bad}"


def test_no_internal_link_is_broken(crawl):
    server, pages = crawl["server"], crawl["pages"]
    ids = {server + rel: set(p["ids"]) for rel, p in pages.items()}
    broken, checked = [], {}
    for rel, p in pages.items():
        for href in p["hrefs"]:
            if not href.startswith(server):
                continue
            target, fragment = urldefrag(href)
            if target not in checked:
                checked[target] = _status(target)
            if checked[target] != 200:
                broken.append(f"{rel}: {href} -> HTTP {checked[target]}")
            elif fragment and target in ids and fragment not in ids[target]:
                broken.append(f"{rel}: {href} -> no element with id {fragment!r} on {urlparse(target).path}")
    assert checked, "no internal link found at all: the crawl saw nothing"
    assert not broken, "broken internal links:\n" + "\n".join(sorted(set(broken)))


def test_no_image_is_missing(crawl):
    missing = [f"{rel}: {img['src']}" for rel, p in crawl["pages"].items() for img in p["images"]
               if img["width"] == 0]
    assert not missing, "images that did not load:\n" + "\n".join(missing)


def test_each_lab_page_shows_its_notebooks_plots(crawl, site):
    report = site[0]
    assert report.labs, "no lab was built: labs/*/lab.ipynb found none"
    for lab in report.labs:
        nb = json.loads(Path(lab.notebook).read_text(encoding="utf-8"))
        plots = sum(1 for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])
                    if any(k.startswith("image/") for k in o.get("data", {})))
        shown = [img for img in crawl["pages"][f"labs/{lab.name}.html"]["images"] if img["output"] and img["width"]]
        assert plots >= 1, f"lab {lab.name}: its executed notebook has no image output (no plot to show)"
        assert len(shown) == plots, f"lab {lab.name}: {plots} plot(s) in the notebook, {len(shown)} shown on the page"


def test_lab_pages_show_no_exercise_solution(crawl, site):
    for lab in site[0].labs:
        text = "\n".join(crawl["pages"][f"labs/{lab.name}.html"]["inputs"])
        shown = "\n".join(line.strip() for line in text.splitlines())
        for block in _solution_blocks(Path(lab.notebook)):
            assert block not in shown, f"lab {lab.name}: a solution is visible on its page:\n{block}"
        assert sb.HIDDEN in shown or not _solution_blocks(Path(lab.notebook))


def test_nothing_is_loaded_from_outside_the_site(crawl):
    assert not crawl["outside"], f"requests that left the site (page, url): {crawl['outside'][:10]}"


def _solution_blocks(notebook: Path) -> list[str]:
    """The code between each BEGIN/END SOLUTION pair of an executed notebook, each line stripped."""
    blocks = []
    for cell in json.loads(notebook.read_text(encoding="utf-8"))["cells"]:
        if cell["cell_type"] == "code":
            for block in solution_blocks("".join(cell["source"])):
                text = "\n".join(line.strip() for line in block.splitlines()).strip()
                if text:
                    blocks.append(text)
    return blocks
