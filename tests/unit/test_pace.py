"""``raylastic.testing.pace``: the group after a test's last event steps without sleeping,
the others keep their windows."""

from raylastic.testing.pace import regrown, step_sleep


def test_only_a_regrown_group_after_the_flag_skips_its_sleep(tmp_path):
    flag = tmp_path / "regrown"
    cfg = {"regrown_flag": str(flag)}
    assert step_sleep(cfg, 3, 0.2) == 0.2  # the first group of 3: the kill's window
    flag.touch()
    assert step_sleep(cfg, 2, 0.2) == 0.2  # the group of 2 the node added back joins
    assert step_sleep(cfg, 3, 0.2) == 0.0 and regrown(cfg, 4)
    assert step_sleep(dict(cfg, fast_at_world=4), 3, 0.2) == 0.2
    assert step_sleep({}, 3, 0.2) == 0.2 and step_sleep(cfg, 3, 0.0) == 0.0
