"""Notebook 06b shows each rung's key lines first (ddp_lab.lessons.ladder.KEYS): they must be in that rung
and new in it, so the excerpts cannot drift from the files as the scripts change."""
import html

import pytest

from ddp_lab.lessons import ladder


@pytest.mark.parametrize("k", range(2, len(ladder.RUNGS) + 1))
def test_key_lines_are_in_the_rung_and_new_in_it(k):
    assert set(ladder.KEYS) == set(range(2, len(ladder.RUNGS) + 1))
    rung, src = ladder.RUNGS[k - 1], ladder.lines(ladder.RUNGS[k - 1])
    regions = ladder.key_lines(k)
    shown = [row for _, rows in regions for row in rows]
    assert 10 <= len(shown) <= 20, (rung.file, len(shown))   # the lines that carry the idea, no more
    for key, rows in regions:
        assert key.defn in rung.changes, (rung.file, key.defn)  # a function this rung adds or changes
        assert all(src[n - 1] == text for n, text, _ in rows)   # the rung's own lines, as rendered
        assert key.first in rows[0][1] and key.last in rows[-1][1]
        assert rows[0][2], (rung.file, key.first)               # the region starts with a new line
        new = [text for _, text, added in rows if added]
        assert 2 * len(new) >= len([t for _, t, _ in rows if t.strip()]), (rung.file, key)  # mostly new
        # and the new lines are not in the rung before (not moved lines that the diff calls new)
        before = set(ladder.lines(ladder.RUNGS[k - 2]))
        assert any(text not in before for text in new), (rung.file, key)


def test_the_rendered_rung_shows_its_key_lines_then_folds_the_diff():
    page = ladder.steps(4).data
    for _, rows in ladder.key_lines(4):
        assert all(html.escape(text) in page for _, text, _ in rows)
    fold = page.index("<details>")
    assert page.index(html.escape(ladder.KEYS[4][1].why)) < fold  # key lines first, the diff folded after
    assert page.count("<details>") == 1 and "</details>" in page[fold:]


def test_a_key_whose_lines_are_gone_fails(tmp_path):
    # what the test above relies on: a marker no longer in the rung raises instead of showing nothing
    patched = tmp_path / "ddp4_amp_accum.py"
    patched.write_text(ladder.path("ddp4_amp_accum.py").read_text().replace("model.no_sync()", "model.sync()"))
    key = ladder.Key("train", "model.no_sync()", "model.no_sync()", "")
    assert ladder.key_region("ddp4_amp_accum.py", key)  # found in the real rung
    with pytest.raises(StopIteration):
        ladder.key_region(patched, key)
