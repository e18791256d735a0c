"""Notebook 09b, section 7: the TensorFlow/Horovod table covers the names the survey article uses."""
import glob
import os
import re

import pytest

from ddp_lab.lessons.beyond import tf as beyond_tf


def test_every_name_the_survey_uses_has_a_row():
    names = beyond_tf.survey_names()
    for api in ("tf.config.set_visible_devices", "tf.distribute.Strategy", "tf.keras.utils.image_dataset_from_directory",
                "prefetch", "tf.data.AUTOTUNE", "tf.GradientTape", "apply_gradients", "model.save",
                "hvd.DistributedOptimizer", "horovodrun"):
        assert api in names, api
    assert beyond_tf.uncovered() == []


def test_a_missing_row_is_reported(monkeypatch):
    smaller = dict(beyond_tf.MAPPING)
    del smaller["tf.GradientTape"]
    monkeypatch.setattr(beyond_tf, "MAPPING", smaller)
    assert beyond_tf.uncovered() == ["tf.GradientTape"]


def test_rows_name_real_torch_objects():
    assert beyond_tf.unresolved() == []
    assert beyond_tf.markdown().count("\n") == len(beyond_tf.MAPPING) + 1


def test_lines_are_the_articles_own():
    """SURVEY_LINES is the grep of the survey article. Point DDP_LAB_ARTICLES at the folder that
    holds it (004_*.txt) to check them against the text itself."""
    folder = os.environ.get("DDP_LAB_ARTICLES")
    found = glob.glob(os.path.join(folder, "004_*.txt")) if folder else []
    if not found:
        pytest.skip("set DDP_LAB_ARTICLES to the folder holding the survey article (004_*.txt)")
    lines = []
    for line in open(found[0], encoding="utf-8").read().splitlines():
        if re.search(beyond_tf.PATTERN, line) and line.strip() not in lines:
            lines.append(line.strip())
    assert tuple(lines) == beyond_tf.SURVEY_LINES
