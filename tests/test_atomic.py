"""Atomic writes (lit_ppo.atomic): a failure while writing leaves the previous file or no file, never a partial one."""

from __future__ import annotations

import pytest

from lit_ppo.atomic import atomic_path, write_text_atomic


def test_a_failed_write_keeps_the_previous_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "summary.json"
    write_text_atomic(path, "old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash mid-write")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    write_text_atomic(path, "new")
    assert path.read_text() == "new"


def test_a_directory_appears_whole_and_a_stale_temporary_is_replaced(tmp_path):
    target = tmp_path / "cache" / "warm-123"
    stale = target.with_name(target.name + ".tmp")
    stale.mkdir(parents=True)
    (stale / "half_written.bin").write_text("x")  # a crash of an earlier run
    with atomic_path(target) as tmp:
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
        assert not target.exists()  # nothing under the final name until the block ends
    assert sorted(p.name for p in target.iterdir()) == ["config.json"] and not stale.exists()


def test_a_directory_that_appeared_meanwhile_wins(tmp_path):
    target = tmp_path / "warm"
    with atomic_path(target) as tmp:
        tmp.mkdir()
        (tmp / "ours").write_text("1")
        target.mkdir()  # another process finished the same cache first
        (target / "theirs").write_text("1")
    assert sorted(p.name for p in target.iterdir()) == ["theirs"] and not tmp.exists()
