"""Which checkpoint `trainer.load_ckpt_from=latest` resumes from, and which ones `trainer.keep_last_n` keeps."""

from RL2.utils.checkpoint import latest_checkpoint, resolve_checkpoint, save_checkpoint


def test_latest_is_the_checkpoint_saved_last_not_the_largest_step(tmp_path, one_rank):
    for step in (2, 4):
        save_checkpoint(str(tmp_path), step, {}, {})
    assert latest_checkpoint(str(tmp_path)) == tmp_path / "step4"
    # A run resumed from step 2 saves step 3: step 4 is the abandoned run's, not the latest.
    save_checkpoint(str(tmp_path), 3, {}, {})
    assert resolve_checkpoint("latest", str(tmp_path)) == tmp_path / "step3"
    (tmp_path / "latest.txt").unlink()  # a save_dir from before the pointer: the largest step
    assert latest_checkpoint(str(tmp_path)) == tmp_path / "step4"
    (tmp_path / "latest.txt").write_text("step9")  # names no complete checkpoint: the largest step
    assert latest_checkpoint(str(tmp_path)) == tmp_path / "step4"


def test_a_latest_pointer_out_of_the_save_dir_is_not_followed(tmp_path, one_rank):
    """latest.txt names a folder of this save_dir or nothing: a planted "../elsewhere/step9" (a complete
    checkpoint of another folder, whose last part looks like ours) or an absolute path resumes the run's own
    newest step instead."""
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    save_checkpoint(str(run), 2, {}, {})
    save_checkpoint(str(elsewhere), 9, {}, {})
    for planted in ("../elsewhere/step9", str(elsewhere / "step9"), "step2/../../elsewhere/step9"):
        (run / "latest.txt").write_text(planted)
        assert latest_checkpoint(str(run)) == run / "step2", planted


def step_folders(save_dir) -> list[str]:
    return sorted((p.name for p in save_dir.iterdir() if p.name.startswith(("step", ".step"))),
                  key=lambda name: (len(name), name))


def test_keep_last_n_keeps_the_newest_steps(tmp_path, one_rank):
    for step in range(1, 6):
        save_checkpoint(str(tmp_path), step, {}, {}, keep_last_n=2)
        assert step_folders(tmp_path) == [f"step{s}" for s in range(max(1, step - 1), step + 1)]
    assert resolve_checkpoint("latest", str(tmp_path)) == tmp_path / "step5"


def test_keep_last_n_never_deletes_the_latest_and_counts_it(tmp_path, one_rank):
    for step in (2, 4, 6):
        save_checkpoint(str(tmp_path), step, {}, {})  # keep_last_n unset: all kept
    # Resumed from step 2, the run saves step 3, which latest.txt names: kept although 4 and 6 are larger.
    # Of the others the largest, step 6, fills the second place; 2 and 4 go.
    save_checkpoint(str(tmp_path), 3, {}, {}, keep_last_n=2)
    assert sorted(step_folders(tmp_path)) == ["step3", "step6"]
    save_checkpoint(str(tmp_path), 4, {}, {}, keep_last_n=1)
    assert step_folders(tmp_path) == ["step4"]


def test_a_save_removes_what_a_killed_save_left(tmp_path, one_rank):
    (tmp_path / ".step7.tmp").mkdir()  # a run killed (SIGKILL, power loss) while writing step 7
    (tmp_path / ".step7.tmp" / "__0_0.distcp").write_bytes(b"x" * 1000)
    save_checkpoint(str(tmp_path), 8, {}, {})
    assert step_folders(tmp_path) == ["step8"]


class _RunsCode:
    """What a planted index could hold: unpickling it calls os.system."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_planted_checkpoint_index_is_refused_before_it_runs_anything(tmp_path, one_rank):
    """torch's reader unpickles `.metadata` as it finds it; RL2 reads it with an allow-list of the classes an
    index is made of: a planted one stops the resume with the file named, and what it names never runs."""
    import pickle

    import pytest
    import torch

    from RL2.config.errors import ConfigError
    from RL2.utils.checkpoint import load_checkpoint

    path = save_checkpoint(str(tmp_path / "run"), 1, {}, {})
    assert load_checkpoint(path, {}) is not None  # the index RL2 wrote loads
    index = torch.distributed.checkpoint.FileSystemReader(str(path)).read_metadata()
    marker = tmp_path / "ran"
    for planted in (_RunsCode(marker), [index, _RunsCode(marker)]):
        (path / ".metadata").write_bytes(pickle.dumps(planted))
        with pytest.raises(ConfigError, match=r"\.metadata is not a checkpoint index RL2 wrote "
                                              r"\(it names posix\.system"):
            load_checkpoint(path, {})
        assert not marker.exists()
