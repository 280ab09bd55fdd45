"""coat-compare refuses what it cannot run before any work, keeps every row it measured, and says
in its exit status whether a row failed.

- A bad value (steps that leave nothing to time, a micro-batch, sequence or global batch below 1, a
  layout that does not divide, an --out that cannot be written) is one line on stderr and exit
  status 2: no traceback, nothing trained, no process started.
- Each row is appended to ``{out}/{name}.partial.jsonl`` as it is measured; a job that dies later
  leaves its rows there, a job that finishes replaces the file by its report.
- A failed row (not out of memory, not a skip) makes the exit status 1, after the report.
- Speed goals judged on CPU rows are "not applicable" (n/a), memory goals are judged.

The in-process tests replace the work (training, process start) with a function that fails the
test if called; the subprocess tests run the command as a user does.
"""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from coat_compare import cli, job, parallel, probe, report, resume, run, search
from coat_compare.goals import evaluate
from coat_compare.report import RowLog, goals_table, read_jsonl
from coat_compare.search import Try


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture
def no_work(monkeypatch):
    """Any training, process start or process group fails the test: a refusal must come first."""

    def started(*args, **kwargs):
        raise AssertionError("the job started work on a command line it should have refused")

    for name in ("run_mode", "run_in_processes"):
        monkeypatch.setattr(run, name, started)
    for command in ("search", "resume", "layouts"):
        monkeypatch.setitem(job.MEASURES, command, started)
    monkeypatch.setattr(parallel, "initialize", started)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def refused(argv, capsys) -> str:
    """Run the job in-process on ``argv``; assert exit status 2 and one short line; return it."""
    with pytest.raises(SystemExit) as e:
        job.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one line, not a usage screen or a traceback
    assert lines[0].startswith("coat-compare: error: ") and "Traceback" not in err
    return lines[0]


BAD = [
    # steps: tiny leaves its first 2 steps out of the timing, so 3 is the fewest
    (["--steps", "0"], ["--steps 0 leaves no step to time", "use --steps 3 or more"]),
    (["--steps", "-5"], ["--steps -5", "use --steps 3 or more"]),
    (["--steps", "2"], ["--steps 2", "use --steps 3 or more"]),
    (["--preset", "gpt-1b", "--steps", "3"], ["gpt-1b leaves its first 3 steps", "use --steps 4 or more"]),
    (["--micro-batch", "0"], ["--micro-batch 0: must be 1 or more"]),
    (["--micro-batch", "-1"], ["--micro-batch -1: must be 1 or more"]),
    (["--seq", "0"], ["--seq 0: must be 1 or more"]),
    (["--global-batch", "0"], ["--global-batch 0: must be 1 or more"]),
    (["--lr", "0"], ["--lr 0.0: the peak learning rate must be above 0"]),
    (["--adam-eps", "0"], ["--adam-eps 0.0: must be above 0", "Megatron's default is 1e-8"]),
    (
        ["--global-batch", "7", "--micro-batch", "2"],
        ["global batch 7 is not a multiple of micro-batch 2 x DP 1", "use --global-batch 2, 4, 6, 8"],
    ),
    (["--tp", "0"], ["--tp 0: must be 1 or more"]),
    (["--dp", "-1"], ["--dp -1: must be 1 or more"]),
    (["--pp", "0"], ["--pp 0: must be 1 or more"]),
    # tiny: 4 heads, 2 layers, hidden 64, FFN 128
    (["--tp", "3"], ["--tp 3: tiny's 4 attention heads (4 query groups) do not split", "use --tp 1, 2, 4"]),
    (["--pp", "3"], ["--pp 3: tiny's 2 layers do not split into 3 equal stages", "use --pp x --vpp in 1, 2"]),
    (["--pp", "2", "--vpp", "2"], ["--pp 2 x --vpp 2: tiny's 2 layers do not split into 4", "in 1, 2"]),
    (["--vpp", "2"], ["--vpp 2: virtual pipeline stages interleave 2 or more pipeline stages", "give --pp 2"]),
    (
        ["--preset", "gpt-1b", "--pp", "2", "--vpp", "2", "--global-batch", "12"],
        ["runs the micro-batches of a step in groups of --pp 2", "3 per rank", "give --global-batch 8"],
    ),
    (["--preset", "tiny-layer", "--pp", "2"], ["one layer: pipeline stages (--pp, --vpp) need an end-to-end preset"]),
    (["--pp", "2", "--cuda-graphs", "none,full"], ["with --pp use --cuda-graphs none,local"]),
    (["layouts", "1,tp2xtp2"], ["layout 'tp2xtp2': write 1 (one GPU) or x-joined sizes, each once"]),
    (["layouts", "1,tp2,tp2"], ["layout 'tp2' is given twice"]),
    (["layouts", "tp2"], ["layouts compares layouts with the first: give two or more"]),
    (["layouts", "1,pp3"], ["--pp 3: tiny's 2 layers do not split"]),
    (["layouts", "1,dp2", "--search-steps", "4"], ["unrecognized arguments: --search-steps 4"]),
    (["--layouts", "1,dp2"], ["--layouts is the sub-command layouts now: coat-compare layouts [options]"]),
    (["--search"], ["--search is the sub-command search now: coat-compare search [options]"]),
    (["--resume-check", "--dp", "2"], ["--resume-check is the sub-command resume now"]),
    (["--summarize"], ["--summarize is the sub-command summarize now"]),
    (["run", "--resume-at", "dp2"], ["unrecognized arguments: --resume-at dp2"]),
    (["--step-timeout", "0"], ["--step-timeout 0.0: must be more than 0"]),
    (
        ["search", "--search-steps", "2"],
        ["--search-steps 2 leaves no step of a try to time", "use --search-steps 3 or more"],
    ),
    (["search", "--search-steps", "0"], ["use --search-steps 3 or more"]),
    (["search", "--search-start", "0"], ["--search-start 0: must be 1 or more"]),
    (["search", "--global-batch", "8"], ["drop --global-batch", "--search-micro-batches N"]),
    (["search", "--search-micro-batches", "0"], ["--search-micro-batches 0: must be 1 or more"]),
    (["--preset", "tiny-layer", "--steps", "5"], ["drop --steps"]),
    (["resume", "--dp", "2", "--steps", "4"], ["use --steps 5 or more"]),
    (["resume", "--dp", "2", "--steps", "6", "--save-step", "4"], ["use --steps 7 or more"]),
    (
        ["--modes", "coat", "--save", "{tmp}/ckpt", "--save-step", "40"],
        ["--save-step 40 is not a step of this run", "give --save-step 0 to 39"],
    ),
    (["--stop-after-save"], ["--stop-after-save ends a run at its --save: give --save DIR"]),
    (["--modes", "bf16,coat", "--save", "{tmp}/ckpt"], ["give one mode (--modes MODE), a job per mode"]),
    (
        ["--modes", "coat", "--save", "{tmp}/ckpt", "--save-step", "1", "--stop-after-save"],
        ["--stop-after-save ends the run after step 1, which leaves no step to time", "to 39"],
    ),
    (["--modes", "coat", "--load", "{tmp}/missing"], ["--load", "no such directory"]),
    (["--modes", "bf16,fp4"], ["unknown mode 'fp4'"]),
    (["--name", "a/b"], ["give a file name without '/'"]),
    (["--repeat", "0"], ["--repeat 0: the N-th run counts from 1"]),
]


@pytest.mark.parametrize("argv, words", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_value_is_one_line_and_exit_2_before_any_work(argv, words, tmp_path, capsys, no_work):
    out = tmp_path / "out"
    line = refused([a.format(tmp=tmp_path) for a in argv] + ["--out", str(out)], capsys)
    for word in words:
        assert word in line, line
    assert not out.exists()  # refused before --out was made
    assert not (tmp_path / "ckpt").exists()


def test_the_fewest_steps_train(capsys, no_work):
    """The minimum the messages name is the true one: it parses (and test_job runs tiny at 4)."""
    assert cli.parse_args(["--steps", "3"]).steps == 3
    assert cli.parse_args(["--preset", "gpt-1b", "--steps", "4"]).steps == 4
    assert cli.parse_args(["resume", "--dp", "2", "--steps", "5"]).steps == 5
    assert cli.parse_args(["search", "--search-steps", "3"]).search_steps == 3


def test_a_checkpoint_step_counts_toward_the_fewest_steps(tmp_path, capsys, no_work, monkeypatch):
    """With --load, training starts at the checkpoint's step: that step counts too."""
    (tmp_path / "ckpt").mkdir()
    monkeypatch.setattr(cli, "read_checkpoint", lambda directory: {"step": 4})
    line = refused(
        ["--modes", "coat", "--load", str(tmp_path / "ckpt"), "--steps", "6", "--out", str(tmp_path / "out")], capsys
    )
    assert "--steps 6 leaves no step to time after the checkpoint's step 4" in line and "use --steps 7 or more" in line
    assert cli.parse_args(["--modes", "coat", "--load", str(tmp_path / "ckpt"), "--steps", "7"]).steps == 7


def test_a_directory_that_is_no_checkpoint_is_refused(tmp_path, capsys, no_work):
    """Reading the checkpoint imports Megatron, which on a machine without CUDA may log a line of
    its own first (torch's cpp_extension): the refusal is the last line."""
    with pytest.raises(SystemExit) as e:
        job.main(["--modes", "coat", "--load", str(tmp_path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert e.value.code == 2 and len(lines) < 4 and "Traceback" not in err, err
    assert lines[-1].startswith(f"coat-compare: error: --load {tmp_path}: not a checkpoint"), err
    assert lines[-1].endswith("give the DIR an earlier --save DIR wrote")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["proc", "file", "under-a-file", "unwritable"])
def test_an_out_that_cannot_be_written_is_refused_at_once(where, tmp_path, capsys, no_work, monkeypatch):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    out = {
        "proc": "/proc/coat-compare-out",
        "file": str(a_file),
        "under-a-file": str(a_file / "out"),
        "unwritable": str(tmp_path / "read-only"),
    }[where]
    if where == "unwritable":  # as root, permissions do not stop a write: the write itself fails here

        def denied(*args, **kwargs):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(job.tempfile, "mkstemp", denied)
    line = refused(["--out", out], capsys)
    assert f"--out {out}" in line and "give --out a directory you can write to" in line
    why = {
        "proc": "No such file or directory",
        "file": "is a file, not a directory",
        "under-a-file": "Not a directory",
        "unwritable": "Permission denied",
    }
    assert why[where] in line
    assert a_file.read_text() == "x"


def test_the_out_check_leaves_no_file_behind(tmp_path):
    job.check_directory(str(tmp_path / "new" / "out"), "--out")
    assert (tmp_path / "new" / "out").is_dir() and list((tmp_path / "new" / "out").iterdir()) == []


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--steps", "0"], ["--steps 0 leaves no step to time", "use --steps 3 or more"]),
        (["--micro-batch", "-1"], ["--micro-batch -1: must be 1 or more"]),
        (["--out", "/proc/coat-compare-out"], ["--out /proc/coat-compare-out: cannot write there"]),
    ],
)
def test_the_command_prints_one_line_and_exits_2(argv, words, tmp_path):
    out = ["--out", str(tmp_path / "out")] if "--out" not in argv else []
    proc = subprocess.run(
        [sys.executable, "-m", "coat_compare", *argv, *out],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert all(word in lines[0] for word in words), lines
    assert proc.stdout == "" and not (tmp_path / "out").exists()


def test_a_job_that_dies_after_its_first_row_keeps_it(tmp_path):
    """A real bf16 row, then the coat run is interrupted: the bf16 row is on disk."""
    driver = (
        "import sys\n"
        "from coat_compare import job, run\n"
        "real = run.run_mode\n"
        "def run_mode(preset, mode, args, graphs='none'):\n"
        "    if mode.name == 'coat':\n"
        "        raise KeyboardInterrupt\n"
        "    return real(preset, mode, args, graphs)\n"
        "run.run_mode = run_mode\n"
        "sys.exit(job.main(sys.argv[1:]))\n"
    )
    argv = ["--modes", "bf16,coat", "--steps", "3", "--out", str(tmp_path), "--no-plots"]
    proc = subprocess.run(
        [sys.executable, "-c", driver, *argv], capture_output=True, text=True, timeout=300, env=_env(), check=False
    )
    assert proc.returncode != 0 and "KeyboardInterrupt" in proc.stderr
    partial = tmp_path / "tiny.partial.jsonl"
    assert f"the rows it measured (1) are in {partial}" in proc.stderr
    (row,) = read_jsonl(partial)
    assert (row["mode"], row["status"], len(row["losses"])) == ("bf16", "ok", 3)
    assert not (tmp_path / "tiny.jsonl").exists() and not (tmp_path / "tiny.md").exists()


def _fake_run_mode(statuses: dict):
    """``run_mode`` that measures nothing: each mode's row with the status (and reason) given."""

    def run_mode(preset, mode, args, graphs="none"):
        status, reason = statuses[mode.name]
        return {**probe.new_row(preset.kind, preset, mode, args, graphs), "status": status, "reason": reason}

    return run_mode


@pytest.fixture
def in_process(monkeypatch):
    """The job in this process without a process group (its rows come from a fake run_mode)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(parallel, "initialize", lambda tp, dp, stack, pp=1, vpp=1: None)


def test_rows_measured_before_the_report_fails_stay_on_disk(tmp_path, monkeypatch, in_process):
    monkeypatch.setattr(
        run,
        "run_mode",
        _fake_run_mode(
            {"bf16": ("oom", "out of memory at micro-batch 8"), "coat": ("oom", "out of memory at micro-batch 8")}
        ),
    )

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "write_report", disk_full)
    with pytest.raises(OSError, match="No space left"):
        job.main(["--modes", "bf16,coat", "--out", str(tmp_path), "--no-plots"])
    rows = read_jsonl(tmp_path / "tiny.partial.jsonl")
    assert [(r["mode"], r["status"]) for r in rows] == [("bf16", "oom"), ("coat", "oom")]


def test_a_failed_row_exits_1_after_the_report(tmp_path, monkeypatch, capsys, in_process):
    monkeypatch.setattr(
        run,
        "run_mode",
        _fake_run_mode({"bf16": ("oom", "out of memory at micro-batch 8"), "coat": ("failed", "RuntimeError: boom")}),
    )
    assert job.main(["--modes", "bf16,coat", "--out", str(tmp_path), "--no-plots"]) == 1
    assert "| coat | none | failed: RuntimeError: boom |" in (tmp_path / "tiny.md").read_text()
    assert [r["status"] for r in read_jsonl(tmp_path / "tiny.jsonl") if r["kind"] == "train"] == ["oom", "failed"]
    assert not (tmp_path / "tiny.partial.jsonl").exists()  # the report replaced it
    err = capsys.readouterr().err
    assert "coat-compare: 1 of 2 rows failed, the first coat (graphs: none): RuntimeError: boom" in err


def test_out_of_memory_and_skipped_rows_exit_0(tmp_path, monkeypatch, in_process):
    monkeypatch.setattr(
        run,
        "run_mode",
        _fake_run_mode(
            {"bf16": ("oom", "out of memory at micro-batch 8"), "coat": ("skipped", "CUDA graphs need a CUDA GPU")}
        ),
    )
    assert job.main(["--modes", "bf16,coat", "--out", str(tmp_path), "--no-plots"]) == 0
    assert [r["status"] for r in read_jsonl(tmp_path / "tiny.jsonl") if r["kind"] == "train"] == ["oom", "skipped"]


def test_search_rows_are_kept_as_each_mode_is_done(tmp_path, monkeypatch, in_process):
    def probe_fits(args, world_size, fit_memory_gib, **per_step):
        if args[args.index("--modes") + 1] == "coat":
            raise KeyboardInterrupt
        return lambda n: Try(n, n <= 2, "" if n <= 2 else "OOM", {"tokens_per_s": 100.0 * n, "peak_MiB": 10.0 * n})

    monkeypatch.setattr(search, "probe_fits", probe_fits)
    with pytest.raises(KeyboardInterrupt):
        job.main(["search", "--modes", "bf16,coat", "--out", str(tmp_path), "--no-plots"])
    (row,) = read_jsonl(tmp_path / "tiny-search.partial.jsonl")
    assert (row["kind"], row["mode"], row["largest_micro_batch"]) == ("search", "bf16", 2)


def test_a_failed_resume_check_exits_1(tmp_path, monkeypatch, in_process):
    monkeypatch.setattr(
        resume,
        "resume_check",
        lambda args, preset, mode, row: {**row, "status": "failed", "reason": "resumed_1: it died"},
    )
    assert job.main(["resume", "--modes", "coat", "--dp", "2", "--out", str(tmp_path), "--no-plots"]) == 1
    (row,) = read_jsonl(tmp_path / "tiny-resume.jsonl")
    assert (row["kind"], row["status"]) == ("resume", "failed")
    assert not (tmp_path / "tiny-resume.partial.jsonl").exists()


def test_a_row_log_writes_each_row_at_once_and_only_where_enabled(tmp_path):
    log = RowLog(str(tmp_path), "x")
    log.add({"mode": "a"})
    assert read_jsonl(tmp_path / "x.partial.jsonl") == [{"mode": "a"}]  # on disk before the next row
    log.add({"mode": "b"})
    assert [r["mode"] for r in read_jsonl(tmp_path / "x.partial.jsonl")] == ["a", "b"]
    log.finish()
    assert list(tmp_path.iterdir()) == []
    quiet = RowLog(str(tmp_path), "y", enabled=False)  # a probe, or a rank other than 0
    quiet.add({"mode": "a"})
    assert quiet.rows == [{"mode": "a"}] and list(tmp_path.iterdir()) == []


def test_summary_leaves_out_the_rows_of_a_job_that_did_not_finish(tmp_path, capsys):
    row = {
        "kind": "train",
        "preset": "tiny",
        "mode": "bf16",
        "family": "bf16",
        "status": "oom",
        "reason": "out of memory",
    }
    (tmp_path / "tiny.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "tiny.partial.jsonl").write_text(json.dumps({**row, "mode": "coat", "family": "coat"}) + "\n")
    assert job.summarize(str(tmp_path)) == 0
    rows = [r for r in read_jsonl(tmp_path / "summary.jsonl") if r["kind"] != "goal"]
    assert [r["mode"] for r in rows] == ["bf16"]  # the finished report of the same name holds the job's rows
    md = (tmp_path / "summary.md").read_text()
    assert md.startswith("# coat-compare summary\n") and "PARTIAL" not in md
    capsys.readouterr()


def test_summary_of_a_job_that_was_stopped_is_marked_partial(tmp_path, capsys):
    """After Ctrl-C the measured rows are in NAME.partial.jsonl, and no NAME.jsonl: they count."""
    row = {"kind": "train", "preset": "tiny", "mode": "bf16", "family": "bf16", "status": "oom", "reason": "oom"}
    (tmp_path / "gpt.partial.jsonl").write_text(json.dumps(row) + "\n")
    assert job.summarize(str(tmp_path)) == 0
    assert [r["mode"] for r in read_jsonl(tmp_path / "summary.jsonl") if r["kind"] != "goal"] == ["bf16"]
    md = (tmp_path / "summary.md").read_text()
    assert md.startswith("# coat-compare summary (partial)\n")
    assert "PARTIAL: gpt.partial.jsonl hold the rows of jobs that did not finish" in md
    capsys.readouterr()


def _row(mode, family, device, **values):
    return {
        "kind": "train",
        "preset": "g",
        "mode": mode,
        "family": family,
        "status": "ok",
        "device": device,
        "micro_batch": 4,
        **values,
    }


def test_speed_goals_on_a_cpu_are_not_applicable_and_memory_goals_are_judged():
    def rows(device, source):
        return [
            _row("bf16", "bf16", device, tokens_per_s=100.0, peak_MiB=1000.0, memory_source=source),
            _row("coat", "coat", device, tokens_per_s=90.0, peak_MiB=500.0, memory_source=source),
        ]

    speed = "tokens/s at equal micro-batch vs the best BF16, each in its fastest configuration"
    memory = "end-to-end peak memory vs BF16, equal micro-batch"
    cpu = {g.goal: g for g in evaluate(rows("CPU", "saved-tensors"))}
    assert (cpu[speed].met, cpu[speed].measured) == (None, 0.9) and cpu[speed].missed_by == ""
    assert cpu[speed].note.startswith("not applicable: speed goals are judged on a GPU")
    # bytes counted from the saved tensors, without a GPU allocator's workspaces and caches: shown, not judged
    assert (cpu[memory].met, cpu[memory].measured) == (None, 0.5)
    assert cpu[memory].note.startswith("not applicable: memory goals are judged on a GPU")
    gpu = {g.goal: g for g in evaluate(rows("NVIDIA H100 80GB HBM3", "cuda-allocator"))}
    assert (gpu[speed].met, gpu[speed].missed_by) == (False, "18.2% below the target")
    table = goals_table(list(cpu.values()))
    assert any(line.startswith(f"| {speed} | g | >= 1.1 | 0.90 | n/a |") for line in table), table
    measured = [("te-fp8-current", "te-fp8", 10.0, 10.0), ("coat", "coat", 8.0, 6.0)]
    layer = [
        {
            "kind": "layer",
            "preset": "L",
            "mode": m,
            "family": f,
            "status": "ok",
            "device": "CPU",
            "ms": ms,
            "activation_MiB": a,
        }
        for m, f, ms, a in measured
    ]
    time_goal = {g.goal: g for g in evaluate(layer)}["per-layer fwd+bwd time vs TE FP8 current scaling"]
    assert time_goal.met is None and time_goal.note.startswith("not applicable")


def test_a_cpu_run_shows_speed_goals_not_applicable(tmp_path):
    argv = ["--modes", "bf16,coat", "--steps", "3", "--out", str(tmp_path), "--no-plots"]
    proc = subprocess.run(
        [sys.executable, "-m", "coat_compare", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    goals = {g["goal"]: g for g in read_jsonl(tmp_path / "tiny.jsonl") if g["kind"] == "goal"}
    speed = goals["tokens/s at equal micro-batch vs the best BF16, each in its fastest configuration"]
    assert speed["met"] is None and speed["note"].startswith("not applicable: speed goals are judged on a GPU")
    memory = goals["end-to-end peak memory vs BF16, equal micro-batch"]
    assert memory["met"] is None and memory["note"].startswith("not applicable: memory goals are judged on a GPU")
    md = (tmp_path / "tiny.md").read_text()
    assert "| tokens/s at equal micro-batch vs the best BF16, each in its fastest configuration | tiny | >= 1.1 |" in md
    assert " | n/a |  | not applicable: speed goals are judged on a GPU" in md
    assert not (tmp_path / "tiny.partial.jsonl").exists()


def test_a_bad_garbage_collection_mode_is_refused_before_any_work(tmp_path, capsys, no_work):
    line = refused(["--gc", "sometimes", "--out", str(tmp_path / "out")], capsys)
    assert "--gc: invalid choice: 'sometimes'" in line and "manual" in line and "auto" in line


def test_manual_collection_is_off_inside_the_block_and_restored_after():
    import gc

    assert gc.isenabled()
    with parallel.manual_gc(True):
        assert not gc.isenabled()
    assert gc.isenabled()
    with parallel.manual_gc(False):
        assert gc.isenabled()
    gc.disable()
    try:
        with parallel.manual_gc(True):
            pass
        assert not gc.isenabled()  # what was off before stays off
    finally:
        gc.enable()


def test_a_bad_wgrad_fusion_setting_is_refused_before_any_work(tmp_path, capsys, no_work):
    line = refused(["--wgrad-fusion", "maybe", "--out", str(tmp_path / "out")], capsys)
    assert "--wgrad-fusion: invalid choice: 'maybe'" in line and "'on', 'off'" in line.replace("on, off", "'on', 'off'")


def test_the_job_is_started_plainly_not_under_torchrun(tmp_path, capsys, no_work, monkeypatch):
    """Each run of several processes gets a torchrun of its own from the job: a job started under
    torchrun would run every mode in the same processes (and every rank would start runs)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    line = refused(["--tp", "2", "--out", str(tmp_path / "out")], capsys)
    assert "run coat-compare with plain python, not under torchrun" in line and "2 processes of each run" in line


def test_a_run_needs_as_many_processes_as_its_layout(tmp_path, capsys, no_work, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    line = refused(["--tp", "2", "--dp", "2", "--probe", "--out", str(tmp_path / "out")], capsys)
    assert "--tp 2 x --pp 1 x --dp 2 = 4 processes, but this run has 2" in line


def test_a_layout_needs_as_many_gpus_as_processes(tmp_path, capsys, no_work, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    line = refused(["--tp", "2", "--dp", "2", "--out", str(tmp_path / "out")], capsys)
    assert "a run of --tp x --pp x --dp = 4 processes needs 4 GPUs, one each; this machine has 2" in line


@pytest.fixture(scope="session")  # xdist may run other modules between its group's tests
def saved_checkpoint(tmp_path_factory):
    """A real checkpoint of the tiny preset (coat, DP 1), written by the job as a user writes one."""
    root = tmp_path_factory.mktemp("ckpt")
    argv = ["--modes", "coat", "--steps", "3", "--save", str(root / "ckpt"), "--save-step", "1", "--out", str(root)]
    proc = subprocess.run(
        [sys.executable, "-m", "coat_compare", *argv, "--no-plots"], capture_output=True, text=True, env=_env()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "ckpt"


def test_a_cut_checkpoint_is_one_line_before_any_work(saved_checkpoint, tmp_path, capsys, no_work):
    import shutil

    cut = tmp_path / "cut"
    shutil.copytree(saved_checkpoint, cut)
    data = sorted(cut.glob("*.distcp"))
    assert data, list(cut.iterdir())
    argv = ["--modes", "coat", "--load", str(cut), "--steps", "5", "--out", str(tmp_path / "out")]
    # one flipped byte: the checksums kept beside the files say so
    with open(data[0], "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    line = refused(argv, capsys)
    assert (
        f"--load {cut}: not a checkpoint this job can read (its file {data[0].name} does not match the checksum" in line
    )
    # a checkpoint without checksums (written before they were kept) is still checked whole
    (cut / "coat-compare.sha256").unlink()
    size = data[0].stat().st_size
    with open(data[0], "r+b") as f:
        f.truncate(size // 2)
    line = refused(argv, capsys)
    assert f"--load {cut}: not a checkpoint this job can read (its data file {data[0].name} is cut short" in line
    data[0].unlink()
    line = refused(["--modes", "coat", "--load", str(cut), "--steps", "5", "--out", str(tmp_path / "out")], capsys)
    assert f"its data file {data[0].name} is missing" in line


def test_a_checkpoint_loads_only_where_its_format_allows(saved_checkpoint, tmp_path, capsys, no_work):
    common = ["--modes", "coat", "--load", str(saved_checkpoint), "--steps", "5", "--out", str(tmp_path / "out")]
    line = refused([*common, "--tp", "2"], capsys)
    assert "was written at TP 1 x PP 1 (x 1 virtual) as dp_reshardable" in line and "--tp 1 --pp 1 --vpp 1" in line
    line = refused([*common, "--checkpoint-format", "fully_reshardable"], capsys)
    assert "holds a dp_reshardable checkpoint: give --checkpoint-format dp_reshardable" in line


def test_a_run_past_its_time_prints_its_stacks_and_is_killed(monkeypatch):
    """--run-timeout: the stalled run's processes print where they were, then the job kills them and
    goes on with a failed row whose log holds the stacks."""
    from coat_compare import probe

    stalled = (
        "import faulthandler, signal, time\n"
        "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
        "def waiting_for_a_peer():\n"
        "    time.sleep(600)\n"
        "print('started', flush=True)\n"
        "waiting_for_a_peer()\n"
    )
    monkeypatch.setattr(probe, "probe_command", lambda args, world_size: [sys.executable, "-c", stalled])
    result = probe.run_probe([], 1, timeout_s=3)
    assert result.row is None and result.error == "the run went past --run-timeout 3 s (stacks in the log)"
    assert "waiting_for_a_peer" in result.log and "started" in result.log
    assert result.seconds < 30


def test_a_stalled_run_of_several_processes_prints_every_ranks_stacks_and_is_killed(monkeypatch, tmp_path):
    """Under torchrun, which starts each rank in a session of its own: the ranks are asked for their
    stacks and killed, not only torchrun (whose death would leave them running and the job waiting
    on their pipes)."""
    from coat_compare import probe

    script = tmp_path / "stalled.py"
    script.write_text(
        "import faulthandler, os, signal, time\n"
        "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
        "def waiting_for_a_peer():\n"
        "    time.sleep(600)\n"
        # one write per line: the ranks share a pipe, unbuffered (print's pieces would interleave)
        "os.write(1, f\"rank {os.environ['RANK']} pid {os.getpid()}\\n\".encode())\n"
        "waiting_for_a_peer()\n"
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    monkeypatch.setattr(probe, "probe_command", lambda args, world_size: command)
    result = probe.run_probe([], 2, timeout_s=15)
    assert result.row is None and result.error == "the run went past --run-timeout 15 s (stacks in the log)"
    assert result.log.count("waiting_for_a_peer") >= 2, result.log[-3000:]
    pids = [int(pid) for pid in re.findall(r"rank \d pid (\d+)", result.log)]
    assert len(pids) == 2 and result.seconds < 60
    time.sleep(1)
    for pid in pids:  # killed, not left running
        assert (
            not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        )


def test_a_tensor_parallel_run_gets_megatrons_one_device_connection(monkeypatch):
    """As coat-megatron-run sets it for Megatron's own loop: TP on a GPU before Blackwell."""
    import torch

    from coat_compare import probe
    from coat_patches import device_connections

    # a job's own setting is kept as given; Megatron on a CPU sets it in-process (an earlier test's parse)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(device_connections, "gpu_compute_capability_major", lambda: 9)  # Hopper
    assert probe.run_environment(["--tp", "2", "--dp", "2"]) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert probe.run_environment(["--tp", "1", "--dp", "4"]) == {}
    monkeypatch.setattr(device_connections, "gpu_compute_capability_major", lambda: 10)  # Blackwell
    assert probe.run_environment(["--tp", "2"]) == {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert probe.run_environment(["--tp", "2"]) == {}


def test_a_run_that_stalls_after_printing_its_row_keeps_the_row(monkeypatch):
    """A run measured, then stuck in its tear-down (as per-layer CUDA graphs at TP 2 were on H200s):
    the row stands, marked, and the job goes on at --run-timeout."""
    from coat_compare import probe

    stalled = (
        "import json, time\n"
        f"print({probe.PROBE_MARK!r} + json.dumps({{'status': 'ok', 'tokens_per_s': 1.0}}), flush=True)\n"
        "time.sleep(600)\n"
    )
    monkeypatch.setattr(probe, "probe_command", lambda args, world_size: [sys.executable, "-c", stalled])
    result = probe.run_probe([], 1, timeout_s=3)
    assert result.error == "" and result.row["status"] == "ok" and result.row["tokens_per_s"] == 1.0
    assert result.row["teardown"] == "stalled after the row was printed; stopped at --run-timeout 3 s"
    assert result.seconds < 30


def test_save_steps_writes_a_checkpoint_after_each_step_and_each_loads(tmp_path, capsys, no_work):
    argv = ["--modes", "bf16", "--steps", "6", "--out", str(tmp_path / "out")]
    for extra, words in [
        (["--save-steps", "2,4"], "give --save DIR"),
        (["--save", str(tmp_path / "c"), "--save-steps", "2", "--save-step", "3"], "without --save-step"),
        (["--save", str(tmp_path / "c"), "--save-steps", "2,9"], "--save-steps 9: not a step of this run"),
        (["--save", str(tmp_path / "c"), "--save-steps", "2,x"], "comma-separated numbers"),
    ]:
        assert words in refused([*argv, *extra], capsys)


def test_save_steps_keep_the_weights_of_one_run_at_several_points(tmp_path):
    ckpt = tmp_path / "ckpt"
    common = ["--modes", "bf16", "--no-plots", "--out", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, "-m", "coat_compare", *common, "--steps", "6", "--save", str(ckpt), "--save-steps", "2,4"],
        capture_output=True,
        text=True,
        env=_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step2", "step4"]
    assert (ckpt / "step4" / "coat-compare.sha256").is_file()
    loaded = subprocess.run(
        [sys.executable, "-m", "coat_compare", *common, "--steps", "8", "--load", str(ckpt / "step4"), "--name", "b"],
        capture_output=True,
        text=True,
        env=_env(),
    )
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    row = json.loads((tmp_path / "b.jsonl").read_text().splitlines()[0])
    assert row["first_step"] == 4 and row["status"] == "ok"


def test_te_extra_state_unpickles_during_the_whole_load_and_only_then(monkeypatch):
    """TE (2.20) unpickles delayed scaling's extra state in each module's ``set_extra_state``, which
    ``load_state_dict`` calls after ``dist_checkpointing.load`` has read the files: the switch must
    hold through both (a TE run's --load failed when it covered the read alone), and no longer."""
    import os

    from megatron.core import dist_checkpointing

    from coat_compare import checkpoint as ck

    seen = []

    class Module:
        def load_state_dict(self, state):
            seen.append(os.environ.get(ck.TE_PICKLE_SWITCH))

    class Chunk:
        module = Module()

    class Optimizer:
        optimizer = type("Adam", (), {"state": {"p": {}}})()

        def load_state_dict(self, state):
            pass

    monkeypatch.delenv(ck.TE_PICKLE_SWITCH, raising=False)
    monkeypatch.setattr(ck, "checkpoint_state", lambda *args, **kwargs: {})
    monkeypatch.setattr(dist_checkpointing, "load", lambda state, directory: {"model": {}, "optimizer": {}, "step": 3})
    assert ck.load_checkpoint("ckpt", [Chunk()], Optimizer()) == 3
    assert seen == ["1"] and ck.TE_PICKLE_SWITCH not in os.environ
