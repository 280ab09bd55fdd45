"""The accuracy runner's choice of GPU: a run goes to the GPU its runner was given, as the host names it."""

import subprocess

import pytest

from coat_compare.protocol import runner


@pytest.mark.parametrize(
    "inherited, device, expected",
    [("1", 0, "1"), ("2,3", 1, "3"), (" 4 , 5 ", 0, "4"), (None, 1, "1"), ("", 0, "0"), ("GPU-32aa", 0, "GPU-32aa")],
)
def test_a_run_goes_to_the_gpu_its_runner_sees_as_that_device(monkeypatch, tmp_path, inherited, device, expected):
    """start() sets the run's CUDA_VISIBLE_DEVICES from the runner's own list: a runner started with
    CUDA_VISIBLE_DEVICES=1 sees one device, 0, and its run must train on the host's GPU 1."""
    if inherited is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", inherited)
    seen = {}

    class Started:
        def __init__(self, command, env, **_):
            seen["env"] = env

    monkeypatch.setattr(subprocess, "Popen", Started)
    job = runner.Job(1, "bf16", "full", "run-bf16", ["--steps", "1"], device, 1)
    runner.start(job, str(tmp_path))
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == expected
    assert (tmp_path / "seed1" / "run-bf16.log").read_text().startswith(runner.sys.executable)
