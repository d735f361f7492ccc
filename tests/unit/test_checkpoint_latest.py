"""Which checkpoint `trainer.load_ckpt_from=latest` resumes from."""

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
