"""The GPU scripts parse (``bash -n``), and every part a script's header names has its branch in
the script's ``case`` and the other way round: a device command names a part, and a dropped branch
would only show on the GPU, as "unknown part", after the machine's set-up time was spent."""

import re
import subprocess
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).parent.parent / "scripts").glob("gpu_*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_documented_part_has_a_branch_and_every_branch_is_documented():
    script = Path(__file__).parent.parent / "scripts" / "gpu_default.sh"
    text = script.read_text()
    documented = set(re.findall(r"^#\s+(?:\S+=\S+ )*bash scripts/gpu_default\.sh ([a-z0-9-]+)", text, re.M))
    branches = set(re.findall(r"^  ([a-z0-9-]+)\)$", text, re.M))
    assert documented == branches, documented ^ branches
    unknown = re.search(r'unknown part \$part: ([^"]+)"', text).group(1)
    listed = set(re.findall(r"[a-z0-9-]+", unknown.replace(" or ", ", "))) - {"or"}
    assert listed == branches, listed ^ branches


def test_parts_run_at_once_one_per_gpu_each_with_its_own_environment(tmp_path):
    """scripts/gpu_parts.sh with a stand-in nvidia-smi (three GPUs) and a stand-in part script that
    records what each part saw: its GPU, its results folder, its NAME=VALUE words, and that the
    project was installed once for all (no second pip install racing the first); " + " runs two
    parts one after another on one GPU."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text('#!/bin/sh\necho "GPU 0: a"\necho "GPU 1: b"\necho "GPU 2: c"\n')
    (bin_dir / "python3").write_text('#!/bin/sh\necho pip-install >> "$INSTALLS"\n')  # the install
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    part = tmp_path / "part.sh"
    part.write_text(
        'echo "args=$* gpu=$CUDA_VISIBLE_DEVICES out=$OUT tests=${GPU_TESTS:-} installed=$COAT_GPU_INSTALLED"\n'
        'mkdir -p "$OUT/$1" && echo row > "$OUT/$1/a.jsonl" && echo log > "$OUT/$1/a.log"\n'
        '[ "$1" = spike7b ] || tar czf "$OUT/$1.tgz" -C "$OUT/$1" .\n'  # spike7b: a part that died unpacked
    )
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "SCRIPT": str(part),
        "OUT": str(tmp_path / "out"),
        "INSTALLS": str(tmp_path / "installs"),
    }
    script = Path(__file__).parent.parent / "scripts" / "gpu_parts.sh"
    proc = subprocess.run(
        ["bash", str(script), "GPU_TESTS=1 acc1b coat 7", "spike7b", "batches + GPU_TESTS=2 gc"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    seen = [(tmp_path / "out" / f"gpu{i}.txt").read_text().strip() for i in (0, 1, 2)]
    assert seen[0] == f"args=acc1b coat 7 gpu=0 out={tmp_path}/out/gpu0 tests=1 installed=1"
    assert seen[1] == f"args=spike7b gpu=1 out={tmp_path}/out/gpu1 tests= installed=1"
    assert seen[2].splitlines() == [
        f"args=batches gpu=2 out={tmp_path}/out/gpu2 tests= installed=1",
        f"args=gc gpu=2 out={tmp_path}/out/gpu2 tests=2 installed=1",
    ]
    assert (tmp_path / "installs").read_text() == "pip-install\n"
    # each part's results come back as one archive (the device returns a limited number of files)
    left = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert left == [
        "gpu0.txt",
        "gpu0/acc1b.tgz",
        "gpu1.txt",
        "gpu1/spike7b.tgz",
        "gpu2.txt",
        "gpu2/batches.tgz",
        "gpu2/gc.tgz",
    ], left
    listing = subprocess.run(
        ["tar", "tzf", str(tmp_path / "out" / "gpu1" / "spike7b.tgz")], capture_output=True, text=True
    )
    assert {"./a.jsonl", "./a.log"} <= set(listing.stdout.split())
    assert "=== GPU 0: GPU_TESTS=1 acc1b coat 7" in proc.stdout and "=== GPU 2: batches + GPU_TESTS=2 gc" in proc.stdout
    # a part past LIMIT is stopped, and what it wrote is packed all the same
    (tmp_path / "out").rename(tmp_path / "first")
    (tmp_path / "slow.sh").write_text('mkdir -p "$OUT/$1" && echo row > "$OUT/$1/a.jsonl"\nexec sleep 30\n')
    proc = subprocess.run(
        ["bash", str(script), "slow", "quick"],
        capture_output=True,
        text=True,
        env={**env, "SCRIPT": str(tmp_path / "slow.sh"), "LIMIT": "2"},
        timeout=20,
    )
    assert proc.returncode == 0, proc.stderr
    assert "stopped after 2 s (LIMIT): what it wrote is packed" in (tmp_path / "out" / "gpu0.txt").read_text()
    assert (tmp_path / "out" / "gpu0" / "slow.tgz").exists() and not (tmp_path / "out" / "gpu0" / "slow").exists()
    (bin_dir / "nvidia-smi").write_text('#!/bin/sh\necho "GPU 0: a"\necho "GPU 1: b"\n')
    proc = subprocess.run(["bash", str(script), "quick", "gc", "pretrain"], capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "got 3 parts but this machine has 2 GPUs: give at most 2" in proc.stderr
    proc = subprocess.run(["bash", str(script), "quick"], capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "two or more" in proc.stderr
