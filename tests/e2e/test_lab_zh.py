"""`make lab-zh` as a reader of the Chinese edition starts it: plain /lab lands on the Chinese notebook
00, trusted, its stored outputs drawn, every markdown cell in Chinese, and JupyterLab's own menus in
Chinese where the language pack is installed (pip install -e ".[zh]").

The server is the Makefile's `lab-zh` recipe (without reinstalling), with Jupyter's config, data and
runtime folders in a temporary home, as tests/e2e/test_landing.py runs `make lab`.
"""
from __future__ import annotations

import json
import re

import pytest

from .lab_page import PANEL, ROOT
from .test_landing import lab_from_make

NOTEBOOK_00 = "notebooks/zh/00_first_launch.ipynb"
HAN = re.compile(r"[\u4e00-\u9fff]")
MENUS_ZH = {"文件", "编辑", "查看", "运行", "内核", "帮助"}  # File, Edit, View, Run, Kernel, Help


def language_pack() -> bool:
    try:
        import jupyterlab_language_pack_zh_CN  # noqa: F401
        return True
    except ImportError:
        return False


@pytest.fixture
def make_lab_zh(tmp_path):
    """`make lab-zh` on a free port; yields (base URL, token)."""
    if not (ROOT / NOTEBOOK_00).exists():
        pytest.fail(f"{NOTEBOOK_00} is missing: make zh")
    with lab_from_make("lab-zh", "LAB_ZH_WORKSPACES", tmp_path) as served:
        yield served


def test_lab_zh_opens_the_chinese_notebook_00_trusted_translated_and_drawn(make_lab_zh, browser, tmp_path):
    base, token = make_lab_zh
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    js = lambda expr: page.evaluate(f"() => {{ return {expr}; }}")  # noqa: E731
    try:
        page.goto(f"{base}/lab?token={token}")
        page.wait_for_function(f"() => {{ const w = window.jupyterapp && {PANEL};"
                               " return w && w.context && w.context.isReady; }", timeout=120_000)
        assert js(f"{PANEL}.context.path") == NOTEBOOK_00, "/lab did not land on the Chinese notebook 00"
        page.wait_for_function(f"() => {{ const s = {PANEL}.sessionContext.session;"
                               " return s && s.kernel && s.kernel.status === 'idle'; }", timeout=180_000)
        page.screenshot(path=str(tmp_path / "lab_zh.png"))
        kinds = js(f"{PANEL}.content.widgets.map(c => c.model.type)")
        code = [i for i, k in enumerate(kinds) if k == "code"]
        assert "markdown" in kinds and code, kinds
        assert js(f"{PANEL}.content.widgets.filter(c => c.model.type === 'code').every(c => c.model.trusted)"), \
            "the Chinese notebook opened untrusted: make lab-zh trusts notebooks/zh/"
        stored = json.loads((ROOT / NOTEBOOK_00).read_text(encoding="utf-8"))["cells"]
        kinds_of = lambda i: {k for o in stored[i].get("outputs", []) for k in o.get("data", {"text": 0})}  # noqa: E731
        for kind, drawn in (("image/png", "[...n.querySelectorAll('img')].some(img => img.naturalWidth > 0)"),
                            ("text", "n.innerText.includes(WANT)")):
            i = next(i for i in code if kind in kinds_of(i))
            want = json.dumps("".join(stored[i]["outputs"][0].get("text", "")).strip().splitlines()[0] if kind == "text"
                              else "")
            page.evaluate(f"() => {PANEL}.content.scrollToItem({i})")
            page.wait_for_function(f"() => {{ const WANT = {want}; const n = {PANEL}.content.widgets[{i}]"
                                   f".outputArea.node; return {drawn}; }}", timeout=30_000)
        menus = set(js("[...document.querySelectorAll('.lm-MenuBar-itemLabel')].map(n => n.innerText)"))
        english = []
        for i in [i for i, k in enumerate(kinds) if k == "markdown"]:  # drawn: JupyterLab renders cells near the view
            page.evaluate(f"() => {PANEL}.content.scrollToItem({i})")
            page.wait_for_function(f"() => {{ const n = {PANEL}.content.widgets[{i}].node"
                                   ".querySelector('.jp-RenderedMarkdown'); return n && n.innerText.trim(); }",
                                   timeout=30_000)
            text = js(f"{PANEL}.content.widgets[{i}].node.querySelector('.jp-RenderedMarkdown').innerText")
            if not HAN.search(text):
                english.append(f"cell {i}: {text.strip().splitlines()[0][:60]!r}")
        assert not js(f"{PANEL}.context.model.dirty"), "the notebook opened modified"
    finally:
        page.close()
    if language_pack():
        assert MENUS_ZH <= menus, f"JupyterLab's menus are not in Chinese: {sorted(menus)}"
    assert not english, "markdown cells drawn without Chinese (make zh-status, then make zh):\n  " + "\n  ".join(english)
    if not language_pack():
        pytest.skip("JupyterLab's menus stay English: the language pack is not installed (pip install -e '.[zh]')")
