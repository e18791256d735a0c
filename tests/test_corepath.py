"""ddp_lab.engine.corepath: a lesson's core path, its deep dives and its exercises, from its headings."""
from nbformat.v4 import new_code_cell as code, new_markdown_cell as md

from ddp_lab.engine import corepath

LESSON = [
    md("# 07 · A lesson\n\nIntro words here."),                    # core
    code("x = 1"),                                                 # core
    md("## 1. A section\n\none two three"),                        # core
    md("## Deep dive: the internals\n\nfour five"),                # deep
    code("y = 2"),                                                 # deep
    md("### More of the same dive\n\nsix"),                        # deep: a level-3 heading stays inside
    md("### On a GPU cluster\n\n- seven (expected)"),              # core: the closing block ends the dive
    md("## Summary\n\n- eight\n\n## Exercises\n\n1. nine"),        # core, and the exercises open below it
    md("**Exercise 2.** ten"),                                     # exercises
    code("z = 3"),                                                 # exercises
]


def test_parts_follow_the_headings():
    assert corepath.parts(LESSON) == ["core", "core", "core", "deep", "deep", "deep", "core", "core",
                                      "exercises", "exercises"]
    assert corepath.deep_dives(LESSON) == ["the internals"]


def test_words_count_markdown_of_one_part():
    deep = len("## Deep dive: the internals four five ### More of the same dive six".split())
    assert corepath.words(LESSON, "deep") == deep == 14
    assert corepath.words(LESSON, "exercises") == 3              # "**Exercise 2.** ten"
    # the rest is core, the Summary cell whole (its Exercises heading opens the part *below* it)
    assert corepath.words(LESSON) == sum(len(c["source"].split()) for c in LESSON if c["cell_type"] == "markdown") - 14 - 3


def test_seconds_come_from_the_stored_execution_times():
    timed = [dict(c) for c in LESSON]
    for c, (start, end) in zip([c for c in timed if c["cell_type"] == "code"],
                               [("00:00:01", "00:00:03.5"), ("00:00:04", "00:00:10"), ("00:00:10", "00:00:11")]):
        c["metadata"] = {"execution": {"iopub.execute_input": f"2026-12-05T{start}Z",
                                       "shell.execute_reply": f"2026-12-05T{end}Z"}}
    assert corepath.seconds(timed) == 2.5 and corepath.seconds(timed, "deep") == 6.0
    assert corepath.seconds(LESSON) is None                      # never executed: no time, not zero
