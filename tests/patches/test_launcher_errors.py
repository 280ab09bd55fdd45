"""Every bad input of coat-megatron-run and coat-megatron-demo ends in one short message and exit code 2,
and the --coat-* flags are listed by --coat-help, --help and SCRIPT.py --help.

Most cases fail before Megatron starts and run in well under a second; the few that go through
Megatron's parser and validate_args (on the CPU) take a few seconds each."""

import argparse
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from megatron_argv import MOCK_MODEL, parse

from coat_patches import demo, launch
from coat_patches.arguments import KNOBS, CoatArgumentError, add_coat_arguments, flag
from coat_patches.parallel_layout import ParallelLayoutError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "pretrain_gpt.py")
ARGUMENT_TABLE = "------------------------ arguments ------------------------"


def every_coat_flag() -> list[str]:
    """The flags add_coat_arguments adds, KNOBS included: what the help must list."""
    parser = add_coat_arguments(argparse.ArgumentParser(add_help=False))
    flags = [a.option_strings[0] for a in parser._actions]
    assert {flag(name) for name in KNOBS} <= set(flags) and "--coat-fp8" in flags
    return flags


def run(module: str, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", module, *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def assert_one_error(done: subprocess.CompletedProcess, *words: str) -> None:
    """Exit code 2, no traceback, no Megatron argument table, and a short stderr ending in one error
    message (COAT's lists each problem on a line of its own) that has ``words``."""
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Traceback" not in done.stdout
    assert ARGUMENT_TABLE not in done.stdout
    assert len(done.stderr.splitlines()) < 5, done.stderr  # a CPU without a CUDA runtime adds one torch log line
    assert done.stderr.count("error: ") == 1, done.stderr
    message = done.stderr[done.stderr.index("error: ") :]
    assert all(w in message for w in words), message


# coat-megatron-run: help


def test_coat_help_lists_every_flag_with_its_default():
    done = run("coat_patches.launch", "--coat-help")
    assert done.returncode == 0, done.stderr
    entries = {}  # flag -> its help entry (the lines up to the next flag)
    for line in done.stdout.splitlines():
        if line.startswith("  --"):
            current = line.split()[0]
            entries[current] = line
        elif line.startswith("   "):
            entries[current] += " " + line.strip()
    assert list(entries) == every_coat_flag()
    for name, (kwargs, help_text) in KNOBS.items():
        assert help_text.split()[0] in entries[flag(name)]
    assert all("default" in entry for entry in entries.values()), entries
    assert "(default off)" in entries["--coat-fp8"] and "(default on)" in entries["--coat-expansion"]


def test_launcher_help_has_the_usage_and_the_coat_flags(capsys):
    with pytest.raises(SystemExit) as e:
        launch.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: coat-megatron-run [--cpu] SCRIPT.py")
    assert all(f in out for f in every_coat_flag())


def test_script_help_lists_the_coat_flags_and_says_why_megatron_cannot():
    from coat_patches.help import megatron_help_failure

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        failure = megatron_help_failure()
    done = run("coat_patches.launch", "--cpu", EXAMPLE, "--num-layers", "2", "--help")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert all(f in done.stdout for f in every_coat_flag())
    if failure is not None:  # megatron-core 0.19.2: a bare '%' in one help text
        assert f"pretrain_gpt.py --help: {failure}" in done.stdout


def test_megatron_help_failure_names_the_flag_whose_help_breaks(monkeypatch):
    import megatron.training.arguments as arguments

    from coat_patches.help import megatron_help_failure

    def megatron_arguments(broken: bool):
        def add(parser):
            parser.add_argument("--fine", type=float, help="a fraction (default %(default)s)")
            parser.add_argument("--broken", type=float, help="headroom (e.g. 1.10 = 10%)." if broken else "headroom")
            return parser

        return add

    monkeypatch.setattr(arguments, "add_megatron_arguments", megatron_arguments(broken=True))
    failure = megatron_help_failure()
    assert "Megatron's own --help fails" in failure and "--broken" in failure and "--fine" not in failure
    monkeypatch.setattr(arguments, "add_megatron_arguments", megatron_arguments(broken=False))
    assert megatron_help_failure() is None


# coat-megatron-run: the script


def test_missing_script():
    assert_one_error(run("coat_patches.launch", "nothere.py"), "nothere.py", "does not exist", "pretrain script")


def test_script_that_is_not_python(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a script\n")
    assert_one_error(run("coat_patches.launch", str(notes)), "notes.txt is not a Python script", ".py")


def test_no_script_and_unknown_launcher_options():
    assert_one_error(run("coat_patches.launch"), "no pretrain script", "examples/pretrain_gpt.py")
    done = run("coat_patches.launch", "--coat-fp8", EXAMPLE)
    assert_one_error(done, "--coat-fp8 is not an option of coat-megatron-run", "after SCRIPT.py")


# coat-megatron-run: Megatron's and COAT's arguments (Megatron's parser and validate_args on the CPU)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--coat-fp8", "--fp8-format", "hybrid"], ["--coat-fp8 cannot run with these arguments"]),
        (["--coat-group-size", "32"], ["--coat-group-size has no effect without --coat-fp8", "add --coat-fp8"]),
        (["--coat-fp9"], ["unrecognized arguments: --coat-fp9", "did you mean --coat-fp8?", "--coat-help"]),
        (["--coat-fp8", "--coat-group-size", "17"], ["argument --coat-group-size: invalid choice: 17"]),
        (
            ["--num-attention-heads", "3"],
            ["Megatron's validate_args refuses the arguments", "num_attention_heads", "arguments.py:"],
        ),
        (["--hidden-size", "-5"], ["--hidden-size -5: must be 1 or more"]),
        (["--num-layers", "0"], ["--num-layers 0: must be 1 or more"]),
        (["--save", "/proc/no-such-place"], ["--save /proc/no-such-place: cannot write there", "a directory you can"]),
    ],
    ids=["coat-check", "knob-without-coat-fp8", "misspelt-flag", "bad-knob-value", "megatron-check",
         "negative-size", "zero-layers", "unwritable-save"],
)  # fmt: skip
def test_bad_arguments_end_in_one_line(argv, words):
    done = run("coat_patches.launch", "--cpu", EXAMPLE, *MOCK_MODEL, *argv)
    assert_one_error(done, *words)
    assert done.stdout == ""  # Megatron's start-up lines and argument table were held back and dropped


def test_coat_check_runs_before_megatron_prints_its_arguments(monkeypatch, capsys):
    """In one process: the table comes out when the checks pass, never when COAT's check fails."""

    def parse_and_validate(*argv):
        parse(monkeypatch, *MOCK_MODEL, *argv)

    with pytest.raises(CoatArgumentError, match="drop --fp8-format"):
        parse_and_validate("--coat-fp8", "--fp8-format", "hybrid")
    assert ARGUMENT_TABLE not in capsys.readouterr().out
    parse_and_validate("--coat-fp8")
    assert ARGUMENT_TABLE in capsys.readouterr().out


def test_held_output_is_let_out_in_order_or_dropped_on_an_argument_error(capsys):
    from coat_patches.argument_errors import held_output

    with warnings.catch_warnings():  # show warnings on stderr, not in pytest's record
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *args, **kwargs: print(f"warning: {message}", file=sys.stderr)
        with held_output(streams=True):
            print("first")
            print("second", file=sys.stderr)
            warnings.warn("third", UserWarning, stacklevel=1)
            assert capsys.readouterr() == ("", "")  # nothing out yet
    out, err = capsys.readouterr()
    assert out == "first\n" and err.index("second") < err.index("third")
    with pytest.raises(CoatArgumentError), held_output(streams=True):
        print("the table")
        raise CoatArgumentError("bad")
    assert capsys.readouterr() == ("", "")


# coat-megatron-demo


@pytest.fixture
def no_training(monkeypatch):
    """The demo must refuse bad values before it starts a run."""

    def run(*args, **kwargs):
        raise AssertionError("the demo started a training run")

    monkeypatch.setattr(demo, "run", run)


@pytest.mark.parametrize("iters", ["0", "-3", "1"])
def test_demo_refuses_too_few_iterations(iters, no_training, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        demo.main(["--iters", iters, "--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"argument --iters: {iters} is too few" in err
    assert f"--iters {demo.MIN_ITERS} or more" in err


def test_demo_accepts_the_smallest_number_of_iterations(monkeypatch, tmp_path):
    started = []

    def run(mode, flags, iters, out, cpu=False):
        started.append(iters)
        raise SystemExit(0)

    monkeypatch.setattr(demo, "run", run)
    with pytest.raises(SystemExit):
        demo.main(["--iters", str(demo.MIN_ITERS), "--out", str(tmp_path)])
    assert started == [demo.MIN_ITERS] and demo.warmup_iters(demo.MIN_ITERS) < demo.MIN_ITERS


def test_demo_out_is_created_or_refused(no_training, capsys, tmp_path):
    a_file = tmp_path / "report.txt"
    a_file.write_text("")
    for out, words in [(a_file, "is a file: pass a directory"), (a_file / "sub", "is not a writable directory")]:
        with pytest.raises(SystemExit) as e:
            demo.main(["--iters", "2", "--out", str(out)])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--out {out} {words}" in err, err
    assert demo.prepare_out(tmp_path / "new" / "dir") is None and (tmp_path / "new" / "dir").is_dir()


def test_demo_bad_value_from_the_command_line(tmp_path):
    assert_one_error(run("coat_patches.demo", "--iters", "0", "--out", str(tmp_path)), "argument --iters: 0 is too few")
    assert_one_error(run("coat_patches.demo", "--iters", "-3", "--out", str(tmp_path)), "--iters 2 or more")


# coat-megatron-run: parallel layouts that cannot split the model (checked before Megatron's own checks)


def layout_problem(monkeypatch, world: int, *argv: str) -> str:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ParallelLayoutError) as e:
        parse(monkeypatch, *MOCK_MODEL, *argv)
    return str(e.value)


def test_heads_and_query_groups_that_tensor_parallelism_cannot_split(monkeypatch):
    # MOCK_MODEL: 4 heads, hidden 128
    text = layout_problem(monkeypatch, 8, "--tensor-model-parallel-size", "8")
    assert text == (
        "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 8: "
        "use a --tensor-model-parallel-size among 1, 2, 4"
    )
    six_heads = ("--num-attention-heads", "6", "--hidden-size", "192", "--group-query-attention")
    text = layout_problem(monkeypatch, 4, *six_heads, "--num-query-groups", "3", "--tensor-model-parallel-size", "2")
    # TP 2 divides the 6 heads but neither splits nor replicates 3 query groups; TP 1, 3 and 6 do both
    assert text == (
        "--num-query-groups 3 is neither a multiple nor a divisor of --tensor-model-parallel-size 2: use a "
        "--tensor-model-parallel-size among 1, 3, 6 (it must divide the 6 heads, and the 3 query groups must split "
        "or be replicated evenly)"
    )


def test_layers_that_pipeline_stages_cannot_split(monkeypatch):
    # MOCK_MODEL: 2 layers
    text = layout_problem(monkeypatch, 4, "--num-layers", "6", "--pipeline-model-parallel-size", "4")
    assert text.startswith(
        "--num-layers 6 is not divisible by --pipeline-model-parallel-size 4: use a --pipeline-model-parallel-size among 1, 2, 3, 6"
    )
    assert "--decoder-first-pipeline-num-layers" in text
    text = layout_problem(
        monkeypatch,
        2,
        "--num-layers",
        "6",
        "--pipeline-model-parallel-size",
        "2",
        "--num-virtual-stages-per-pipeline-rank",
        "2",
    )
    assert text == (
        "--num-layers 6 is not divisible by --pipeline-model-parallel-size 2 x --num-virtual-stages-per-pipeline-rank 2 = 4: "
        "each pipeline rank holds 3 layers; use a --num-virtual-stages-per-pipeline-rank among 3"
    )
    text = layout_problem(
        monkeypatch,
        2,
        "--num-layers",
        "8",
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers-per-virtual-pipeline-stage",
        "3",
    )
    assert text.endswith("use one among 1, 2")


def test_uneven_pipeline_options_are_left_to_megatron(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = parse(
        monkeypatch, *MOCK_MODEL, "--num-layers", "3", "--pipeline-model-parallel-size", "2",
        "--decoder-first-pipeline-num-layers", "1",
    )  # fmt: skip
    assert args.num_layers == 3 and args.decoder_first_pipeline_num_layers == 1


def test_world_size_that_is_not_a_multiple_of_the_model_parallel_size(monkeypatch):
    text = layout_problem(monkeypatch, 6, "--tensor-model-parallel-size", "4")
    # the layouts named on 6 processes are those that also split this model (4 heads, 2 layers)
    assert text == (
        "the world size 6 (processes) is not a multiple of --tensor-model-parallel-size 4 x --pipeline-model-parallel-size 1 = 4: "
        "run a multiple of 4 processes (4, 8, 12, 16, ...), or on 6 use TP 1 x PP 1, TP 1 x PP 2, TP 2 x PP 1 "
        "(the rest of the world is data parallel)"
    )
    text = layout_problem(monkeypatch, 4, "--pipeline-model-parallel-size", "2", "--context-parallel-size", "4")
    assert "x --context-parallel-size 4 = 8" in text and "on 4 use TP 1 x PP 1 x CP 4" in text


@pytest.mark.parametrize(
    "world, argv, words",
    [
        ("3", ["--tensor-model-parallel-size", "2"], ["the world size 3 (processes) is not a multiple", "TP 1 x PP 1"]),
        (
            "2",
            "--tensor-model-parallel-size 2 --num-attention-heads 6 --hidden-size 192 --group-query-attention "
            "--num-query-groups 3".split(),
            ["--num-query-groups 3 is neither a multiple nor a divisor", "among 1, 3, 6"],
        ),
        ("2", ["--pipeline-model-parallel-size", "2", "--num-layers", "3"], ["--num-layers 3 is not divisible"]),
        # Megatron's own checks come out as one line too: an assertion and a ValueError of validate_args
        (
            "1",
            ["--num-attention-heads", "3"],
            ["Megatron's validate_args refuses the arguments", "num_attention_heads"],
        ),
        (
            "1",
            ["--fp4-param-gather"],
            ["Megatron's validate_args refuses the arguments", "--fp4-param-gather must be used"],
        ),
    ],
    ids=["world-size", "query-groups", "layers", "megatron-assertion", "megatron-value-error"],
)
def test_bad_layouts_end_in_one_line_before_any_work(world, argv, words):
    """Through the launcher as a process: exit code 2, one line, before Megatron's table of arguments
    or any process group (a world of several processes here has only one: it would wait for the others)."""
    environment = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": world, "MASTER_ADDR": "127.0.0.1"}
    environment.setdefault("MASTER_PORT", "29599")
    command = [sys.executable, "-m", "coat_patches.launch", "--cpu", EXAMPLE, *MOCK_MODEL, *argv]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT, env=environment)
    assert_one_error(done, *words)
    assert done.stdout == ""


# coat-megatron-run: what Megatron finds late about a run's own arguments (coat_patches.run_arguments)


def test_a_garbage_checkpoint_index_ends_in_one_line_not_a_silent_exit_0(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("garbage\n")
    done = run("coat_patches.launch", "--cpu", EXAMPLE, *MOCK_MODEL, "--load", str(tmp_path))
    assert_one_error(done, "latest_checkpointed_iteration.txt holds 'garbage'", "or remove it")


def test_checks_of_the_run_arguments_pass_good_values_and_indexes(tmp_path):
    from coat_patches.run_arguments import RunArgumentError, check_run_args

    good = argparse.Namespace(hidden_size=64, num_layers=2, ffn_hidden_size=None, save=str(tmp_path / "s"), load=None)
    assert check_run_args(good) == [] and (tmp_path / "s").is_dir()
    for text in ("12\n", "release"):
        (tmp_path / "latest_checkpointed_iteration.txt").write_text(text)
        assert check_run_args(argparse.Namespace(load=str(tmp_path))) == []
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("-3")
    with pytest.raises(RunArgumentError, match="holds '-3'"):
        check_run_args(argparse.Namespace(load=str(tmp_path)))


def test_without_apex_on_a_gpu_the_launcher_turns_gradient_accumulation_fusion_off(monkeypatch):
    from coat_patches import run_arguments

    monkeypatch.setattr(run_arguments.importlib.util, "find_spec", lambda name: None)
    args, notice = run_arguments.gradient_fusion_args(["--bf16"], gpu=True)
    assert args == ["--bf16", "--no-gradient-accumulation-fusion"] and "fused_weight_gradient_mlp_cuda" in notice
    assert run_arguments.gradient_fusion_args(["--bf16"], gpu=False) == (["--bf16"], None)  # the CPU loop does it
    given = ["--no-gradient-accumulation-fusion"]
    assert run_arguments.gradient_fusion_args(given, gpu=True) == (given, None)
    monkeypatch.setattr(run_arguments.importlib.util, "find_spec", lambda name: object())  # apex there: left on
    assert run_arguments.gradient_fusion_args(["--bf16"], gpu=True) == (["--bf16"], None)


def test_ctrl_c_ends_the_launcher_with_one_line_and_status_130(monkeypatch, capsys):
    def interrupted(script, script_args, cpu=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "run_script", interrupted)
    with pytest.raises(SystemExit) as e:
        launch.main([EXAMPLE, *MOCK_MODEL])
    assert e.value.code == 130
    err = capsys.readouterr().err
    assert err == "coat-megatron-run: interrupted (Ctrl-C)\n"
