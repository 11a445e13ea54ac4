"""CPU thread choice: the user's setting wins; otherwise the affinity mask, the cgroup quota and the
cores other processes leave idle bound the count."""

import pytest

from quantkit import threads


def test_user_setting_wins():
    choice = threads.choose_threads({"OMP_NUM_THREADS": "3"}, measure_idle=lambda s: 0.2)
    assert choice == threads.ThreadChoice(3, "OMP_NUM_THREADS=3", "torch")
    both = threads.choose_threads({"OMP_NUM_THREADS": "8", "QUANTKIT_THREADS": "1"})
    assert both.threads == 1 and both.source == "quantkit"
    with pytest.raises(threads.QuantkitError, match="QUANTKIT_THREADS must be a positive integer, got 'two'"):
        threads.choose_threads({"QUANTKIT_THREADS": "two"})


def test_busy_cores_lower_the_count(monkeypatch):
    monkeypatch.setattr(threads, "affinity_cores", lambda: 2)
    monkeypatch.setattr(threads, "cgroup_quota_cores", lambda: None)
    busy = threads.choose_threads({}, measure_idle=lambda s: 1.1)
    assert busy.threads == 1 and "1.1 of 2 cores idle" in busy.reason
    assert threads.choose_threads({}, measure_idle=lambda s: 1.9).threads == 2
    assert threads.choose_threads({}, measure_idle=lambda s: None).threads == 2
    assert threads.choose_threads({}, measure_idle=lambda s: 0.1).threads == 1


def test_cgroup_quota(tmp_path, monkeypatch):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert threads.cgroup_quota_cores(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads.cgroup_quota_cores(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert threads.cgroup_quota_cores(tmp_path) == 1.0
    monkeypatch.setattr(threads, "affinity_cores", lambda: 8)
    monkeypatch.setattr(threads, "cgroup_quota_cores", lambda: 1.5)
    assert threads.choose_threads({}, measure_idle=lambda s: None) == threads.ThreadChoice(
        2, "cgroup quota of 1.5 cores")


def test_idle_cores_from_proc_stat(monkeypatch):
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    # user nice system idle iowait irq softirq steal; cpu1 busy for the whole sample, cpu0 idle
    samples = iter(["cpu 0 0 0 0 0 0 0 0\ncpu0 100 0 0 100 0 0 0 0\ncpu1 100 0 0 100 0 0 0 0\ncpu2 9 9 9 9 9 9 9 9\n",
                    "cpu 0 0 0 0 0 0 0 0\ncpu0 100 0 0 200 0 0 0 0\ncpu1 200 0 0 100 0 0 0 0\ncpu2 9 9 9 9 9 9 9 9\n"])
    idle = threads.idle_cores(0, read_stat=lambda: next(samples), sleep=lambda s: None)
    assert idle == pytest.approx(1.0)


def test_configure_only_lowers_an_existing_pool(monkeypatch):
    import torch

    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        monkeypatch.setattr(threads, "choose_threads",
                            lambda environ=None: threads.ThreadChoice(2, "2 cores available"))
        assert threads.configure_torch_threads({}).threads == 1 and torch.get_num_threads() == 1
        torch.set_num_threads(2)
        monkeypatch.setattr(threads, "choose_threads", lambda environ=None: threads.ThreadChoice(1, "1.0 of 2 idle"))
        assert threads.configure_torch_threads({}).threads == 1 and torch.get_num_threads() == 1
        monkeypatch.setattr(threads, "choose_threads",
                            lambda environ=None: threads.ThreadChoice(2, "QUANTKIT_THREADS=2", "quantkit"))
        threads.configure_torch_threads({})
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(saved)
