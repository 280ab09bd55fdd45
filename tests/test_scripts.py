"""The GPU scripts parse (``bash -n``), and scripts/gpu_evidence.sh keeps its promises: every part its
--help lists has its branch and the other way round, every file a part runs exists, every evidence
folder a part names exists and every GPU evidence folder has a part, every part that the evidence
and docs/results.md name exists, and --each-gpu runs parts at once, one per GPU, each with its
arguments. A broken part would otherwise only show on the GPU, after the machine's set-up time."""

import re
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "scripts" / "gpu_evidence.sh"
RESULTS = ROOT / "benchmarks" / "results"
HEADER_PART = re.compile(r"^  ([a-z0-9-]+)((?: [A-Z\[][^ ]*)*)  +(\S.*)$")  # part, its arguments, what it measures


def listed_parts() -> dict[str, str]:
    """Part -> its description, from the runner's --help."""
    proc = subprocess.run(["bash", str(RUNNER), "--help"], capture_output=True, text=True, check=True)
    body = proc.stdout.split("Parts, and the folder", 1)[1].split("\n\n", 1)[0]
    parts = {}
    for line in body.splitlines()[1:]:
        match = HEADER_PART.match(line)
        assert match, f"not a part line: {line!r}"
        parts[match[1]] = match[3]
    return parts


@pytest.mark.parametrize("script", sorted((ROOT / "scripts").glob("*.sh")), ids=lambda p: p.name)
def test_the_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_listed_part_has_a_branch_and_every_branch_is_listed():
    branches = set(re.findall(r"^  ([a-z0-9-]+)\)$", RUNNER.read_text(), re.M))
    listed = set(listed_parts())
    assert len(listed) >= 30 and listed == branches, listed ^ branches
    history = [p for p in listed if re.search(r"\b(issue\d*|before|now|latest)\b|\d{4}-\d\d", p)]
    assert not history, f"parts named after their history, not what they measure: {history}"


def test_every_file_a_part_runs_exists():
    text = RUNNER.read_text()
    named = set(re.findall(r"\b((?:benchmarks|tests|examples|scripts)/[\w./-]+\.(?:py|sh|jsonl))", text))
    named |= {f"scripts/{name}" for name in re.findall(r'\$\(dirname "\$0"\)/(\w+\.sh)', text)}
    assert {"scripts/gpu_lib.sh", "scripts/gpu_pretrain.sh"} <= named
    missing = sorted(n for n in named if not (ROOT / n).exists())
    assert not missing, missing


def test_the_parts_and_the_evidence_folders_name_each_other():
    folders = set()
    for part, description in listed_parts().items():
        assert "->" in description or part == "gpu-tests", f"{part} names no evidence folder"
        folders |= {f.strip() for f in description.split("->", 1)[-1].split(",")} if "->" in description else set()
    missing = sorted(f for f in folders if not (RESULTS / f).is_dir() and f not in retired_to_rerun())
    assert not missing, f"parts name evidence folders that do not exist: {missing}"
    gpu_folders = {p.name for p in RESULTS.iterdir() if p.is_dir() and re.search(r"-\d+gpu$", p.name)}
    retired = {f for f in gpu_folders if retired_note(RESULTS / f / "commands.txt")}
    assert gpu_folders - retired <= folders, (
        f"GPU evidence no part measures again: {sorted(gpu_folders - retired - folders)} (a retired study's "
        "commands.txt says so in a line 'Retired: ... git show COMMIT:FILE')"
    )


def retired_to_rerun() -> set[str]:
    """The folders whose figures were retired without rows and that a part makes again when it is rerun:
    docs/results.md's "Retired claims" names each as "-> FOLDER"."""
    text = (ROOT / "docs" / "results.md").read_text()
    section = text[text.index("## Retired claims") :]
    section = section[: section.index("\n## ", 1)]
    return set(re.findall(r"-> ([a-z0-9-]+)", section))


def retired_note(commands: Path) -> list[str]:
    """The parts a folder's commands.txt says were retired ('Retired: ... its part `NAME` ...'), or
    ['(script)'] for a retired script without a part; [] where nothing was retired."""
    notes = re.findall(r"^Retired: (.*)$", commands.read_text(), re.M)
    for note in notes:
        assert re.search(r"git show [0-9a-f]{7,40}:\S+", note), (
            f"{commands}: a retirement names no git show COMMIT:FILE"
        )
    return [part for note in notes for part in (re.findall(r"part `([a-z0-9-]+)`", note) or ["(script)"])]


def test_every_part_the_evidence_and_the_index_name_exists():
    parts = set(listed_parts())
    named = {}
    for commands in RESULTS.glob("*/commands.txt"):
        retired = retired_note(commands)
        for part in re.findall(
            r"gpu_evidence\.sh (?:--each-gpu \"?(?:[A-Z_][A-Z0-9_]*=\S+\s+)*)?([a-z0-9-]+)", commands.read_text()
        ):
            if part not in retired:
                named.setdefault(part, commands.parent.name)
    index = (ROOT / "docs" / "results.md").read_text()
    for row in re.findall(r"^\|.*\|$", index, re.M):
        cells = [c.strip() for c in row.strip("|").split("|")]
        if len(cells) == 7 and cells[5].startswith("`"):  # the "run again" column
            for part in re.findall(r"`([a-z0-9-]+)[^`]*`", cells[5]):
                named.setdefault(part, "docs/results.md")
    unknown = {p: where for p, where in named.items() if p not in parts}
    assert len(named) >= 25 and not unknown, unknown


@pytest.fixture
def stand_ins(tmp_path):
    """nvidia-smi (three GPUs), python3 and coat-compare stand-ins that record each call with its GPU."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text('#!/bin/sh\necho "GPU 0: a"\necho "GPU 1: b"\necho "GPU 2: c"\n')
    record = 'echo "gpu=$CUDA_VISIBLE_DEVICES $(basename "$0") $*" >> "$CALLS"\n'
    (bin_dir / "python3").write_text("#!/bin/sh\n" + record)
    (bin_dir / "coat-compare").write_text("#!/bin/sh\n" + record + '[ -z "${STAND_IN_SLEEP:-}" ] || exec sleep 30\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(tmp_path / "out"), "CALLS": str(tmp_path / "calls")}
    return tmp_path, env


def test_each_gpu_runs_the_parts_at_once_one_per_gpu_with_their_arguments(stand_ins):
    tmp_path, env = stand_ins
    proc = subprocess.run(
        ["bash", str(RUNNER), "--each-gpu", "default-vs-cached-gpt-1b", "kernel-launches + layer-llama2-7b",
         "dp4-llama2-7b 4 64 bf16,coat overlap"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls.count("gpu= python3 -m pip install -q --no-deps --no-build-isolation -e .") == 1  # once for all
    out = tmp_path / "out"
    by_gpu = {gpu: [c.split(" ", 1)[1] for c in calls if c.startswith(f"gpu={gpu} ")] for gpu in "012"}
    assert by_gpu["0"] == [
        f"coat-compare --preset gpt-1b --micro-batch 4 --steps 40 --modes bf16,coat,coat-codes,coat-cached "
        f"--cuda-graphs none,local --out {out}/gpu0/default-vs-cached-gpt-1b --name gpt-1b --no-plots"
    ]
    assert by_gpu["1"] == [  # two parts one after the other on GPU 1
        "python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/compare/test_lean_layer.py",
        "coat-compare --preset llama2-7b-layer "
        "--modes bf16-local,bf16,te-fp8-delayed,te-fp8-current,te-fp8-block,te-fp8-store,coat,coat-recompute "
        f"--out {out}/gpu1/layer-llama2-7b --name llama2-7b-layer --no-plots",
    ]
    assert by_gpu["2"] == [
        "coat-compare --preset llama2-7b --dp 4 --micro-batch 4 --global-batch 64 --steps 6 --modes bf16,coat "
        "--cuda-graphs local --overlap-grad-reduce --overlap-param-gather --step-timeout 150 --run-timeout 200 "
        f"--out {out}/gpu2/dp4-llama2-7b --name llama2-7b-dp4-mb4-overlap --no-plots"
    ]
    # each part's folder comes back as one archive, with its logs
    left = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert left == [
        "gpu0.txt", "gpu0/default-vs-cached-gpt-1b.tgz", "gpu1.txt", "gpu1/kernel-launches.tgz",
        "gpu1/layer-llama2-7b.tgz", "gpu2.txt", "gpu2/dp4-llama2-7b.tgz",
    ], left  # fmt: skip
    with tarfile.open(out / "gpu1" / "kernel-launches.tgz") as archive:
        assert {"./gpu.txt", "./lean-path.log"} <= set(archive.getnames())
    assert "=== GPU 1: kernel-launches + layer-llama2-7b" in proc.stdout


def test_accuracy_runs_runs_the_protocol_packed_on_every_gpu_and_keeps_its_rows(stand_ins):
    """accuracy-runs is one process for the whole host (the runner spreads the runs over the GPUs):
    the protocol's runner with the state kept on the machine, the committed rows as done, then the
    rows kept into the part's folder and the blind power gate."""
    tmp_path, env = stand_ins
    committed = tmp_path / "rows.jsonl.gz"
    committed.write_bytes(b"")
    env = {**env, "ACCURACY_STATE": str(tmp_path / "state"), "ACCURACY_ROWS": str(committed), "PER_DEVICE": "6"}
    proc = subprocess.run(
        ["bash", str(RUNNER), "accuracy-runs", "gpt-125m-wsd", "9-24", "530"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out, state = tmp_path / "out" / "accuracy-runs", tmp_path / "state"
    calls = [c.split(" ", 1)[1] for c in (tmp_path / "calls").read_text().splitlines()]
    assert calls[1:] == [
        f"python3 -m coat_compare.protocol run gpt-125m-wsd --state {state} --seeds 9-24 --deadline 530 "
        f"--per-device 6 --guess-step-s 0.6 --done {committed}",
        f"python3 -m coat_compare.protocol keep {state} --into {out}/rows.jsonl",
        f"python3 -m coat_compare.protocol power gpt-125m-wsd {state} {committed}",
    ]
    assert (tmp_path / "out" / "accuracy-runs.tgz").exists()


def test_a_part_past_the_limit_is_stopped_and_what_it_wrote_comes_back(stand_ins):
    tmp_path, env = stand_ins
    proc = subprocess.run(
        ["bash", str(RUNNER), "--each-gpu", "speed-gpt-1b", "kernel-launches"],
        capture_output=True, text=True, env={**env, "LIMIT": "2", "STAND_IN_SLEEP": "1"}, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    assert "stopped after 2 s (LIMIT): what it wrote is packed" in (out / "gpu0.txt").read_text()
    assert (out / "gpu0" / "speed-gpt-1b.tgz").exists() and not (out / "gpu0" / "speed-gpt-1b").exists()
    assert (out / "gpu1" / "kernel-launches.tgz").exists()  # python3's stand-in does not sleep


def test_each_gpu_gives_a_part_the_environment_its_words_name(stand_ins):
    """NAME=VALUE words before a part are its environment alone (two accuracy protocols at once, each
    with its state), and LIMIT among them is that part's time limit."""
    tmp_path, env = stand_ins
    proc = subprocess.run(
        ["bash", str(RUNNER), "--each-gpu", "LIMIT=2 STAND_IN_SLEEP=1 speed-gpt-1b",
         f"ACCURACY_STATE={tmp_path}/s125 PER_DEVICE=2 accuracy-runs gpt-125m-wsd 7 560 + kernel-launches"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    assert "stopped after 2 s (LIMIT): what it wrote is packed" in (out / "gpu0.txt").read_text()
    calls = (tmp_path / "calls").read_text().splitlines()
    assert (
        f"gpu=1 python3 -m coat_compare.protocol run gpt-125m-wsd --state {tmp_path}/s125 --seeds 7 --deadline 560 "
        "--per-device 2 --guess-step-s 0.6" in calls
    )
    after = [c for c in calls if c.startswith("gpu=1 python3 -m pytest")]
    assert after and "stopped after" not in (out / "gpu1.txt").read_text()  # the next part, without the words


def test_wrong_calls_fail_before_any_set_up(stand_ins):
    tmp_path, env = stand_ins
    proc = subprocess.run(["bash", str(RUNNER), "no-such-part"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 2 and "unknown part no-such-part: bash scripts/gpu_evidence.sh --help" in proc.stderr
    proc = subprocess.run(["bash", str(RUNNER), "bash"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 2  # a word of the header that is not a part
    proc = subprocess.run(
        ["bash", str(RUNNER), "--each-gpu", "gpu-tests", "gpu-tests", "gpu-tests", "gpu-tests"],
        capture_output=True, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2 and "got 4 parts but this machine has 3 GPUs" in proc.stderr
    assert not (tmp_path / "calls").exists()  # nothing installed, nothing run


def test_build_apex_refuses_what_is_not_an_apex_source_tree(tmp_path):
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "build_apex.sh"), str(tmp_path)], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "is not an NVIDIA apex source tree" in proc.stderr
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "build_apex.sh")], capture_output=True, text=True)
    assert proc.returncode != 0 and "usage: build_apex.sh SRC" in proc.stderr
